//! Eight threads allocating and freeing on one allocator at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng, rngs::SmallRng};

use crate::common::*;

#[test]
fn eight_threads_share_one_allocator_without_losing_a_byte() {
    let (alloc, device) = allocator(4096 * MIB, "");
    let alloc = Arc::new(alloc);
    // Every live block of every thread, by address: each new one is checked against its
    // neighbours when it is handed out, so a block given to two threads at once is caught at
    // once, not only if both are still live at the end.
    let handed_out: Arc<Mutex<BTreeMap<u64, (u64, u64)>>> = Arc::default();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let alloc = Arc::clone(&alloc);
            let handed_out = Arc::clone(&handed_out);
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                let mut live = Vec::new();
                let mut allocated = 0u64;
                for _ in 0..2000 {
                    if live.len() < 32 && rng.random_bool(0.55) {
                        let size = if rng.random_bool(0.8) {
                            rng.random_range(1..=MIB)
                        } else {
                            rng.random_range(MIB..=16 * MIB)
                        };
                        let a = alloc.malloc(size, DeviceStream(t % 2)).unwrap();
                        assert!(a.size() >= size);
                        let mut map = handed_out.lock().unwrap();
                        let end = a.address() + a.size();
                        if let Some((&start, &(len, owner))) = map.range(..end).next_back() {
                            assert!(
                                start + len <= a.address(),
                                "thread {t} got [{:#x}, {end:#x}), overlapping thread {owner}'s \
                                 [{start:#x}, {:#x})",
                                a.address(),
                                start + len
                            );
                        }
                        map.insert(a.address(), (a.size(), t));
                        drop(map);
                        allocated += a.size();
                        live.push(a);
                    } else if !live.is_empty() {
                        let a = live.swap_remove(rng.random_range(0..live.len()));
                        allocated -= a.size();
                        let removed = handed_out.lock().unwrap().remove(&a.address());
                        assert_eq!(removed, Some((a.size(), t)));
                        alloc.free(a).unwrap();
                    }
                }
                (live, allocated)
            })
        })
        .collect();
    let mut live = Vec::new();
    let mut expected = 0;
    for t in threads {
        let (l, bytes) = t.join().unwrap();
        live.extend(l);
        expected += bytes;
    }
    assert_eq!(alloc.stats().memory_allocated(), expected);
    assert_disjoint(live.iter().map(|a| (a.address(), a.size())).collect());
    check_invariants(&alloc, &device);
    for a in live {
        alloc.free(a).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 0);
    assert!(device.live_segments().is_empty());
}
