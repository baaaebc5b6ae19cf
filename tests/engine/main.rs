//! The engine on the simulated device: no GPU, no feature. One module per area; `common` holds
//! the allocator constructor, the layout helpers and the invariant check they share.

mod common;

mod config;
mod drop;
mod errors;
mod layout;
mod miss_path;
mod props;
mod rounding;
mod rule_edges;
mod stats;
mod streams;
mod threads;

#[path = "../support/child.rs"]
mod child;
