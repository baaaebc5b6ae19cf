//! CUDA through the driver API (`cudarc`): the device memory the engine allocates segments
//! from, and the pieces the CUDA server driver shares with it (streams, events, the probe).
//!
//! Every driver call first makes the device's primary context current on the calling thread,
//! so the engine and the server may call in from any thread. Nothing here panics, including
//! when `libcuda` is missing: failures are [`DeviceError`](super::DeviceError)s.

mod error;
mod events;
mod memory;
mod probe;
mod streams;

pub use events::{EventPool, PooledEvent};
pub use memory::CudaMemory;
pub use probe::{cuda_available, open_context};
pub use streams::CudaStreams;
