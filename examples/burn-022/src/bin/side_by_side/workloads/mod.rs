//! The workloads of the table, one per file.

pub mod conv;
pub mod large;
pub mod mlp;
pub mod threads;
pub mod transformer;
