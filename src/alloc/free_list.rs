//! The free blocks of one pool, ordered by (stream, size, address) for best fit.

use std::collections::BTreeMap;

use super::block::BlockId;
use crate::device::StreamId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    stream: StreamId,
    size: u64,
    address: u64,
}

#[derive(Debug, Default)]
pub(crate) struct FreeList {
    blocks: BTreeMap<Key, BlockId>,
}

impl FreeList {
    pub fn insert(&mut self, stream: StreamId, size: u64, address: u64, block: BlockId) {
        let previous = self.blocks.insert(
            Key {
                stream,
                size,
                address,
            },
            block,
        );
        debug_assert!(previous.is_none(), "block inserted twice in a free list");
    }

    pub fn remove(&mut self, stream: StreamId, size: u64, address: u64) -> Option<BlockId> {
        self.blocks.remove(&Key {
            stream,
            size,
            address,
        })
    }

    /// The smallest free block of `stream` of at least `size` bytes: (its size, its id).
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<(u64, BlockId)> {
        let from = Key {
            stream,
            size,
            address: 0,
        };
        self.blocks
            .range(from..)
            .next()
            .filter(|(key, _)| key.stream == stream)
            .map(|(key, id)| (key.size, *id))
    }

    /// Free blocks of `stream` from largest to smallest.
    pub fn largest_first(&self, stream: StreamId) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        let from = Key {
            stream,
            size: 0,
            address: 0,
        };
        let to = Key {
            stream,
            size: u64::MAX,
            address: u64::MAX,
        };
        self.blocks
            .range(from..=to)
            .rev()
            .map(|(key, id)| (key.size, *id))
    }

    /// Every free block, any stream.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.blocks.values().copied()
    }
}
