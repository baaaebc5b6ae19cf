//! Property test for expandable segments: random malloc / free / record_stream / empty_cache
//! sequences, with failures injected into page maps, keep every invariant after every step,
//! and in the end every page is unmapped and every range given back. (The reference model of
//! `props.rs` follows ordinary segments; here the invariants and the device's own view are
//! the oracle: the allocator's mapped runs must be exactly the device's.)

use caching_alloc_engine::alloc::Allocation;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

use crate::common::*;

#[derive(Clone, Debug)]
enum Op {
    Malloc { size: u64, stream: u64 },
    Free { index: usize },
    RecordStream { index: usize, stream: u64 },
    EmptyCache,
    CompleteEvents { stream: u64 },
    FailNextDeviceAlloc,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=MIB,                      // small pool
        3 => (MIB + 1)..=(10 * MIB),           // large, shared 20 MiB segments
        2 => (10 * MIB)..=(40 * MIB),          // large, own segments (oversize with max_split 32)
        1 => (40 * MIB)..=(120 * MIB),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), 0u64..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        7 => any::<usize>().prop_map(|index| Op::Free { index }),
        2 => (any::<usize>(), 0u64..3).prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        1 => Just(Op::EmptyCache),
        2 => (0u64..3).prop_map(|stream| Op::CompleteEvents { stream }),
        1 => Just(Op::FailNextDeviceAlloc),
    ]
}

fn config() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("expandable_segments:True"),
        Just("expandable_segments:True,max_split_size_mb:20"),
        Just(
            "expandable_segments:True,garbage_collection_threshold:0.5,per_process_memory_fraction:0.8"
        ),
        Just("expandable_segments:True,roundup_power2_divisions:4,per_process_memory_fraction:0.7"),
    ]
}

fn check_no_overlap(live: &[Allocation<u64>]) {
    assert_disjoint(live.iter().map(|a| (a.address(), a.size())).collect());
}

proptest! {
    // Failing cases are saved beside this file. `PROPTEST_CASES` sets the number of cases
    // (256 by default).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn expandable_invariants_hold_after_every_step(config in config(), ops in prop::collection::vec(op(), 1..120)) {
        let (alloc, device) = allocator(256 * MIB, config);
        let mut live: Vec<Allocation<u64>> = Vec::new();
        for op in ops {
            match op {
                Op::Malloc { size, stream } => match alloc.malloc(size, DeviceStream(stream)) {
                    Ok(a) => {
                        prop_assert!(a.size() >= size);
                        prop_assert_eq!(a.address() % 512, 0);
                        live.push(a);
                    }
                    Err(e) => prop_assert!(e.is_out_of_memory(), "unexpected error {e}"),
                },
                Op::Free { index } if !live.is_empty() => {
                    let a = live.swap_remove(index % live.len());
                    alloc.free(a).unwrap();
                }
                Op::RecordStream { index, stream } if !live.is_empty() => {
                    alloc.record_stream(&live[index % live.len()], DeviceStream(stream)).unwrap();
                }
                Op::EmptyCache => {
                    alloc.empty_cache().unwrap();
                    let snapshot = alloc.snapshot();
                    prop_assert!(
                        snapshot.segments.iter().all(|s| s.active_size > 0),
                        "empty_cache left a segment with no active block"
                    );
                }
                Op::CompleteEvents { stream } => device.complete_events(DeviceStream(stream)),
                Op::FailNextDeviceAlloc => device.fail_nth_allocation(1),
                _ => {}
            }
            check_invariants(&alloc, &device);
            check_no_overlap(&live);
            let stats = alloc.stats();
            if let Some(f) = alloc.config().memory_fraction {
                prop_assert!(stats.memory_reserved() as f64 <= f * (256 * MIB) as f64);
            }
        }
        for a in live.drain(..) {
            alloc.free(a).unwrap();
        }
        device.complete_all_events();
        alloc.empty_cache().unwrap();
        let stats = alloc.stats();
        prop_assert_eq!(stats.memory_allocated(), 0);
        prop_assert_eq!(stats.memory_reserved(), 0);
        prop_assert_eq!(stats.active_bytes.all.current, 0);
        prop_assert!(device.live_segments().is_empty());
        prop_assert!(device.mapped_runs().is_empty());
        prop_assert!(device.reserved_ranges().is_empty(), "every expandable range given back");
    }
}
