//! The free blocks of one pool, for best fit by (stream, size, address).
//!
//! Best fit is the smallest free block of the stream at least as large as the request, the
//! lowest address among blocks of that size. Two stores give it:
//!
//! - size classes, for sizes that are multiples of [`MIN_BLOCK_SIZE`] up to the list's class
//!   limit (the small pool's 2 MiB segment): per stream, one address-ordered vector per size
//!   and a bitmap of the sizes that have a free block. Best fit scans at most
//!   `limit / MIN_BLOCK_SIZE / 64` bitmap words and reads the first entry; insert and remove
//!   are a binary search in one vector. This is the small pool's hot path, where an ordered
//!   map spent most of the engine's time;
//! - an ordered map keyed by (stream, size, address) for every other size (the large pool).
//!
//! A query consults both and takes the better candidate, so the split is invisible outside.

use std::collections::BTreeMap;

use super::block::BlockId;
use super::size::MIN_BLOCK_SIZE;
use crate::device::StreamId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    stream: StreamId,
    size: u64,
    address: u64,
}

/// One stream's size classes: class `c` holds the free blocks of `c * MIN_BLOCK_SIZE` bytes.
#[derive(Debug)]
struct Classes {
    stream: StreamId,
    /// Bit `c` is set when class `c` holds a block.
    occupied: Vec<u64>,
    /// (address, block) per class, in address order.
    blocks: Vec<Vec<(u64, BlockId)>>,
}

impl Classes {
    fn new(stream: StreamId, classes: usize) -> Self {
        Self {
            stream,
            occupied: vec![0; classes.div_ceil(64)],
            blocks: (0..classes).map(|_| Vec::new()).collect(),
        }
    }

    /// The first class at or above `from` that holds a block.
    fn first_occupied(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = *self.occupied.get(word)? & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.occupied.get(word)?;
        }
    }

    fn insert(&mut self, class: usize, address: u64, block: BlockId) {
        let list = &mut self.blocks[class];
        let at = list.partition_point(|&(a, _)| a < address);
        debug_assert!(
            list.get(at).is_none_or(|&(a, _)| a != address),
            "block inserted twice in a free list"
        );
        list.insert(at, (address, block));
        self.occupied[class / 64] |= 1 << (class % 64);
    }

    fn remove(&mut self, class: usize, address: u64) -> Option<BlockId> {
        let list = &mut self.blocks[class];
        let at = list.binary_search_by_key(&address, |&(a, _)| a).ok()?;
        let (_, block) = list.remove(at);
        if list.is_empty() {
            self.occupied[class / 64] &= !(1 << (class % 64));
        }
        Some(block)
    }

    /// Every block, by size then address.
    fn iter(&self) -> impl Iterator<Item = (u64, u64, BlockId)> + '_ {
        self.blocks.iter().enumerate().flat_map(|(class, list)| {
            list.iter()
                .map(move |&(address, block)| (class as u64 * MIN_BLOCK_SIZE, address, block))
        })
    }
}

#[derive(Debug)]
pub(crate) struct FreeList {
    /// Largest size kept in classes (0: none).
    class_limit: u64,
    /// Per stream, in stream order.
    classes: Vec<Classes>,
    ordered: BTreeMap<Key, BlockId>,
}

impl Default for FreeList {
    fn default() -> Self {
        Self::with_class_limit(0)
    }
}

impl FreeList {
    /// A free list keeping sizes up to `class_limit` (a multiple of [`MIN_BLOCK_SIZE`]) in
    /// size classes and every other size in the ordered map.
    pub fn with_class_limit(class_limit: u64) -> Self {
        debug_assert!(class_limit.is_multiple_of(MIN_BLOCK_SIZE));
        Self {
            class_limit,
            classes: Vec::new(),
            ordered: BTreeMap::new(),
        }
    }

    /// The size class of `size`, if sizes like it are kept in classes.
    fn class_of(&self, size: u64) -> Option<usize> {
        (size > 0 && size <= self.class_limit && size.is_multiple_of(MIN_BLOCK_SIZE))
            .then_some((size / MIN_BLOCK_SIZE) as usize)
    }

    fn stream_classes(&self, stream: StreamId) -> Option<&Classes> {
        self.classes.iter().find(|c| c.stream == stream)
    }

    pub fn insert(&mut self, stream: StreamId, size: u64, address: u64, block: BlockId) {
        let Some(class) = self.class_of(size) else {
            let previous = self.ordered.insert(
                Key {
                    stream,
                    size,
                    address,
                },
                block,
            );
            debug_assert!(previous.is_none(), "block inserted twice in a free list");
            return;
        };
        let at = self.classes.partition_point(|c| c.stream < stream);
        if self.classes.get(at).is_none_or(|c| c.stream != stream) {
            let count = (self.class_limit / MIN_BLOCK_SIZE) as usize + 1;
            self.classes.insert(at, Classes::new(stream, count));
        }
        self.classes[at].insert(class, address, block);
    }

    pub fn remove(&mut self, stream: StreamId, size: u64, address: u64) -> Option<BlockId> {
        match self.class_of(size) {
            Some(class) => self
                .classes
                .iter_mut()
                .find(|c| c.stream == stream)?
                .remove(class, address),
            None => self.ordered.remove(&Key {
                stream,
                size,
                address,
            }),
        }
    }

