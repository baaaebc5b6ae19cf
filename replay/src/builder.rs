//! Building a trace of inputs (mallocs and frees) by hand, for the generators.

use burn_caching_alloc::alloc::{Trace, TraceEvent};

/// The id of an allocation in a trace being built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

/// Appends input events to a trace. Generated traces carry no placement: the outcome fields
/// of `Malloc` (`block_size`, `address`) are zero, since they depend on the allocator.
#[derive(Debug, Default)]
pub struct TraceBuilder {
    events: Vec<TraceEvent>,
    next_id: u64,
    live: std::collections::BTreeSet<u64>,
}

impl TraceBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A request of `bytes` bytes (at least 1) on stream 0.
    pub fn malloc(&mut self, bytes: u64) -> TensorId {
        self.next_id += 1;
        let id = self.next_id;
        self.events.push(TraceEvent::Malloc {
            id,
            size: bytes.max(1),
            stream: 0,
            block_size: 0,
            address: 0,
            pool: 0,
        });
        self.live.insert(id);
        TensorId(id)
    }

    /// A float32 tensor of `elements` elements.
    pub fn tensor(&mut self, elements: u64) -> TensorId {
        self.malloc(elements * 4)
    }

    /// Frees a live tensor. Freeing a tensor twice is a generator bug and panics.
    pub fn free(&mut self, tensor: TensorId) {
        assert!(
            self.live.remove(&tensor.0),
            "generator bug: tensor {} freed twice",
            tensor.0
        );
        self.events.push(TraceEvent::FreeRequested { id: tensor.0 });
    }

    /// Frees every tensor of `tensors`, in order.
    pub fn free_all(&mut self, tensors: impl IntoIterator<Item = TensorId>) {
        for tensor in tensors {
            self.free(tensor);
        }
    }

    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// The trace; every tensor still live is freed at the end, oldest first.
    pub fn finish(mut self) -> Trace {
        let live: Vec<u64> = self.live.iter().copied().collect();
        for id in live {
            self.free(TensorId(id));
        }
        Trace {
            events: self.events,
            dropped: 0,
        }
    }
}
