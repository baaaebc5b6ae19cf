//! The free blocks of one pool, for best fit by (stream, size, address).
//!
//! Best fit is the smallest free block of the stream at least as large as the request, the
//! lowest address among blocks of that size. Two stores give it:
//!
//! - size classes, for sizes that are multiples of [`MIN_BLOCK_SIZE`] in the list's class
//!   range (the small pool: up to its 2 MiB segment; the large pool: up to 32 MiB, which holds
//!   its 20 MiB segments and their splits): per stream, one address-ordered vector per size
//!   and a two-level bitmap of the sizes that have a free block. Best fit reads a few bitmap
//!   words and the first entry of a vector; insert and remove are a binary search in one
//!   vector. An ordered map here was about half of the engine's time;
//! - an ordered map keyed by (stream, size, address) for every other size.
//!
//! Block sizes are multiples of [`MIN_BLOCK_SIZE`], so in practice the map holds only sizes
//! above the class range and a class candidate is the best fit when there is one; a count of
//! map entries inside the range keeps the answer exact for any other size too.

use std::collections::BTreeMap;

use super::block::BlockId;
use super::size::MIN_BLOCK_SIZE;
use crate::device::DeviceStream;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    stream: DeviceStream,
    size: u64,
    address: u64,
}

/// One stream's size classes: class `c` holds the free blocks of `c * MIN_BLOCK_SIZE` bytes,
/// stored at index `c - first`.
#[derive(Debug)]
struct Classes {
    stream: DeviceStream,
    first: usize,
    /// Bit `i` is set when index `i` holds a block.
    occupied: Vec<u64>,
    /// Bit `w` is set when word `w` of `occupied` is not zero.
    summary: Vec<u64>,
    /// (address, block) per index, in address order, in groups of 64 indices (those of one
    /// `occupied` word). A group's vectors are made when one of its sizes first holds a
    /// block: the large pool has 65,536 classes, and making them all up front cost every new
    /// stream's first free about 80 µs (and `empty_cache` as much again to walk them).
    groups: Vec<Vec<Vec<(u64, BlockId)>>>,
}

impl Classes {
    fn new(stream: DeviceStream, first: usize, count: usize) -> Self {
        let words = count.div_ceil(64);
        Self {
            stream,
            first,
            occupied: vec![0; words],
            summary: vec![0; words.div_ceil(64)],
            groups: (0..words).map(|_| Vec::new()).collect(),
        }
    }

    /// The blocks at `index`, in address order (empty when its group was never used).
    fn list(&self, index: usize) -> &[(u64, BlockId)] {
        self.groups[index / 64]
            .get(index % 64)
            .map_or(&[], Vec::as_slice)
    }

    /// The vector of `index`, making its group's vectors first if need be.
    fn list_mut(&mut self, index: usize) -> &mut Vec<(u64, BlockId)> {
        let group = &mut self.groups[index / 64];
        if group.is_empty() {
            group.resize_with(64, Vec::new);
        }
        &mut group[index % 64]
    }

    /// The first index at or above `from` that holds a block.
    fn first_occupied(&self, from: usize) -> Option<usize> {
        let word = from / 64;
        let bits = *self.occupied.get(word)? & (u64::MAX << (from % 64));
        if bits != 0 {
            return Some(word * 64 + bits.trailing_zeros() as usize);
        }
        let next = word + 1;
        let mut top = next / 64;
        let mut words = *self.summary.get(top)? & (u64::MAX << (next % 64));
        loop {
            if words != 0 {
                let word = top * 64 + words.trailing_zeros() as usize;
                return Some(word * 64 + self.occupied[word].trailing_zeros() as usize);
            }
            top += 1;
            words = *self.summary.get(top)?;
        }
    }

    fn insert(&mut self, class: usize, address: u64, block: BlockId) {
        let index = class - self.first;
        let list = self.list_mut(index);
        let at = list.partition_point(|&(a, _)| a < address);
        debug_assert!(
            list.get(at).is_none_or(|&(a, _)| a != address),
            "block inserted twice in a free list"
        );
        list.insert(at, (address, block));
        self.occupied[index / 64] |= 1 << (index % 64);
        self.summary[index / 4096] |= 1 << ((index / 64) % 64);
    }

