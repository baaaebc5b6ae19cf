//! Frees that wait on other streams.
//!
//! A block used on a second stream (`record_stream`) may still be read by that stream's
//! queued work when its owner frees it. The free records an event on every such stream; the
//! block stays active until all of them completed, and only then merges into the cache.

use std::collections::VecDeque;

use super::Engine;
use crate::alloc::block::BlockId;
use crate::alloc::error::AllocError;
use crate::device::{DeviceError, DeviceMemory, DeviceStream};

/// One event a pending free waits on.
pub(crate) struct PendingFree<E> {
    pub event: E,
    pub block: BlockId,
}

/// The events pending frees wait on, one queue per stream in the order they were recorded
/// there. Events of one stream complete in that order (stream order), so only the front of a
/// queue needs asking: a call that completes nothing asks once per stream, however many
/// frees wait (PyTorch's `process_events` stops at a stream's first unfinished event too).
pub(crate) struct PendingFrees<E> {
    queues: Vec<(DeviceStream, VecDeque<PendingFree<E>>)>,
}

impl<E> Default for PendingFrees<E> {
    fn default() -> Self {
        Self { queues: Vec::new() }
    }
}

impl<E> PendingFrees<E> {
    /// Adds the event just recorded on `stream` for `block`.
    fn push(&mut self, stream: DeviceStream, event: E, block: BlockId) {
        let pending = PendingFree { event, block };
        match self.queues.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, queue)) => queue.push_back(pending),
            None => self.queues.push((stream, VecDeque::from([pending]))),
        }
    }

    /// Whether no free waits on any event.
    pub(crate) fn is_empty(&self) -> bool {
        self.queues.iter().all(|(_, queue)| queue.is_empty())
    }

    /// Every pending event, queue by queue.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &PendingFree<E>> {
        self.queues.iter().flat_map(|(_, queue)| queue.iter())
    }

    /// The queues, to be worked through and put back (empty ones dropped) with
    /// [`put_back`](Self::put_back).
    fn take(&mut self) -> Vec<(DeviceStream, VecDeque<PendingFree<E>>)> {
        std::mem::take(&mut self.queues)
    }

    /// Puts back what [`take`](Self::take) took and was not completed, ahead of any event
    /// recorded meanwhile on the same stream.
    fn put_back(&mut self, queues: Vec<(DeviceStream, VecDeque<PendingFree<E>>)>) {
        let recorded_meanwhile = std::mem::replace(&mut self.queues, queues);
        self.queues.retain(|(_, queue)| !queue.is_empty());
        for (stream, queue) in recorded_meanwhile {
            for pending in queue {
                self.push(stream, pending.event, pending.block);
            }
        }
    }
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
                    self.pending.push(stream, event, block);
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

    /// Completes the pending frees whose events have finished: per stream, the front events
    /// that completed, up to the first that has not. A failed query is returned; what
    /// completed before it stays completed.
    pub fn process_events(&mut self) -> Result<(), AllocError> {
        self.retry_failed_events()?;
        if !self.pending.is_empty() {
            self.complete_finished(|device, event| device.query_event(event))?;
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
        let mut queues = self.pending.take();
        for (_, queue) in &mut queues {
            let mut unfinished = VecDeque::new();
            while let Some(pending) = queue.pop_front() {
                match self.device.synchronize_event(&pending.event) {
                    Ok(()) => {
                        self.device.release_event(pending.event);
                        self.event_done(pending.block);
                    }
                    Err(e) => {
                        failures.push(e.into());
                        unfinished.push_back(pending);
                    }
                }
            }
            *queue = unfinished;
        }
        self.pending.put_back(queues);
        failures
    }

    /// Waits for every pending event and completes every pending free.
    /// Counted in `num_sync_all_streams` every time, pending events or not (PyTorch's
    /// `synchronize_and_free_events`).
    pub fn synchronize_pending(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        self.retry_failed_events()?;
        self.complete_finished(|device, event| device.synchronize_event(event).map(|()| true))
    }

    /// Completes, stream by stream, the pending frees at the front of each queue whose event
    /// `finished` says is over (asking the device), up to the first that is not. An error
    /// from `finished` stops there and is returned; what completed before it stays completed.
    fn complete_finished(
        &mut self,
        mut finished: impl FnMut(&mut D, &D::Event) -> Result<bool, DeviceError>,
    ) -> Result<(), AllocError> {
        let mut queues = self.pending.take();
        let mut result = Ok(());
        'streams: for (_, queue) in &mut queues {
            while let Some(front) = queue.front() {
                match finished(&mut self.device, &front.event) {
                    Ok(true) => {
                        let done = queue.pop_front().expect("a front event");
                        self.device.release_event(done.event);
                        self.event_done(done.block);
                    }
                    Ok(false) => break,
                    Err(e) => {
                        result = Err(e.into());
                        break 'streams;
                    }
                }
            }
        }
        self.pending.put_back(queues);
        result
    }
}
