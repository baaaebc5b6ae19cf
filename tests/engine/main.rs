//! The engine on the simulated device: no GPU, no feature. One module per area; `common` holds
//! the allocator constructor, the layout helpers and the invariant check they share.

mod common;

mod bad_input;
mod config;
mod drop;
mod errors;
mod expandable;
mod layout;
mod memory_report;
mod miss_path;
mod oom_report;
mod panics;
mod parity;
mod props;
mod props_expandable;
mod rounding;
mod rule_edges;
mod snapshot_pickle;
mod stats;
mod streams;
mod threads;
mod viewer_html;

#[path = "../support/child.rs"]
mod child;
#[path = "../support/ci.rs"]
mod ci;