    fn remove(&mut self, class: usize, address: u64) -> Option<BlockId> {
        let index = class - self.first;
        let list = self.groups[index / 64].get_mut(index % 64)?;
        let at = list.binary_search_by_key(&address, |&(a, _)| a).ok()?;
        let (_, block) = list.remove(at);
        if list.is_empty() {
            let word = &mut self.occupied[index / 64];
            *word &= !(1 << (index % 64));
            if *word == 0 {
                self.summary[index / 4096] &= !(1 << ((index / 64) % 64));
            }
        }
        Some(block)
    }

    /// The indices whose bit is set in the bitmap, in order.
    fn occupied_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.occupied
            .iter()
            .enumerate()
            .filter(|(_, bits)| **bits != 0)
            .flat_map(|(word, &bits)| {
                (0..64)
                    .filter(move |bit| bits >> bit & 1 == 1)
                    .map(move |bit| word * 64 + bit)
            })
    }

    /// Every block, by size then address. Classes are found through the bitmap, so the cost
    /// is the blocks, not the classes.
    fn iter(&self) -> impl Iterator<Item = (u64, u64, BlockId)> + '_ {
        self.occupied_indices().flat_map(move |index| {
            let size = (self.first + index) as u64 * MIN_BLOCK_SIZE;
            self.list(index)
                .iter()
                .map(move |&(address, block)| (size, address, block))
        })
    }
}

#[derive(Debug)]
pub(crate) struct FreeList {
    /// Sizes kept in classes: `min_size..=max_size` (empty when `max_size` is 0).
    min_size: u64,
    max_size: u64,
    /// Per stream, in stream order.
    classes: Vec<Classes>,
    ordered: BTreeMap<Key, BlockId>,
    /// Entries of `ordered` no larger than `max_size` (0 in practice).
    ordered_in_range: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        Self::with_classes(MIN_BLOCK_SIZE, 0)
    }
}

impl FreeList {
    /// A free list keeping sizes from `min_size` to `max_size` (multiples of
    /// [`MIN_BLOCK_SIZE`]) in size classes and every other size in the ordered map.
    pub fn with_classes(min_size: u64, max_size: u64) -> Self {
        let min_size = min_size
            .next_multiple_of(MIN_BLOCK_SIZE)
            .max(MIN_BLOCK_SIZE);
        debug_assert!(max_size.is_multiple_of(MIN_BLOCK_SIZE));
        Self {
            min_size,
            max_size,
            classes: Vec::new(),
            ordered: BTreeMap::new(),
            ordered_in_range: 0,
        }
    }

    /// The size class of `size`, if sizes like it are kept in classes.
    fn class_of(&self, size: u64) -> Option<usize> {
        (size >= self.min_size && size <= self.max_size && size.is_multiple_of(MIN_BLOCK_SIZE))
            .then_some((size / MIN_BLOCK_SIZE) as usize)
    }

    fn stream_classes(&self, stream: DeviceStream) -> Option<&Classes> {
        self.classes.iter().find(|c| c.stream == stream)
    }

    pub fn insert(&mut self, stream: DeviceStream, size: u64, address: u64, block: BlockId) {
        let Some(class) = self.class_of(size) else {
            self.ordered_in_range += usize::from(size <= self.max_size);
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
            let first = (self.min_size / MIN_BLOCK_SIZE) as usize;
            let count = (self.max_size / MIN_BLOCK_SIZE) as usize + 1 - first;
            self.classes.insert(at, Classes::new(stream, first, count));
        }
        self.classes[at].insert(class, address, block);
    }

    pub fn remove(&mut self, stream: DeviceStream, size: u64, address: u64) -> Option<BlockId> {
        match self.class_of(size) {
            Some(class) => self
                .classes
                .iter_mut()
                .find(|c| c.stream == stream)?
                .remove(class, address),
            None => {
                let removed = self.ordered.remove(&Key {
                    stream,
                    size,
                    address,
                });
                if removed.is_some() && size <= self.max_size {
                    self.ordered_in_range -= 1;
                }
                removed
            }
        }
    }

