//! The devices a replay runs on: [`ReplayDevice`] opens a fresh one for every pass.
//!
//! - [`SimReplayDevice`]: a new [`SimDevice`] of a fixed capacity per pass (runs anywhere);
//! - `CudaReplayDevice` (feature `cuda`): a fresh `CudaMemory` on one CUDA device per pass,
//!   the device's primary context kept open in between.
//!
//! The runner wraps every device it opens in
//! [`Metered`](burn_caching_alloc::device::metered::Metered) and reads segments and bytes from
//! the meter, so measurements mean the same on every device.

use burn_caching_alloc::device::DeviceMemory;
use burn_caching_alloc::device::sim::SimDevice;

/// Where a replay runs.
pub trait ReplayDevice {
    /// The device memory a pass's allocator owns.
    type Memory: DeviceMemory;

    /// The device's total memory in bytes. CubeCL's pools are sized from it, as cubecl-cuda
    /// sizes them from `cuDeviceTotalMem` ([`crate::allocator::cuda_memory_properties`]).
    fn capacity(&self) -> u64;

    /// A device for one pass, with nothing of an earlier pass allocated on it (the runner
    /// checks that every pass returns every segment before the next one opens).
    fn open(&self) -> Result<Self::Memory, String>;

    /// One line naming the device, for a report's header.
    fn describe(&self) -> String;
}

/// Bytes as GiB for a header: whole GiB without decimals.
pub fn format_gib(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

/// A fresh simulated device of `capacity` bytes per pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimReplayDevice {
    pub capacity: u64,
}

impl SimReplayDevice {
    pub fn new(capacity: u64) -> Self {
        Self { capacity }
    }
}

impl ReplayDevice for SimReplayDevice {
    type Memory = SimDevice;

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn open(&self) -> Result<SimDevice, String> {
        Ok(SimDevice::new(self.capacity))
    }

    fn describe(&self) -> String {
        format!("simulated, {}", format_gib(self.capacity))
    }
}

#[cfg(feature = "cuda")]
pub use cuda::CudaReplayDevice;

#[cfg(feature = "cuda")]
mod cuda {
    use super::{ReplayDevice, format_gib};
    use burn_caching_alloc::cuda::CudaMemory;

    /// One CUDA device: every pass gets a [`CudaMemory`] of its own (its own stream table and
    /// event pool) on the device's primary context, which the first one, opened here and kept
    /// until this is dropped, holds open between passes.
    #[derive(Debug)]
    pub struct CudaReplayDevice {
        ordinal: usize,
        first: CudaMemory,
        name: Option<String>,
    }

    impl CudaReplayDevice {
        /// Opens the CUDA device with this ordinal. Call
        /// [`cuda_available`](burn_caching_alloc::cuda::cuda_available) first for a one-line reason
        /// when CUDA is missing; this errors (never panics) either way.
        pub fn new(ordinal: usize) -> Result<Self, String> {
            let first = CudaMemory::new(ordinal).map_err(|err| err.to_string())?;
            // The driver loaded and the device opened, so this reaches a working driver.
            let name = cudarc::driver::CudaContext::new(ordinal)
                .and_then(|context| context.name())
                .ok();
            Ok(Self {
                ordinal,
                first,
                name,
            })
        }

        /// The device's name, as the driver reports it (if it did).
        pub fn name(&self) -> Option<&str> {
            self.name.as_deref()
        }

        /// Total device memory (`cuMemGetInfo`), in bytes.
        pub fn total_memory(&self) -> u64 {
            self.first.total_memory()
        }
    }

    impl ReplayDevice for CudaReplayDevice {
        type Memory = CudaMemory;

        fn capacity(&self) -> u64 {
            self.first.total_memory()
        }

        fn open(&self) -> Result<CudaMemory, String> {
            CudaMemory::new(self.ordinal)
                .map_err(|err| format!("opening CUDA device {}: {err}", self.ordinal))
        }

        fn describe(&self) -> String {
            format!(
                "CUDA device {} ({}), {} total",
                self.ordinal,
                self.name.as_deref().unwrap_or("unnamed"),
                format_gib(self.total_memory())
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulated_device_is_fresh_every_time() {
        let device = SimReplayDevice::new(3 << 30);
        let mut first = device.open().expect("a simulated device opens");
        first.allocate(1 << 20, Default::default()).expect("fits");
        let second = device.open().expect("a simulated device opens");
        assert_eq!(second.bytes_in_use(), 0);
        assert_eq!(device.capacity(), 3 << 30);
        assert_eq!(device.describe(), "simulated, 3 GiB");
        assert_eq!(format_gib(3 << 29), "1.50 GiB");
    }
}
