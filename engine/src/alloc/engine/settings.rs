//! Settings changed on an open engine (PyTorch's `torch.cuda.memory._set_allocator_settings`,
//! which re-parses `CUDAAllocatorConfig` while the allocator runs).
//!
//! Every key of the configuration string can change: the engine reads its configuration at
//! each decision, so a new value applies to the decisions made after the call and leaves
//! what was placed before as it is. Blocks already handed out keep their size and segment;
//! `expandable_segments` applies to segments made after the call (those made before keep
//! their kind: an expandable range keeps mapping and unmapping its pages, a fixed segment
//! stays fixed); a new memory fraction caps reserved memory from the next device allocation
//! on, without giving back what is reserved above it (as PyTorch's `setMemoryFraction`). A
//! change the device cannot serve is refused before anything changes: `expandable_segments`
//! on a device without virtual memory, a fraction of a total the device cannot report.
//!
//! Turning `no_cuda_memory_caching` on returns the cache to the device at once (as
//! `empty_cache`); blocks live then keep their segments, which go back when they are whole
//! and free.
//!
//! Two things are recomputed so that the numbers stay true: the oversize statistics, counted
//! against `max_split_size`, are recounted against the new value (PyTorch keeps counting
//! against whatever value is current, which lets them drift), and a change of the history's
//! options restarts the recording with them (as `_record_memory_history` does).

use super::{Engine, unsupported_by};
use crate::alloc::block::BlockState;
use crate::alloc::config::{AllocatorConfig, ConfigError};
use crate::device::DeviceMemory;

impl<D: DeviceMemory> Engine<D> {
    /// Puts `config` in force; `keys` are the keys the caller named (only they are checked
    /// against the device). Nothing changes on an error.
    pub fn set_config(
        &mut self,
        config: AllocatorConfig,
        keys: &[&str],
    ) -> Result<(), ConfigError> {
        unsupported_by(&config, &self.device)?;
        if keys.contains(&"per_process_memory_fraction")
            && let Some(fraction) = config.memory_fraction
        {
            self.enforceable_fraction(fraction)?;
        }
        let history_changed = config.history != self.config.history;
        let max_split_changed = config.max_split_size != self.config.max_split_size;
        let history = config.history;
        let caching_stopped = config.no_cuda_memory_caching && !self.config.no_cuda_memory_caching;
        self.config = config;
        if caching_stopped {
            // Nothing is cached from now on: what the cache holds goes back now (pending frees
            // are waited for, as by `empty_cache`). A device that refuses keeps it cached.
            if let Err(err) = self.release_cached_blocks() {
                log::warn!("caching allocator: returning the cache failed ({err}); it stays");
            }
        }
        if max_split_changed {
            self.recount_oversize();
        }
        if history_changed {
            self.record_memory_history(history);
        }
        Ok(())
    }

    /// Sets the oversize statistics and `max_split_size` from the blocks and segments held
    /// now, counted against the `max_split_size` in force.
    fn recount_oversize(&mut self) {
        let max_split = self.max_split();
        let segments = self
            .blocks
            .segments()
            .filter(|(_, s)| !s.expandable && s.size >= max_split)
            .count() as u64;
        let allocations = self
            .blocks
            .iter()
            .filter(|(_, b)| {
                b.is_mapped() && b.state == BlockState::ActiveAllocated && b.size() >= max_split
            })
            .count() as u64;
        // As a change of the current value, so that `allocated - freed` stays its change.
        let recount = |stat: &mut crate::alloc::stats::Stat, value: u64| {
            stat.change(
                crate::alloc::stats::signed(value) - crate::alloc::stats::signed(stat.current),
            );
        };
        recount(&mut self.stats.oversize_segments, segments);
        recount(&mut self.stats.oversize_allocations, allocations);
        self.stats.max_split_size = self
            .config
            .max_split_size
            .map_or(-1, crate::alloc::stats::signed);
    }
}