    /// The smallest free block of `stream` of at least `size` bytes (the lowest address among
    /// equals): (its size, its id).
    pub fn best_fit(&self, stream: DeviceStream, size: u64) -> Option<(u64, BlockId)> {
        let classed = (size <= self.max_size)
            .then(|| self.stream_classes(stream))
            .flatten()
            .and_then(|classes| {
                let class = size
                    .div_ceil(MIN_BLOCK_SIZE)
                    .max(self.min_size / MIN_BLOCK_SIZE);
                let index = classes.first_occupied(class as usize - classes.first)?;
                let (address, block) = classes.list(index)[0];
                let size = (classes.first + index) as u64 * MIN_BLOCK_SIZE;
                Some((size, address, block))
            });
        // Every map entry is then larger than any class: the class candidate is the best.
        if classed.is_some() && self.ordered_in_range == 0 {
            return classed.map(|(size, _, block)| (size, block));
        }
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

    /// The free block of `stream` that follows (`size`, `address`) in best-fit order: the
    /// next larger address among blocks of `size`, else the smallest larger block.
    pub fn next_after(
        &self,
        stream: DeviceStream,
        size: u64,
        address: u64,
    ) -> Option<(u64, BlockId)> {
        let classed = self.stream_classes(stream).and_then(|classes| {
            let in_class = |index: usize, after: u64| {
                let list = classes.list(index);
                let at = list.partition_point(|&(a, _)| a <= after);
                list.get(at)
                    .map(|&(a, b)| ((classes.first + index) as u64 * MIN_BLOCK_SIZE, a, b))
            };
            let from = match self.class_of(size) {
                Some(class) => {
                    let index = class - classes.first;
                    if let Some(found) = in_class(index, address) {
                        return Some(found);
                    }
                    index + 1
                }
                None if size < self.min_size => 0,
                None => return None,
            };
            let index = classes.first_occupied(from)?;
            let &(a, b) = classes.list(index).first()?;
            Some(((classes.first + index) as u64 * MIN_BLOCK_SIZE, a, b))
        });
        let from = Key {
            stream,
            size,
            address,
        };
        let ordered = self
            .ordered
            .range((std::ops::Bound::Excluded(from), std::ops::Bound::Unbounded))
            .next()
            .filter(|(key, _)| key.stream == stream)
            .map(|(key, &block)| (key.size, key.address, block));
        let next = match (classed, ordered) {
            (Some(a), Some(b)) => Some(if (b.0, b.1) < (a.0, a.1) { b } else { a }),
            (a, b) => a.or(b),
        };
        next.map(|(size, _, block)| (size, block))
    }

    /// Free blocks of `stream` from largest to smallest (highest address first among equals).
    pub fn largest_first(&self, stream: DeviceStream) -> impl Iterator<Item = (u64, BlockId)> + '_ {
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

impl FreeList {
    /// Every entry as (stream, size, address, block), for the engine's self-check.
    /// Classes are found through the bitmap, so the cost is the entries, not the classes.
    pub fn entries(&self) -> impl Iterator<Item = (DeviceStream, u64, u64, BlockId)> + '_ {
        self.classes
            .iter()
            .flat_map(|c| {
                c.occupied_indices().flat_map(move |index| {
                    let size = (c.first + index) as u64 * MIN_BLOCK_SIZE;
                    c.list(index)
                        .iter()
                        .map(move |&(address, block)| (c.stream, size, address, block))
                })
            })
            .chain(
                self.ordered
                    .iter()
                    .map(|(key, &block)| (key.stream, key.size, key.address, block)),
            )
    }

    /// Checks the list's own bookkeeping: streams in order, each class vector in address
    /// order, both bitmap levels set exactly where a vector holds a block, entries of the map
    /// that belong in classes absent, and the count of map entries in the class range exact.
    pub fn check(&self) -> Result<(), String> {
        for pair in self.classes.windows(2) {
            if pair[0].stream >= pair[1].stream {
                return Err(format!(
                    "free list streams out of order: {:?} before {:?}",
                    pair[0].stream, pair[1].stream
                ));
            }
        }
        for c in &self.classes {
            for (word, group) in c.groups.iter().enumerate() {
                if !group.is_empty() && group.len() != 64 {
                    return Err(format!(
                        "group {word} of {:?} holds {} vectors, not 64",
                        c.stream,
                        group.len()
                    ));
                }
            }
            for index in 0..c.occupied.len() * 64 {
                let list = c.list(index);
                if !list.windows(2).all(|p| p[0].0 < p[1].0) {
                    return Err(format!(
                        "class {} of {:?} not in address order",
                        c.first + index,
                        c.stream
                    ));
                }
                let bit = c.occupied[index / 64] >> (index % 64) & 1 == 1;
                if bit == list.is_empty() {
                    return Err(format!(
                        "class {} of {:?}: bitmap says {bit}, {} blocks",
                        c.first + index,
                        c.stream,
                        list.len()
                    ));
                }
            }
            for (word, &bits) in c.occupied.iter().enumerate() {
                let summary = c.summary[word / 64] >> (word % 64) & 1 == 1;
                if summary != (bits != 0) {
                    return Err(format!(
                        "summary bit of word {word} of {:?} is {summary}",
                        c.stream
                    ));
                }
            }
        }
        let mut in_range = 0;
        for key in self.ordered.keys() {
            if self.class_of(key.size).is_some() {
                return Err(format!(
                    "size {} kept in the map, not in its class",
                    key.size
                ));
            }
            in_range += usize::from(key.size <= self.max_size);
        }
        if in_range != self.ordered_in_range {
            return Err(format!(
                "{in_range} map entries in the class range, counted {}",
                self.ordered_in_range
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size::{SMALL_BUFFER, SMALL_SIZE};
    use crate::alloc::units::MIB;

    const S0: DeviceStream = DeviceStream(0);
    const S1: DeviceStream = DeviceStream(1);

    /// The engine's two configurations.
    fn small() -> FreeList {
        FreeList::with_classes(MIN_BLOCK_SIZE, SMALL_BUFFER)
    }

    fn large() -> FreeList {
        FreeList::with_classes(SMALL_SIZE + MIN_BLOCK_SIZE, 32 * MIB)
    }

    #[test]
    fn best_fit_takes_the_smallest_fitting_size_then_the_lowest_address() {
        for mut list in [small(), FreeList::default()] {
            list.insert(S0, 4096, 9000, BlockId::for_test(1));
            list.insert(S0, 2048, 7000, BlockId::for_test(2));
            list.insert(S0, 2048, 5000, BlockId::for_test(3));
            list.insert(S1, 1024, 100, BlockId::for_test(4));
            list.insert(S0, 8 << 20, 1 << 30, BlockId::for_test(5)); // beyond the class range
            assert_eq!(list.best_fit(S0, 1024), Some((2048, BlockId::for_test(3))));
            assert_eq!(list.best_fit(S0, 2048), Some((2048, BlockId::for_test(3))));
            assert_eq!(list.best_fit(S0, 2049), Some((4096, BlockId::for_test(1))));
            assert_eq!(
                list.best_fit(S0, 4097),
                Some((8 << 20, BlockId::for_test(5)))
            );
            assert_eq!(list.best_fit(S0, (8 << 20) + 1), None);
            assert_eq!(list.best_fit(S1, 512), Some((1024, BlockId::for_test(4))));
            assert_eq!(list.best_fit(S1, 1025), None);
            assert_eq!(list.best_fit(DeviceStream(2), 1), None);
            assert_eq!(list.remove(S0, 2048, 5000), Some(BlockId::for_test(3)));
            assert_eq!(list.remove(S0, 2048, 5000), None);
            assert_eq!(list.best_fit(S0, 1024), Some((2048, BlockId::for_test(2))));
            assert_eq!(list.remove(S0, 2048, 7000), Some(BlockId::for_test(2)));
            assert_eq!(list.best_fit(S0, 1024), Some((4096, BlockId::for_test(1))));
        }
    }

    #[test]
    fn the_bitmap_finds_blocks_across_words_and_summary_words() {
        let mut list = large();
        // Classes far apart: more than one summary word (4096 classes each) between them.
        let near = SMALL_SIZE + MIN_BLOCK_SIZE;
        let far = 30 * MIB;
        list.insert(S0, far, 1 << 40, BlockId::for_test(1));
        assert_eq!(list.best_fit(S0, near), Some((far, BlockId::for_test(1))));
        list.insert(S0, near, 1 << 30, BlockId::for_test(2));
        assert_eq!(list.best_fit(S0, 1), Some((near, BlockId::for_test(2))));
        assert_eq!(
            list.best_fit(S0, near + 1),
            Some((far, BlockId::for_test(1)))
        );
        assert_eq!(list.remove(S0, far, 1 << 40), Some(BlockId::for_test(1)));
        assert_eq!(list.best_fit(S0, near + 1), None);
        assert_eq!(list.best_fit(S0, 32 * MIB), None);
        list.insert(S0, 32 * MIB, 1 << 41, BlockId::for_test(3));
        assert_eq!(
            list.best_fit(S0, near + 1),
            Some((32 * MIB, BlockId::for_test(3)))
        );
    }

    /// A large-pool list of two streams whose blocks sit in several bitmap words and summary
    /// words, one entry in the map; `check` passes on it.
    fn sound() -> FreeList {
        let mut list = large();
        for (i, size) in [2 * MIB, 2 * MIB, 3 * MIB, 20 * MIB]
            .into_iter()
            .enumerate()
        {
            list.insert(S0, size, (i as u64 + 1) << 30, BlockId::for_test(i));
        }
        list.insert(S1, 5 * MIB, 1 << 40, BlockId::for_test(10));
        list.insert(S0, 64 * MIB, 1 << 41, BlockId::for_test(11));
        list.check().unwrap();
        list
    }

    /// What `check` says of the sound list after `corrupt`.
    fn check_after(corrupt: impl FnOnce(&mut FreeList)) -> String {
        let mut list = sound();
        corrupt(&mut list);
        list.check().expect_err("the corruption is found")
    }

    /// The index of `size` in a stream's classes of the large list.
    fn index(list: &FreeList, size: u64) -> usize {
        (size / MIN_BLOCK_SIZE) as usize - list.classes[0].first
    }

    #[test]
    fn check_finds_every_kind_of_corrupt_bookkeeping() {
        assert_eq!(
            check_after(|l| l.classes.swap(0, 1)),
            "free list streams out of order: DeviceStream(1) before DeviceStream(0)"
        );
        assert_eq!(
            check_after(|l| {
                let i = index(l, 2 * MIB);
                l.classes[0].list_mut(i).swap(0, 1);
            }),
            "class 4096 of DeviceStream(0) not in address order"
        );
        assert_eq!(
            check_after(|l| {
                let i = index(l, 2 * MIB);
                let list = l.classes[0].list_mut(i);
                list[1] = list[0];
            }),
            "class 4096 of DeviceStream(0) not in address order",
            "an address listed twice is out of order too"
        );
        // 3 MiB is index 4095 of the large list: word 63, the last of summary word 0.
        assert_eq!(
            check_after(|l| {
                let i = index(l, 3 * MIB);
                l.classes[0].list_mut(i).clear();
            }),
            "class 6144 of DeviceStream(0): bitmap says true, 0 blocks"
        );
        assert_eq!(
            check_after(|l| {
                let i = index(l, 4 * MIB);
                l.classes[0].occupied[i / 64] |= 1 << (i % 64);
            }),
            "class 8192 of DeviceStream(0): bitmap says true, 0 blocks"
        );
        assert_eq!(
            check_after(|l| {
                let i = index(l, 20 * MIB);
                l.classes[0].occupied[i / 64] &= !(1 << (i % 64));
            }),
            "class 40960 of DeviceStream(0): bitmap says false, 1 blocks"
        );
        // 2 MiB is index 2047 of the large list: group 31.
        assert_eq!(
            check_after(|l| {
                let i = index(l, 2 * MIB);
                l.classes[0].groups[i / 64].pop();
            }),
            "group 31 of DeviceStream(0) holds 63 vectors, not 64"
        );
        // 20 MiB is index 38911: word 607, bit 31 of summary word 9.
        assert_eq!(
            check_after(|l| l.classes[0].summary[9] = 0),
            "summary bit of word 607 of DeviceStream(0) is false"
        );
        assert_eq!(
            check_after(|l| l.classes[1].summary[9] |= 1 << 31),
            "summary bit of word 607 of DeviceStream(1) is true"
        );
        assert_eq!(
            check_after(|l| {
                let key = Key {
                    stream: S1,
                    size: 6 * MIB,
                    address: 1 << 42,
                };
                l.ordered.insert(key, BlockId::for_test(20));
            }),
            "size 6291456 kept in the map, not in its class"
        );
        assert_eq!(
            check_after(|l| l.ordered_in_range += 1),
            "0 map entries in the class range, counted 1"
        );
    }

    /// A stream's classes cover every class size of the range and no more (the small list
    /// 512 B to 2 MiB: 4096 classes, 64 bitmap words; the large one 1 MiB + 512 B to 32 MiB:
    /// 63488 classes, 992 words), with one group of vectors per bitmap word, and only the
    /// group of a size that was listed holds vectors: listing a 2 MiB block makes 64 vectors,
    /// not 63488.
    #[test]
    fn a_stream_makes_the_class_vectors_of_the_sizes_it_lists() {
        for (mut list, words) in [(small(), 64), (large(), 992)] {
            list.insert(S1, 2 * MIB, 0, BlockId::for_test(1));
            let classes = &list.classes[0];
            assert_eq!(classes.occupied.len(), words);
            assert_eq!(classes.summary.len(), words.div_ceil(64));
            assert_eq!(classes.groups.len(), words);
            let made: Vec<usize> = (0..words)
                .filter(|&w| !classes.groups[w].is_empty())
                .collect();
            let index = (2 * MIB / MIN_BLOCK_SIZE) as usize - classes.first;
            assert_eq!(made, [index / 64]);
            assert_eq!(classes.groups[index / 64].len(), 64);
            assert_eq!(classes.list(index), [(0, BlockId::for_test(1))]);
            assert!(classes.list(index - 64).is_empty());
        }
    }

    /// A block listed twice would be handed out twice: debug builds stop at the second insert,
    /// in a class vector as in the map.
    #[test]
    #[cfg(debug_assertions)]
    fn inserting_a_listed_address_again_is_caught() {
        for size in [2 * MIB, 64 * MIB] {
            let twice = std::panic::catch_unwind(|| {
                let mut list = large();
                list.insert(S0, size, 1 << 30, BlockId::for_test(1));
                list.insert(S0, size, 1 << 31, BlockId::for_test(2));
                list.insert(S0, size, 1 << 30, BlockId::for_test(3));
            });
            let message = twice.expect_err("the second insert panics");
            assert_eq!(
                message.downcast_ref::<&str>(),
                Some(&"block inserted twice in a free list"),
                "size {size}"
            );
        }
    }

    #[test]
    fn the_map_counts_its_entries_in_the_class_range() {
        // Sizes no class holds although they lie in the class range: below `min_size` or
        // between classes. Best fit must then look in the map too.
        let mut list = large();
        list.insert(S0, 4 * MIB, 1 << 30, BlockId::for_test(1));
        list.insert(S0, 3 * MIB + 1, 1 << 31, BlockId::for_test(2));
        list.insert(S0, 512, 1 << 32, BlockId::for_test(3));
        list.insert(S0, 64 * MIB, 1 << 33, BlockId::for_test(4));
        assert_eq!(list.ordered_in_range, 2);
        list.check().unwrap();
        assert_eq!(
            list.best_fit(S0, 2 * MIB),
            Some((3 * MIB + 1, BlockId::for_test(2)))
        );
        assert_eq!(list.best_fit(S0, 1), Some((512, BlockId::for_test(3))));
        assert_eq!(
            list.remove(S0, 3 * MIB + 1, 1 << 31),
            Some(BlockId::for_test(2))
        );
        assert_eq!(
            list.remove(S0, 64 * MIB, 1 << 33),
            Some(BlockId::for_test(4))
        );
        assert_eq!(
            list.ordered_in_range, 1,
            "an entry beyond the range was not counted"
        );
        assert_eq!(list.remove(S0, 512, 1 << 32), Some(BlockId::for_test(3)));
        assert_eq!(list.ordered_in_range, 0);
        list.check().unwrap();
        assert_eq!(list.best_fit(S0, 1), Some((4 * MIB, BlockId::for_test(1))));
    }

    /// The reference: PyTorch's rule written out plainly, a list searched in full. Best fit
    /// is the smallest block of the stream that is large enough, the lowest address among
    /// equals (PyTorch's `BlockComparatorSize` order: stream, size, address).
    #[derive(Default)]
    struct Reference {
        blocks: Vec<(DeviceStream, u64, u64, BlockId)>,
    }

    impl Reference {
        fn insert(&mut self, stream: DeviceStream, size: u64, address: u64, block: BlockId) {
            self.blocks.push((stream, size, address, block));
        }

        fn remove(&mut self, stream: DeviceStream, size: u64, address: u64) -> Option<BlockId> {
            let at = self
                .blocks
                .iter()
                .position(|&(s, z, a, _)| (s, z, a) == (stream, size, address))?;
            Some(self.blocks.swap_remove(at).3)
        }

        fn best_fit(&self, stream: DeviceStream, size: u64) -> Option<(u64, BlockId)> {
            self.blocks
                .iter()
                .filter(|&&(s, z, _, _)| s == stream && z >= size)
                .min_by_key(|&&(_, z, a, _)| (z, a))
                .map(|&(_, z, _, b)| (z, b))
        }

        /// The block after (`size`, `address`) in (size, address) order, of the same stream.
        fn next_after(
            &self,
            stream: DeviceStream,
            size: u64,
            address: u64,
        ) -> Option<(u64, BlockId)> {
            self.blocks
                .iter()
                .filter(|&&(s, z, a, _)| s == stream && (z, a) > (size, address))
                .min_by_key(|&&(_, z, a, _)| (z, a))
                .map(|&(_, z, _, b)| (z, b))
        }

        fn largest_first(&self, stream: DeviceStream) -> Vec<(u64, BlockId)> {
            let mut blocks: Vec<_> = self.blocks.iter().filter(|b| b.0 == stream).collect();
            blocks.sort_unstable_by_key(|&&(_, z, a, _)| std::cmp::Reverse((z, a)));
            blocks.into_iter().map(|&(_, z, _, b)| (z, b)).collect()
        }
    }

    /// Random inserts, removes and best-fit queries against [`Reference`].
    fn agree_with_the_reference(
        mut classed: FreeList,
        sizes: impl Fn(u64, u64) -> u64,
        max_want: u64,
    ) {
        let mut reference = Reference::default();
        let mut live: Vec<(DeviceStream, u64, u64)> = Vec::new();
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for step in 0..20_000u64 {
            if live.is_empty() || next(3) > 0 {
                let stream = DeviceStream(next(3));
                let size = sizes(next(10), next(1 << 40));
                let address = step * 4096 + next(4096);
                classed.insert(stream, size, address, BlockId::for_test(step as usize));
                reference.insert(stream, size, address, BlockId::for_test(step as usize));
                live.push((stream, size, address));
            } else {
                let (stream, size, address) = live.swap_remove(next(live.len() as u64) as usize);
                assert_eq!(
                    classed.remove(stream, size, address),
                    reference.remove(stream, size, address)
                );
                assert_eq!(classed.remove(stream, size, address), None, "removed twice");
            }
            let stream = DeviceStream(next(3));
            let want = 1 + next(max_want);
            assert_eq!(
                classed.best_fit(stream, want),
                reference.best_fit(stream, want),
                "step {step}: best fit of {want} on {stream:?}"
            );
            // The engine asks for the block after a listed one, whose size is a multiple of
            // `MIN_BLOCK_SIZE` (a size between classes is no origin the engine has).
            if let Some(&(stream, size, address)) =
                live.get(next(live.len().max(1) as u64) as usize)
                && size.is_multiple_of(MIN_BLOCK_SIZE)
            {
                assert_eq!(
                    classed.next_after(stream, size, address),
                    reference.next_after(stream, size, address),
                    "step {step}: the block after ({size}, {address}) on {stream:?}"
                );
            }
            if step % 500 == 0 {
                classed.check().unwrap();
            }
        }
        classed.check().unwrap();
        for stream in [S0, S1, DeviceStream(2)] {
            assert_eq!(
                classed.largest_first(stream).collect::<Vec<_>>(),
                reference.largest_first(stream)
            );
        }
        let mut a: Vec<BlockId> = classed.iter().collect();
        let mut b: Vec<BlockId> = reference.blocks.iter().map(|e| e.3).collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        assert_eq!(a.len(), live.len());
        let mut entries: Vec<_> = classed.entries().collect();
        let mut expected = reference.blocks.clone();
        entries.sort_unstable();
        expected.sort_unstable();
        assert_eq!(
            entries, expected,
            "entries() lists every block under its key"
        );
    }

    #[test]
    fn small_classes_agree_with_a_plain_reference_on_a_random_history() {
        // Mostly class sizes, sometimes beyond the range or not a class multiple.
        agree_with_the_reference(
            small(),
            |kind, r| match kind {
                0 => SMALL_BUFFER + 512 * (1 + r % 64),
                1 => 1 + r % SMALL_BUFFER,
                _ => 512 * (1 + r % (SMALL_BUFFER / 512)),
            },
            SMALL_BUFFER + 64 * 512,
        );
    }

    #[test]
    fn large_classes_agree_with_a_plain_reference_on_a_random_history() {
        // Mostly class sizes, sometimes below or beyond the range or not a class multiple.
        agree_with_the_reference(
            large(),
            |kind, r| match kind {
                0 => 32 * MIB + 512 * (1 + r % 4096),
                1 => 512 * (1 + r % 2048),
                2 => 1 + r % (32 * MIB),
                _ => SMALL_SIZE + 512 * (1 + r % (31 * MIB / 512)),
            },
            34 * MIB,
        );
    }
}
