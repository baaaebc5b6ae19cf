//! The replay's trace compiler fed hostile traces (issue 33): an error or a program, never a
//! panic; a program replays through the engine and the stack, private pools included, without
//! a panic and with every byte back on the device. It overflowed `u64` on two huge mallocs and kept state per distinct stream id
//! without bound. `PROPTEST_CASES` sets the cases (default 256).

use burn_caching_alloc::alloc::{Trace, TraceEvent};
use burn_caching_alloc::device::sim::SimDevice;
use proptest::prelude::*;
use replay::allocator::{CachingStackAllocator, EngineAllocator};
use replay::program::MAX_STREAMS;
use replay::runner::replay;
use replay::{Program, TraceError};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn malloc(id: u64, size: u64, stream: u64) -> TraceEvent {
    malloc_in(0, id, size, stream)
}

fn malloc_in(pool: u64, id: u64, size: u64, stream: u64) -> TraceEvent {
    TraceEvent::Malloc {
        id,
        size,
        stream,
        block_size: size,
        address: 0,
        pool,
    }
}

fn event() -> impl Strategy<Value = TraceEvent> {
    let id = 0u64..6;
    let size = prop_oneof![1u64..4096, Just(0), Just(u64::MAX), Just(u64::MAX / 2 + 1)];
    let stream = prop_oneof![0u64..4, any::<u64>()];
    let pool = 0u64..3;
    prop_oneof![
        (pool.clone(), id.clone(), size, stream.clone())
            .prop_map(|(pool, id, size, stream)| malloc_in(pool, id, size, stream)),
        (pool.clone(), any::<bool>(), any::<bool>()).prop_map(|(pool, no_split, use_on_oom)| {
            TraceEvent::PoolCreate {
                pool,
                no_split,
                use_on_oom,
            }
        }),
        pool.clone()
            .prop_map(|pool| TraceEvent::PoolEmptyCache { pool }),
        pool.prop_map(|pool| TraceEvent::PoolRelease { pool }),
        id.clone().prop_map(|id| TraceEvent::FreeRequested { id }),
        (id.clone(), stream).prop_map(|(id, stream)| TraceEvent::RecordStream { id, stream }),
        id.prop_map(|id| TraceEvent::FreeCompleted { id }),
        Just(TraceEvent::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn any_trace_compiles_or_is_refused(events in prop::collection::vec(event(), 0..64), dropped in 0u64..2) {
        let trace = Trace { events, dropped };
        if let Ok(program) = Program::compile(&trace) {
            let curve = program.allocated_curve();
            prop_assert_eq!(curve.iter().copied().max().unwrap_or(0), program.peak_allocated());
            prop_assert_eq!(curve.last().copied(), Some(0), "every replay ends with nothing live");
            // Replayed through the engine and the stack (private pools included): an error or
            // a replay, never a panic, and every byte back on the device once dropped.
            let device = SimDevice::new(64 << 20);
            let _ = replay(&mut EngineAllocator::new(device.clone()), &program);
            prop_assert_eq!(device.bytes_in_use(), 0);
            let device = SimDevice::new(64 << 20);
            let _ = replay(&mut CachingStackAllocator::new(device.clone()), &program);
            prop_assert_eq!(device.bytes_in_use(), 0);
        }
    }
}

#[test]
fn live_bytes_past_u64_are_refused() {
    let trace = Trace {
        events: vec![malloc(1, u64::MAX, 0), malloc(2, u64::MAX, 0)],
        dropped: 0,
    };
    assert_eq!(
        Program::compile(&trace).err(),
        Some(TraceError::TooManyBytes { index: 1, id: 2 })
    );
}

#[test]
fn more_streams_than_the_bound_are_refused() {
    let mut events: Vec<TraceEvent> = (0..MAX_STREAMS as u64)
        .map(|s| malloc(s, 512, s * 1_000_003))
        .collect();
    assert!(
        Program::compile(&Trace {
            events: events.clone(),
            dropped: 0
        })
        .is_ok()
    );
    events.push(malloc(u64::MAX, 512, u64::MAX));
    assert_eq!(
        Program::compile(&Trace { events, dropped: 0 }).err(),
        Some(TraceError::TooManyStreams { index: MAX_STREAMS })
    );
}
