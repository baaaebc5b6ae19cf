//! Readings change nothing (issue 47): the same seeded program of requests, frees, uses on
//! other streams and event completions, run once with every reading the engine offers after
//! every operation (`stats`, `snapshot`, `summary`, `memory_report` from a point, the trace,
//! `memory_reserved`) and once with none, makes the same device allocations and frees, hands
//! out the same addresses, and ends with the same segment layout and statistics. A reading that
//! polled the streams' events (completing pending frees early) or touched the free lists would
//! change the second run.

use caching_alloc_engine::alloc::{
    AllocatorConfig, CachingAllocator, HistoryOptions, MemoryPoint, MemoryReport,
};
use caching_alloc_engine::device::sim::SimDevice;
use proptest::prelude::*;

use crate::common::*;

#[derive(Clone, Debug)]
enum Op {
    Malloc { size: u64, stream: u64 },
    Free { index: usize },
    UseOn { index: usize, stream: u64 },
    Complete { stream: u64 },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![1..64 * KIB, 64 * KIB..MIB, MIB..12 * MIB], 0u64..3)
            .prop_map(|(size, stream)| Op::Malloc { size, stream }),
        4 => any::<usize>().prop_map(|index| Op::Free { index }),
        2 => (any::<usize>(), 0u64..3).prop_map(|(index, stream)| Op::UseOn { index, stream }),
        2 => (0u64..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

/// What one run did: every request's address (or `None` when it failed), the device's
/// counters, the final layout (segments as (address, size, blocks as (size, state))) and the
/// final statistics without the free-space reading.
type Outcome = (
    Vec<Option<u64>>,
    (u64, u64),
    Vec<(
        u64,
        u64,
        Vec<(u64, caching_alloc_engine::alloc::BlockState)>,
    )>,
    caching_alloc_engine::alloc::MemoryStats,
);

fn run(ops: &[Op], config: &str, read: bool) -> Outcome {
    let device = SimDevice::new(64 * MIB);
    let config = AllocatorConfig::parse(config).expect("config");
    let alloc = CachingAllocator::new(device.clone(), config).expect("allocator");
    alloc.record_memory_history(HistoryOptions::default());
    let start = MemoryPoint::of_engine(alloc.snapshot());
    let mut live = Vec::new();
    let mut addresses = Vec::new();
    for op in ops {
        match *op {
            Op::Malloc { size, stream } => match alloc.malloc(size, DeviceStream(stream)) {
                Ok(block) => {
                    addresses.push(Some(block.address()));
                    live.push(block);
                }
                Err(_) => addresses.push(None),
            },
            Op::Free { index } if !live.is_empty() => {
                let block = live.swap_remove(index % live.len());
                alloc.free(block).expect("free");
            }
            Op::UseOn { index, stream } if !live.is_empty() => {
                let block = &live[index % live.len()];
                alloc
                    .record_stream(block, DeviceStream(stream))
                    .expect("record_stream");
            }
            Op::Complete { stream } => device.complete_events(DeviceStream(stream)),
            Op::EmptyCache => {
                alloc.empty_cache().expect("empty_cache");
            }
            Op::Free { .. } | Op::UseOn { .. } => {}
        }
        if read {
            let _ = alloc.stats().to_map();
            let _ = alloc.memory_reserved();
            let _ = alloc.summary();
            let now = MemoryPoint::of_engine(alloc.snapshot());
            let _ = MemoryReport::between(&start, &now).to_string();
            let _ = alloc.trace();
        }
    }
    let layout = alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| {
            (
                s.address,
                s.total_size,
                s.blocks.iter().map(|b| (b.size, b.state)).collect(),
            )
        })
        .collect();
    let mut stats = alloc.stats();
    stats.free_space = Default::default();
    let counters = device.counters();
    for block in live {
        alloc.free(block).expect("free");
    }
    (addresses, (counters.allocs, counters.frees), layout, stats)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Under the defaults (pool borrowing, cross-stream reuse and lending, outgrown segments
    /// released) and under PyTorch's rules.
    #[test]
    fn a_reading_after_every_operation_changes_no_decision(
        ops in prop::collection::vec(op(), 1..150),
        pytorch in any::<bool>(),
    ) {
        let config = if pytorch { caching_alloc_engine::alloc::PYTORCH_CONFIG } else { "" };
        let quiet = run(&ops, config, false);
        let read = run(&ops, config, true);
        prop_assert_eq!(&quiet.0, &read.0, "the addresses handed out");
        prop_assert_eq!(quiet.1, read.1, "device allocations and frees");
        prop_assert_eq!(&quiet.2, &read.2, "the final layout");
        prop_assert_eq!(&quiet.3, &read.3, "the final statistics");
    }
}
