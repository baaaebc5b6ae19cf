//! Frees that wait on other streams.
//!
//! A block used on a second stream (`record_stream`) may still be read by that stream's
//! queued work when its owner frees it. The free records an event on every such stream; the
//! block stays active until all of them completed, and only then merges into the cache.

use super::Engine;
use crate::alloc::block::BlockId;
use crate::alloc::error::AllocError;
use crate::device::DeviceMemory;

/// One event a pending free waits on.
pub(crate) struct PendingFree<E> {
    pub event: E,
    pub block: BlockId,
}

impl<D: DeviceMemory> Engine<D> {
    /// Records an event on every other stream the block was used on.
    pub fn insert_events(&mut self, block: BlockId) -> Result<(), AllocError> {
        let streams = std::mem::take(&mut self.blocks.blocks[block].stream_uses);
        for stream in streams {
            match self.device.record_event(stream) {
                Ok(event) => {
                    self.blocks.blocks[block].pending_events += 1;
                    self.pending.push(PendingFree { event, block });
                }
                Err(e) => {
                    // Without its event the block cannot be proven idle: wait for what
                    // was recorded, then free it, rather than reuse it too early.
                    if self.blocks.blocks[block].pending_events == 0 {
                        self.free_block(block);
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// One event of a pending free completed; frees the block after its last one.
    fn event_done(&mut self, block: BlockId) {
        let b = &mut self.blocks.blocks[block];
        b.pending_events -= 1;
        if b.pending_events == 0 {
            self.free_block(block);
        }
    }

    /// Completes the pending frees whose events have finished.
    pub fn process_events(&mut self) -> Result<(), AllocError> {
        let mut i = 0;
        while i < self.pending.len() {
            if self.device.query_event(&self.pending[i].event)? {
                let done = self.pending.swap_remove(i);
                self.device.release_event(done.event);
                self.event_done(done.block);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Waits for every pending event and completes every pending free.
    pub fn synchronize_pending(&mut self) -> Result<(), AllocError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.stats.num_sync_all_streams += 1;
        while let Some(pending) = self.pending.pop() {
            if let Err(e) = self.device.synchronize_event(&pending.event) {
                self.pending.push(pending);
                return Err(e.into());
            }
            self.device.release_event(pending.event);
            self.event_done(pending.block);
        }
        Ok(())
    }
}
