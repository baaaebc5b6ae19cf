//! A fake CUDA driver (`libcuda`), NCCL and NVRTC over host memory that checks the driver API's
//! contracts on every call, for running burn-caching-alloc's CUDA host code without a GPU.
//! See the README beside this crate for what it implements and how it is configured.
//!
//! - `config`: the environment variables;
//! - `codes`: CUDA's result codes;
//! - `state`: the one global state, its lock, the violation log, fault injection;
//! - `memory`: device memory over host memory, virtual address ranges and mappings;
//! - `streams`: queues, events, the scheduler and the race detector;
//! - `driver`: the exported driver API functions, a file per kind (devices, contexts,
//!   allocation, virtual memory, copies, memsets, streams, events, modules, peers, errors);
//! - `nccl`: the exported NCCL functions, on the same streams (communicators, groups,
//!   operations and their execution);
//! - `nvrtc`: the exported NVRTC functions: a compiler of CUDA C++ declarations into an image
//!   of the fake's own (entry points and parameters) that the driver loads and launches;
//! - `control`: what the test harness calls (`fake_cuda_*`).

mod codes;
mod config;
mod control;
mod driver;
mod memory;
mod nccl;
mod nvrtc;
mod state;
mod streams;
