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
    ///
    /// If recording fails, the block is not freed: the stream the event was for may still
    /// read it (PyTorch's `insert_events` raises and leaves the block alone). The streams left
    /// without an event stay on the block, the error is returned, and the next
    /// `process_events` or `synchronize_pending` tries again (and reports a failure again).
    pub fn insert_events(&mut self, block: BlockId) -> Result<(), AllocError> {
        let streams = std::mem::take(&mut self.blocks[block].stream_uses);
        for (i, &stream) in streams.iter().enumerate() {
            match self.device.record_event(stream) {
                Ok(event) => {
                    self.blocks[block].pending_events += 1;
                    self.pending.push(PendingFree { event, block });
                }
                Err(e) => {
                    self.blocks[block].stream_uses = streams[i..].to_vec();
                    self.needs_events.push(block);
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Records the events that failed to record earlier. A failure again keeps its block (and
    /// any not yet retried) waiting and is returned: errors stay errors.
    fn retry_failed_events(&mut self) -> Result<(), AllocError> {
        let mut waiting = std::mem::take(&mut self.needs_events).into_iter();
        while let Some(block) = waiting.next() {
            if let Err(e) = self.insert_events(block) {
                self.needs_events.extend(waiting);
                return Err(e);
            }
        }
        Ok(())
    }

    /// One event of a pending free completed; frees the block after its last one, once every
    /// stream it was used on has had its event.
    fn event_done(&mut self, block: BlockId) {
        let b = &mut self.blocks[block];
        b.pending_events -= 1;
        if b.pending_events == 0 && b.stream_uses.is_empty() {
            self.free_block(block);
        }
    }

    /// Completes the pending frees whose events have finished.
    pub fn process_events(&mut self) -> Result<(), AllocError> {
        self.retry_failed_events()?;
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
        if self.uncached() {
            self.release_completed_frees()?;
        }
        Ok(())
    }

    /// Waits for every pending event it can and completes those frees, for a drop: an event
    /// that fails to record or to synchronise leaves its block pending (the stream it is for
    /// may still read it) and its error is returned; every other pending free completes.
    pub fn synchronize_what_can_be(&mut self) -> Vec<AllocError> {
        self.stats.num_sync_all_streams += 1;
        let mut failures = Vec::new();
        for block in std::mem::take(&mut self.needs_events) {
            // A failure puts the block back in `needs_events`.
            if let Err(e) = self.insert_events(block) {
                failures.push(e);
            }
        }
        let mut unfinished = Vec::new();
        while let Some(pending) = self.pending.pop() {
            match self.device.synchronize_event(&pending.event) {
                Ok(()) => {
                    self.device.release_event(pending.event);
                    self.event_done(pending.block);
                }
                Err(e) => {
                    failures.push(e.into());
                    unfinished.push(pending);
                }
            }
        }
        self.pending = unfinished;
        failures
    }

    /// Waits for every pending event and completes every pending free.
    /// Counted in `num_sync_all_streams` every time, pending events or not (PyTorch's
    /// `synchronize_and_free_events`).
    pub fn synchronize_pending(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        self.retry_failed_events()?;
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