    /// The smallest free block of `stream` of at least `size` bytes (the lowest address among
    /// equals): (its size, its id).
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<(u64, BlockId)> {
        let classed = (size <= self.class_limit)
            .then(|| self.stream_classes(stream))
            .flatten()
            .and_then(|classes| {
                let from = size.div_ceil(MIN_BLOCK_SIZE).max(1) as usize;
                let class = classes.first_occupied(from)?;
                let (address, block) = classes.blocks[class][0];
                Some((class as u64 * MIN_BLOCK_SIZE, address, block))
            });
        let ordered = if self.ordered.is_empty() {
            None
        } else {
            let from = Key {
                stream,
                size,
                address: 0,
            };
            self.ordered
                .range(from..)
                .next()
                .filter(|(key, _)| key.stream == stream)
                .map(|(key, &block)| (key.size, key.address, block))
        };
        let best = match (classed, ordered) {
            (Some(a), Some(b)) => Some(if (b.0, b.1) < (a.0, a.1) { b } else { a }),
            (a, b) => a.or(b),
        };
        best.map(|(size, _, block)| (size, block))
    }

    /// Free blocks of `stream` from largest to smallest (highest address first among equals).
    pub fn largest_first(&self, stream: StreamId) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        let mut blocks: Vec<(u64, u64, BlockId)> = self
            .stream_classes(stream)
            .into_iter()
            .flat_map(Classes::iter)
            .collect();
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
        blocks.extend(
            self.ordered
                .range(from..=to)
                .map(|(key, &block)| (key.size, key.address, block)),
        );
        blocks.sort_unstable_by_key(|&(size, address, _)| std::cmp::Reverse((size, address)));
        blocks.into_iter().map(|(size, _, block)| (size, block))
    }

    /// Every free block, any stream.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.classes
            .iter()
            .flat_map(Classes::iter)
            .map(|(_, _, block)| block)
            .chain(self.ordered.values().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamId = StreamId(0);
    const S1: StreamId = StreamId(1);
    const LIMIT: u64 = 2 << 20;

    /// The same list kept entirely in the ordered map, as the reference.
    fn both() -> (FreeList, FreeList) {
        (FreeList::with_class_limit(LIMIT), FreeList::default())
    }

    #[test]
    fn best_fit_takes_the_smallest_fitting_size_then_the_lowest_address() {
        for mut list in [FreeList::with_class_limit(LIMIT), FreeList::default()] {
            list.insert(S0, 4096, 9000, 1);
            list.insert(S0, 2048, 7000, 2);
            list.insert(S0, 2048, 5000, 3);
            list.insert(S1, 1024, 100, 4);
            list.insert(S0, 8 << 20, 1 << 30, 5); // beyond the class limit
            assert_eq!(list.best_fit(S0, 1024), Some((2048, 3)));
            assert_eq!(list.best_fit(S0, 2048), Some((2048, 3)));
            assert_eq!(list.best_fit(S0, 2049), Some((4096, 1)));
            assert_eq!(list.best_fit(S0, 4097), Some((8 << 20, 5)));
            assert_eq!(list.best_fit(S0, (8 << 20) + 1), None);
            assert_eq!(list.best_fit(S1, 512), Some((1024, 4)));
            assert_eq!(list.best_fit(S1, 1025), None);
            assert_eq!(list.best_fit(StreamId(2), 1), None);
            assert_eq!(list.remove(S0, 2048, 5000), Some(3));
            assert_eq!(list.remove(S0, 2048, 5000), None);
            assert_eq!(list.best_fit(S0, 1024), Some((2048, 2)));
            assert_eq!(list.remove(S0, 2048, 7000), Some(2));
            assert_eq!(list.best_fit(S0, 1024), Some((4096, 1)));
        }
    }

    #[test]
    fn classes_and_the_map_agree_on_every_query_of_a_random_history() {
        let (mut classed, mut reference) = both();
        let mut live: Vec<(StreamId, u64, u64)> = Vec::new();
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for step in 0..20_000u64 {
            if live.is_empty() || next(3) > 0 {
                let stream = StreamId(next(3));
                // Mostly class sizes, sometimes beyond the limit or not a class multiple.
                let size = match next(10) {
                    0 => LIMIT + 512 * (1 + next(64)),
                    1 => 1 + next(LIMIT),
                    _ => 512 * (1 + next(LIMIT / 512)),
                };
                let address = step * 4096 + next(4096);
                classed.insert(stream, size, address, step as usize);
                reference.insert(stream, size, address, step as usize);
                live.push((stream, size, address));
            } else {
                let (stream, size, address) = live.swap_remove(next(live.len() as u64) as usize);
                assert_eq!(
                    classed.remove(stream, size, address),
                    reference.remove(stream, size, address)
                );
            }
            let stream = StreamId(next(3));
            let want = 1 + next(LIMIT + 64 * 512);
            assert_eq!(
                classed.best_fit(stream, want),
                reference.best_fit(stream, want),
                "step {step}: best fit of {want} on {stream:?}"
            );
        }
        for stream in [S0, S1, StreamId(2)] {
            assert!(
                classed
                    .largest_first(stream)
                    .eq(reference.largest_first(stream))
            );
        }
        let mut a: Vec<BlockId> = classed.iter().collect();
        let mut b: Vec<BlockId> = reference.iter().collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        assert_eq!(a.len(), live.len());
    }
}
