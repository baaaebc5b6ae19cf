//! What is this memory? Memory scopes and phases of a Burn program.
//!
//! [`memory_scope`] tags every allocation made inside it with a name: `memory_stats` counts
//! each scope's live bytes (`scope.<name>.allocated_bytes.current` and `.peak`), the summary
//! lists them, `memory_report` says which scopes grew, snapshots carry each block's scope
//! (PyTorch's `user_metadata` in the PyTorch-format file) and the viewer shows them.
//! [`annotate`] marks a phase (`forward`, `backward`, ...) on the timeline: PyTorch's
//! `external_annotations`, drawn as bands by PyTorch's viewer and ours.
//!
//! A scope belongs to the calling thread's CubeCL stream (each thread has its own), and covers
//! what that thread's tensor operations reserve on any caching device. Under fusion an
//! operation reserves when burn-fusion executes it, on burn-fusion's thread but inside the
//! calling thread's stream (see `runtime::scopes`); the scope drains the calling thread's
//! fusion queue of its device when it begins and when it ends, so that what was queued before
//! it is not counted in it, and what was queued inside it is.

use std::marker::PhantomData;

use super::CachingDevice;
use super::device::opened;
use crate::alloc::{PhaseStage, Tag};
use crate::runtime::scopes::{self, StreamScope};

/// An active memory scope ([`memory_scope`]); dropping it ends the scope.
#[must_use = "the scope ends when the guard drops"]
pub struct MemoryScope<Dev: CachingDevice> {
    device: Dev,
    scope: Option<StreamScope>,
    /// Ends on the thread it began on (it drains that thread's fusion queue).
    _not_send: PhantomData<*const ()>,
}

impl<Dev: CachingDevice> core::fmt::Debug for MemoryScope<Dev> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MemoryScope")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Tags every allocation the calling thread's tensor operations make, from now until the
/// returned guard drops, with `name` (PyTorch's `torch.cuda.memory._set_memory_metadata`,
/// as a guard). Scopes nest: the innermost one tags a block, and an outer scope's count does
/// not include what an inner one allocated. The bytes are those of the blocks (PyTorch's
/// `allocated_bytes`), counted from the allocation to its free, whoever frees it.
///
/// A slice CubeCL reuses for a tensor of the same size is counted under the scope of the
/// tensor that reuses it. An operation Burn runs in place, on the buffer of a tensor it
/// consumes, allocates nothing, and that buffer keeps the scope it was allocated in.
///
/// ```no_run
/// # #[cfg(feature = "wgpu")]
/// # fn main() {
/// use burn::backend::wgpu::WgpuDevice;
/// use burn::tensor::Tensor;
/// use burn_caching_alloc::backend::{self, CachingWgpu};
///
/// let device = WgpuDevice::default();
/// let kept = {
///     let _scope = backend::memory_scope(&device, "loader");
///     Tensor::<CachingWgpu, 2>::ones([256, 256], &device)
/// };
/// let stats = backend::memory_stats(&device).engine.to_map();
/// assert_eq!(stats["scope.loader.allocated_bytes.current"], 256 * 256 * 4);
/// # drop(kept);
/// # }
/// # #[cfg(not(feature = "wgpu"))]
/// # fn main() {}
/// ```
pub fn memory_scope<Dev: CachingDevice>(device: &Dev, name: &str) -> MemoryScope<Dev> {
    device.drain_fusion_queue();
    MemoryScope {
        device: device.clone(),
        scope: Some(scopes::enter(Tag::new(name))),
        _not_send: PhantomData,
    }
}

impl<Dev: CachingDevice> Drop for MemoryScope<Dev> {
    fn drop(&mut self) {
        // What was queued inside the scope executes inside it.
        self.device.drain_fusion_queue();
        self.scope.take();
    }
}

/// An active phase ([`annotate`]); dropping it marks the phase's end.
#[must_use = "the phase ends when the guard drops"]
pub struct Phase<Dev: CachingDevice> {
    device: Dev,
    name: String,
    _not_send: PhantomData<*const ()>,
}

impl<Dev: CachingDevice> core::fmt::Debug for Phase<Dev> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Phase")
            .field("device", &self.device)
            .field("name", &self.name)
            .finish()
    }
}

/// Marks phase `name` of the program on `device`'s history, from now until the returned guard
/// drops (PyTorch's `record_function` annotations in a memory snapshot): the PyTorch-format
/// snapshot's `external_annotations` (`START` and `END`), drawn as bands on PyTorch's Active
/// Memory Timeline and on our viewer's timeline. Recorded only while the history is recorded
/// (`record_memory_history`), as PyTorch does.
///
/// Each mark first drains the calling thread's fusion queue and waits until the device's
/// server ran what this thread submitted, so the mark falls after the allocations made before
/// it and before those made after it. That is a round trip to the device's thread per mark:
/// mark phases (an epoch, a step's forward and backward), not single operations.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let forward = backend::annotate(&device, "forward");
/// // ... the forward pass ...
/// drop(forward); // the phase ends
/// # }
/// ```
pub fn annotate<Dev: CachingDevice>(device: &Dev, name: &str) -> Phase<Dev> {
    opened(device).allocator.mark_phase(name, PhaseStage::Start);
    Phase {
        device: device.clone(),
        name: name.to_owned(),
        _not_send: PhantomData,
    }
}

impl<Dev: CachingDevice> Drop for Phase<Dev> {
    fn drop(&mut self) {
        opened(&self.device)
            .allocator
            .mark_phase(&self.name, PhaseStage::End);
    }
}
