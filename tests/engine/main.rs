//! The engine on the simulated device: no GPU, no feature. One module per area; `common` holds
//! the allocator constructor, the layout helpers and the invariant check they share.

mod common;

mod config;
mod drop;
mod errors;
mod expandable;
mod layout;
mod miss_path;
mod parity;
mod props;
mod rounding;
mod stats;
mod streams;
mod threads;

#[path = "../support/child.rs"]
mod child;
