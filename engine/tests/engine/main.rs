//! The engine on the simulated device: no GPU, no feature. One module per area; `common` holds
//! the allocator constructor, the layout helpers and the invariant check they share.
//!
//! Where a new test goes: the file of the area it asserts (below); an injected device failure
//! goes in `errors`, a PyTorch rule with no other area in `parity` (name the function anyway).

mod common;

mod bad_input;
mod borrowing;
mod cached_above;
mod config;
mod cross_stream;
mod drop;
mod errors;
mod expandable;
mod fuzz;
mod layout;
mod memory_report;
mod miss_path;
mod no_caching;
mod oom_rejection;
mod oom_report;
mod outgrown;
mod panics;
mod parity;
mod pools;
mod props;
mod props_expandable;
mod props_model;
mod readings;
mod rounding;
mod scopes;
mod settings;
mod snapshot_pickle;
mod stats;
mod streams;
mod threads;
mod viewer_html;

#[path = "../../../tests/support/child.rs"]
mod child;
#[path = "../../../tests/support/ci.rs"]
mod ci;
