//! `cross_stream_reuse:true`: a miss takes a wholly free segment another stream cached once an
//! event recorded on that stream after the segment's last free has completed (the engine's
//! `sharing`). PyTorch never does (`get_free_block` searches the request's stream only):
//! `streams.rs` checks that rule under `cross_stream_reuse:false`.

use caching_alloc_engine::alloc::CachingAllocator;
use caching_alloc_engine::device::sim::SimDevice;

use crate::common::*;

/// Whole segments cross streams, and free room is lent (the default).
const SHARING: &str = "cross_stream_reuse:true";
const S2: DeviceStream = DeviceStream(2);

/// Each segment's stream, by address.
fn segment_streams(alloc: &CachingAllocator<SimDevice>) -> Vec<u64> {
    alloc.snapshot().segments.iter().map(|s| s.stream).collect()
}

#[test]
fn a_segment_freed_on_a_stream_whose_event_is_pending_is_not_given_to_another_until_it_completes() {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    let a = alloc.malloc(MIB, S0).unwrap();
    let a_address = a.address();
    alloc.free(a).unwrap();
    assert_eq!(
        device.counters().events_recorded,
        0,
        "one stream alone records no fence"
    );

    // Stream 1 misses: stream 0's segment is newer than any fence, so one is recorded on
    // stream 0 and asked once; it has not completed, so stream 1 gets a segment of its own
    // (and fills it, so that it has no free block to lend).
    let b = alloc.malloc(MIB, S1).unwrap();
    assert_ne!(b.address(), a_address);
    let b2 = alloc.malloc(MIB, S1).unwrap();
    let counters = device.counters();
    assert_eq!(counters.allocs, 2);
    assert_eq!(counters.events_recorded, 1, "a fence on stream 0");
    assert_eq!(alloc.stats().num_stream_shares, 0);
    assert_eq!(segment_streams(&alloc), vec![0, 1]);
    check_invariants(&alloc, &device);

    // Still pending: stream 2 does not get it either (no second fence while one is pending).
    let c = alloc.malloc(MIB, S2).unwrap();
    assert_ne!(c.address(), a_address);
    assert_eq!(device.counters().allocs, 3);
    assert_eq!(device.counters().events_recorded, 1);
    alloc.free(c).unwrap();
    // Stream 2 went idle with other streams known: its fence is recorded at once.
    assert_eq!(device.counters().events_recorded, 2);

    // Stream 0's work passes its fence. Stream 1 misses: stream 0's whole free segment
    // serves it; stream 2's, behind a pending fence, does not.
    device.complete_events(S0);
    let e = alloc.malloc(MIB, S1).unwrap();
    assert_eq!(e.address(), a_address);
    assert_eq!(e.stream(), S1);
    assert_eq!(segment_streams(&alloc), vec![1, 1, 2]);
    let stats = alloc.stats();
    assert_eq!(stats.num_stream_shares, 1);
    assert_eq!(stats.num_device_alloc, 3, "no new segment");
    assert_eq!(stats.segment.all.current, 3);
    assert_eq!(stats.reserved_bytes.small_pool.current, 6 * MIB);
    assert_eq!(stats.allocated_bytes.all.current, 3 * MIB);
    assert_eq!(stats.active.all.current, 3);
    assert_eq!(
        stats.inactive_split.all.current, 1,
        "stream 0's old segment, split"
    );
    check_invariants(&alloc, &device);
    assert_eq!(stats.num_stream_lends, 0);
    for x in [b, b2, e] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn an_idle_streams_cache_serves_a_new_streams_requests_of_the_same_sizes_with_no_new_segment() {
    let (alloc, device) = allocator(256 * MIB, SHARING);
    // Stream 1 holds two tensors throughout (another thread's model, say), filling its small
    // segment: it has nothing to lend.
    let held = alloc.malloc(MIB, S1).unwrap();
    let held2 = alloc.malloc(MIB, S1).unwrap();
    let sizes = [4096, 700 * KIB, 3 * MIB, 12 * MIB];
    let first: Vec<_> = sizes
        .iter()
        .map(|&s| alloc.malloc(s, S0).unwrap())
        .collect();
    let reserved = alloc.stats().reserved_bytes.all.current;
    let segments = alloc.stats().segment.all.current;
    let addresses: Vec<u64> = first.iter().map(|a| a.address()).collect();
    for a in first {
        alloc.free(a).unwrap();
    }
    // The last free left stream 0 idle: its fence is recorded then.
    assert_eq!(device.counters().events_recorded, 1);
    device.complete_events(S0);

    // A new stream (a new worker thread) asks for the same sizes.
    let allocs_before = device.counters().allocs;
    let again: Vec<_> = sizes
        .iter()
        .map(|&s| alloc.malloc(s, S2).unwrap())
        .collect();
    assert_eq!(device.counters().allocs, allocs_before, "no new segment");
    let stats = alloc.stats();
    assert_eq!(stats.reserved_bytes.all.current, reserved);
    assert_eq!(stats.segment.all.current, segments);
    // Stream 0 held two segments: a 2 MiB small one (4 KiB and 700 KiB) and a 20 MiB large
    // one (3 MiB, then 12 MiB in its remainder). Both moved, each on the first request of its
    // pool; the second request of each pool was served by the moved segment.
    assert_eq!(stats.num_stream_shares, 2);
    let mut reused: Vec<u64> = again.iter().map(|a| a.address()).collect();
    reused.sort_unstable();
    let mut expected = addresses.clone();
    expected.sort_unstable();
    assert_eq!(reused, expected, "the same blocks, now stream 2's");
    assert!(again.iter().all(|a| a.stream() == S2));
    assert_eq!(
        stats.allocated_bytes.all.current,
        2 * MIB + 4096 + 700 * KIB + 3 * MIB + 12 * MIB
    );
    check_invariants(&alloc, &device);
    for a in again {
        alloc.free(a).unwrap();
    }
    alloc.free(held).unwrap();
    alloc.free(held2).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_segment_that_still_holds_a_live_block_stays_with_its_stream() {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    let _other = alloc.malloc(512, S1).unwrap();
    let live = alloc.malloc(4096, S0).unwrap();
    let freed = alloc.malloc(4096, S0).unwrap();
    alloc.free(freed).unwrap();
    device.complete_all_events();
    let allocs = device.counters().allocs;
    // Stream 0's free 4 KiB block (and stream 1's remainder) would fit, but their segments
    // hold live blocks.
    let b = alloc.malloc(4096, S2).unwrap();
    assert_eq!(device.counters().allocs, allocs + 1, "a new segment");
    assert_eq!(alloc.stats().num_stream_shares, 0);
    assert_ne!(b.stream(), S0);
    check_invariants(&alloc, &device);
    alloc.free(live).unwrap();
}

#[test]
fn idle_streams_are_taken_before_busy_ones_and_a_busy_stream_after_its_fence() {
    let (alloc, device) = allocator(256 * MIB, SHARING);
    // Stream 0 is busy: a live 12 MiB block and a whole free 12 MiB segment.
    let busy_live = alloc.malloc(12 * MIB, S0).unwrap();
    let busy_free = alloc.malloc(12 * MIB, S0).unwrap();
    let busy_address = busy_free.address();
    // Stream 1 is idle with a whole free 12 MiB segment.
    let idle = alloc.malloc(12 * MIB, S1).unwrap();
    let idle_address = idle.address();
    alloc.free(busy_free).unwrap();
    alloc.free(idle).unwrap();
    assert_eq!(
        device.counters().events_recorded,
        1,
        "only the stream that went idle records a fence"
    );
    device.complete_all_events();

    let first = alloc.malloc(12 * MIB, S2).unwrap();
    assert_eq!(
        first.address(),
        idle_address,
        "the idle stream's segment first"
    );
    // The busy stream's segment is newer than any of its fences: one is recorded and asked.
    let allocs = device.counters().allocs;
    let second = alloc.malloc(12 * MIB, S2).unwrap();
    assert_ne!(second.address(), busy_address);
    assert_eq!(device.counters().allocs, allocs + 1);
    assert_eq!(device.counters().events_recorded, 2);
    // Once stream 0 passes it, its whole free segment serves stream 2.
    device.complete_events(S0);
    let third = alloc.malloc(12 * MIB, S2).unwrap();
    assert_eq!(third.address(), busy_address);
    assert_eq!(device.counters().allocs, allocs + 1);
    assert_eq!(alloc.stats().num_stream_shares, 2);
    assert_eq!(segment_streams(&alloc), vec![0, 2, 2, 2]);
    check_invariants(&alloc, &device);
    for a in [busy_live, first, second, third] {
        alloc.free(a).unwrap();
    }
}

#[test]
fn best_fit_across_streams_takes_the_smallest_segment_that_fits() {
    let (alloc, device) = allocator(256 * MIB, SHARING);
    let _keep = alloc.malloc(512, S2).unwrap();
    let big = alloc.malloc(16 * MIB, S0).unwrap();
    let small = alloc.malloc(12 * MIB, S1).unwrap();
    let small_address = small.address();
    alloc.free(big).unwrap();
    alloc.free(small).unwrap();
    device.complete_all_events();
    let a = alloc.malloc(11 * MIB, S2).unwrap();
    assert_eq!(a.address(), small_address, "12 MiB, not 16 MiB");
    check_invariants(&alloc, &device);
}

#[test]
fn cross_stream_reuse_false_is_pytorchs_per_stream_rule() {
    let (alloc, device) = allocator(64 * MIB, "cross_stream_reuse:false");
    let _keep = alloc.malloc(512, S1).unwrap();
    let a = alloc.malloc(2 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    device.complete_all_events();
    let b = alloc.malloc(2 * MIB, S2).unwrap();
    assert_eq!(device.counters().allocs, 3);
    assert_eq!(device.counters().events_recorded, 0);
    assert_eq!(alloc.stats().num_stream_shares, 0);
    assert_eq!(b.stream(), S2);
    check_invariants(&alloc, &device);
}

#[test]
fn a_cache_only_request_never_takes_another_streams_segment() {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    let _keep = alloc.malloc(512, S1).unwrap();
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.free(a).unwrap();
    device.complete_all_events();
    assert!(alloc.malloc_cached(4096, S2).unwrap().is_none());
    assert_eq!(alloc.stats().num_stream_shares, 0);
}

/// A fence that cannot be asked (here its event query fails) keeps that stream's cache where
/// it is, and the request is served with new device memory instead of failing: a failed
/// query must neither hand the segment over unfenced nor turn a miss into an error. Once
/// the fence can be asked again, the next miss of another stream takes the segment.
#[test]
fn a_failed_fence_query_leaves_the_segment_where_it_was_and_the_request_gets_new_memory() {
    use caching_alloc_engine::device::sim::SimCall;
    let (alloc, device) = allocator(64 * MIB, SHARING);
    // Stream 1's tensor is of the large pool: stream 1 has no small block to lend.
    let _keep = alloc.malloc(2 * MIB, S1).unwrap();
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.free(a).unwrap();
    device.fail_next(SimCall::QueryEvent);
    let b = alloc.malloc(4096, S2).unwrap();
    assert_eq!(b.stream(), S2);
    // Segments by address: stream 1's, stream 0's (left where it was), stream 2's new one.
    assert_eq!(segment_streams(&alloc), vec![1, 0, 2]);
    assert_eq!(device.counters().allocs, 3);
    assert_eq!(alloc.stats().num_stream_shares, 0);
    check_invariants(&alloc, &device);
    device.complete_all_events();
    // The next miss of another stream asks the fence again, and takes stream 0's segment.
    let c = alloc.malloc(4096, DeviceStream(3)).unwrap();
    assert_eq!(c.stream(), DeviceStream(3));
    assert_eq!(segment_streams(&alloc), vec![1, 3, 2]);
    assert_eq!(alloc.stats().num_stream_shares, 1);
    assert_eq!(device.counters().allocs, 3);
    check_invariants(&alloc, &device);
}

/// With pool borrowing as well (both defaults): a gone stream's segments of the other pool
/// serve a new stream where a borrow would serve it on its own stream. A large request of at
/// most 2 MiB takes an idle stream's wholly free small-pool segment; a small request takes an
/// idle stream's wholly free 2 MiB large-pool segment, which moves to the small pool. Rounds
/// of data-loader threads whose tensors straddle the 1 MiB line made new segments every round
/// without this, while the wrong pool's segments of the last round's threads stayed cached.
#[test]
fn a_gone_streams_other_pool_segment_serves_where_a_borrow_would() {
    let config = "cross_stream_reuse:true,pool_borrowing:true,segment_sizing:grow";
    let (alloc, device) = allocator(64 * MIB, config);
    // Stream 1 holds a 12 MiB tensor (so the engine knows two streams, and stream 1 caches
    // nothing). Stream 0 caches one 2 MiB large segment and one small segment, goes idle,
    // and its work passes its fence.
    let held = alloc.malloc(12 * MIB, S1).unwrap();
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    let small = alloc.malloc(512 * KIB, S0).unwrap();
    let (large_address, small_address) = (large.address(), small.address());
    alloc.free(small).unwrap();
    alloc.free(large).unwrap();
    device.complete_events(S0);
    let stats = alloc.stats();
    assert_eq!(stats.segment.small_pool.current, 1);
    assert_eq!(stats.segment.large_pool.current, 2);
    assert_eq!(stats.num_device_alloc, 3);

    // Stream 1's 1.2 MiB request: stream 0's large segment serves it (the same pool first).
    let a = alloc.malloc(1200 * KIB, S1).unwrap();
    assert_eq!(a.address(), large_address);
    // The second: stream 0 has no large segment left, but its small segment is wholly free:
    // it moves to stream 1 and the request borrows it.
    let b = alloc.malloc(1200 * KIB, S1).unwrap();
    assert_eq!(b.address(), small_address);
    let stats = alloc.stats();
    assert_eq!(stats.num_device_alloc, 3, "no new segment");
    assert_eq!(stats.num_stream_shares, 2);
    assert_eq!(stats.num_pool_borrows, 1);
    assert_eq!(segment_streams(&alloc), vec![1, 1, 1]);
    // The borrowed block counts in its segment's pool, split by the small pool's rule; the
    // large block keeps its 848 KiB rest (a large block splits only for a rest over 1 MiB).
    assert_eq!(stats.allocated_bytes.small_pool.current, 1200 * KIB);
    assert_eq!(
        layout(&alloc),
        [
            vec![(12 * MIB, A)],
            vec![(2 * MIB, A)],
            vec![(1200 * KIB, A), (848 * KIB, F)],
        ]
    );
    check_invariants(&alloc, &device);

    for x in [a, b, held] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// The other way (`a_gone_streams_other_pool_segment_serves_where_a_borrow_would`): a small
/// request takes an idle stream's wholly free 2 MiB large-pool segment, which moves to the
/// requesting stream and to the small pool, split by the small pool's rule.
#[test]
fn a_gone_streams_2_mib_large_segment_serves_a_small_request() {
    let config = "cross_stream_reuse:true,pool_borrowing:true,segment_sizing:grow";
    let (alloc, device) = allocator(64 * MIB, config);
    let held = alloc.malloc(12 * MIB, S1).unwrap();
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    let large_address = large.address();
    alloc.free(large).unwrap();
    device.complete_events(S0);
    let c = alloc.malloc(512 * KIB, S1).unwrap();
    assert_eq!(c.address(), large_address);
    let stats = alloc.stats();
    assert_eq!(stats.num_device_alloc, 2, "no new segment");
    assert_eq!((stats.num_stream_shares, stats.num_pool_borrows), (1, 1));
    assert_eq!(stats.segment.small_pool.current, 1);
    assert_eq!(stats.segment.large_pool.current, 1);
    assert_eq!(stats.reserved_bytes.small_pool.current, 2 * MIB);
    assert_eq!(segment_streams(&alloc), vec![1, 1]);
    assert_eq!(
        layout(&alloc),
        [vec![(12 * MIB, A)], vec![(512 * KIB, A), (1536 * KIB, F)]]
    );
    check_invariants(&alloc, &device);
    for x in [c, held] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// PyTorch's rule on either switch: with `pool_borrowing:false`, another stream's segments
/// of the other pool are never taken (a new segment is made).
#[test]
fn without_pool_borrowing_another_streams_other_pool_is_left_alone() {
    let config = "cross_stream_reuse:true,pool_borrowing:false,segment_sizing:grow";
    let (alloc, device) = allocator(64 * MIB, config);
    let held = alloc.malloc(12 * MIB, S1).unwrap();
    let small = alloc.malloc(512 * KIB, S0).unwrap();
    alloc.free(small).unwrap();
    device.complete_events(S0);
    let a = alloc.malloc(1200 * KIB, S1).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_device_alloc, 3);
    assert_eq!((stats.num_stream_shares, stats.num_pool_borrows), (0, 0));
    assert_eq!(segment_streams(&alloc), vec![1, 0, 1]);
    for x in [a, held] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// Lending (`sharing`'s `lend_from_other_stream`): a new stream's small request is served by
/// the free part of another stream's split segment, which stays that stream's; the lent
/// block's free waits for an event on the borrowing stream (PyTorch's `record_stream` rule)
/// before the block is its stream's again and merges back.
#[test]
fn a_new_stream_is_lent_the_free_part_of_another_streams_segment_and_its_free_waits_for_its_own_work()
 {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    // Stream 1 (the main thread, say) holds a small tensor: its 2 MiB small segment is split.
    let held = alloc.malloc(512, S1).unwrap();
    // Stream 2 (a new worker thread) asks for 100 KiB: no cache of its own, no wholly free
    // segment anywhere; the free part of stream 1's segment was never used (no work behind
    // it), so it is lent at once: no new segment, no fence.
    let lent = alloc.malloc(100 * KIB, S2).unwrap();
    assert_eq!(lent.address(), held.address() + 512);
    assert_eq!(lent.stream(), S1, "the block stays stream 1's");
    let stats = alloc.stats();
    assert_eq!(stats.num_stream_lends, 1);
    assert_eq!(stats.num_stream_shares, 0);
    assert_eq!(stats.num_device_alloc, 1);
    assert_eq!(stats.allocated_bytes.small_pool.current, 512 + 100 * KIB);
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (512, A),
            (100 * KIB, A),
            (2 * MIB - 512 - 100 * KIB, F)
        ]]
    );
    assert_eq!(segment_streams(&alloc), vec![1]);
    check_invariants(&alloc, &device);

    // Stream 2 frees it: an event on stream 2, and the block waits for it.
    let recorded = device.counters().events_recorded;
    alloc.free(lent).unwrap();
    assert_eq!(device.counters().events_recorded, recorded + 1);
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (512, A),
            (100 * KIB, P),
            (2 * MIB - 512 - 100 * KIB, F)
        ]]
    );
    // Meanwhile stream 1's own request of that size is not given the pending block.
    let own = alloc.malloc(100 * KIB, S1).unwrap();
    assert_eq!(own.address(), held.address() + 512 + 100 * KIB);
    alloc.free(own).unwrap();
    check_invariants(&alloc, &device);
    // Once stream 2's work is done the block is stream 1's free memory again, merged.
    device.complete_events(S2);
    let again = alloc.malloc(512, S1).unwrap();
    assert_eq!(again.address(), held.address() + 512);
    assert_eq!(
        layout(&alloc),
        vec![vec![(512, A), (512, A), (2 * MIB - 1024, F)]]
    );
    assert_eq!(alloc.stats().num_device_alloc, 1);
    check_invariants(&alloc, &device);
    alloc.free(again).unwrap();
    alloc.free(held).unwrap();
    check_invariants(&alloc, &device);
}

/// A free block split off memory whose last free is not behind completed work carries that
/// free's stamp: it is not lent before the stream's fence has passed (a kernel of stream 0
/// may still read it), and is once it has.
#[test]
fn the_rest_of_a_block_freed_behind_pending_work_is_lent_only_after_its_streams_fence() {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    let a = alloc.malloc(MIB, S0).unwrap();
    let segment = a.address();
    // Stream 0 frees `a` and reuses half of the segment: the other 1 MiB was last freed with
    // `a`, behind work that may still run. (Its own use never exceeded 1 MiB, so the rest is
    // room it may lend.)
    alloc.free(a).unwrap();
    let c = alloc.malloc(MIB, S0).unwrap();
    assert_eq!(c.address(), segment);
    assert_eq!(layout(&alloc), vec![vec![(MIB, A), (MIB, F)]]);
    // Stream 1 asks for 8 KiB: a fence is recorded on stream 0 and asked; it has not
    // completed, so stream 1 gets a segment of its own.
    let d = alloc.malloc(8 * KIB, S1).unwrap();
    assert_ne!(d.address() / (2 * MIB), segment / (2 * MIB));
    assert_eq!(alloc.stats().num_stream_lends, 0);
    assert_eq!(device.counters().allocs, 2);
    check_invariants(&alloc, &device);
    // Stream 0's work passes the fence: stream 2's request is lent the rest of `a` (best fit:
    // smaller than stream 1's free rest of 2 MiB - 8 KiB).
    device.complete_events(S0);
    let e = alloc.malloc(8 * KIB, S2).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_stream_lends, 1);
    assert_eq!(device.counters().allocs, 2);
    assert_eq!(e.address(), segment + MIB);
    assert_eq!(e.stream(), S0);
    check_invariants(&alloc, &device);
    for x in [c, d, e] {
        alloc.free(x).unwrap();
    }
    device.complete_all_events();
    check_invariants(&alloc, &device);
}

/// Under PyTorch's rule nothing is lent: the new stream makes a segment of its own.
#[test]
fn without_cross_stream_reuse_nothing_is_lent() {
    let (alloc, device) = allocator(64 * MIB, "cross_stream_reuse:false");
    let held = alloc.malloc(512, S1).unwrap();
    let other = alloc.malloc(100 * KIB, S2).unwrap();
    assert_eq!(other.stream(), S2);
    assert_eq!(alloc.stats().num_stream_lends, 0);
    assert_eq!(device.counters().allocs, 2);
    alloc.free(other).unwrap();
    alloc.free(held).unwrap();
}

/// Random requests on three streams under every default (sharing, lending, borrowing), with
/// streams' work completing at random and event calls failing now and then: after every step
/// the invariants hold, and no request is ever given memory that another stream's work may
/// still use. The model: a range freed by the stream it was requested on stays busy for that
/// stream until that stream's work completes (`complete_events`), a device free (which
/// synchronises the device) or the engine's own synchronisation of events (`empty_cache`, the
/// out-of-memory path); the stream itself may reuse it at once (stream order), no other may.
mod lending_random {
    use caching_alloc_engine::device::sim::SimCall;
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Malloc { size: u64, stream: u64 },
        Free { index: usize },
        Complete { stream: u64 },
        FailQuery,
        FailRecord,
        FailWait,
        EmptyCache,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (prop_oneof![1..64 * KIB, 64 * KIB..MIB, MIB..6 * MIB], 0u64..3)
                .prop_map(|(size, stream)| Op::Malloc { size, stream }),
            5 => any::<usize>().prop_map(|index| Op::Free { index }),
            2 => (0u64..3).prop_map(|stream| Op::Complete { stream }),
            1 => Just(Op::FailQuery),
            1 => Just(Op::FailRecord),
            1 => Just(Op::FailWait),
            1 => Just(Op::EmptyCache),
        ]
    }

    /// Runs `ops`, checking after every request that no other stream's work may still use
    /// the block it got, unless (`waits`) the device made the requester wait for an event
    /// recorded on that stream after the free.
    fn run(ops: Vec<Op>, waits: bool) -> Result<(), TestCaseError> {
        let device = SimDevice::new(96 * MIB);
        let device = if waits {
            device.with_device_waits()
        } else {
            device
        };
        let config = caching_alloc_engine::alloc::AllocatorConfig::parse(
            "segment_sizing:grow,pool_borrowing:true,cross_stream_reuse:true,release_outgrown:true",
        )
        .unwrap();
        let alloc = CachingAllocator::new(device.clone(), config).unwrap();
        // Live allocations with the stream they were requested on.
        let mut live = Vec::new();
        // Freed ranges whose stream's work may still use them: (start, end, stream, the
        // stream's last event sequence at the free).
        let mut busy: Vec<(u64, u64, u64, u64)> = Vec::new();
        for op in ops {
            let (frees, syncs) = (device.counters().frees, alloc.stats().num_sync_all_streams);
            match op {
                Op::Malloc { size, stream } => {
                    if let Ok(block) = alloc.malloc(size, DeviceStream(stream)) {
                        live.push((block, stream));
                    }
                }
                Op::Free { index } if !live.is_empty() => {
                    let (block, stream) = live.swap_remove(index % live.len());
                    let recorded = device.last_recorded(DeviceStream(stream));
                    busy.push((
                        block.address(),
                        block.address() + block.size(),
                        stream,
                        recorded,
                    ));
                    // A lent block's free records an event on its stream; a failed record
                    // is an error and the block waits (the next call records it again).
                    let _ = alloc.free(block);
                }
                Op::Free { .. } => {}
                Op::Complete { stream } => {
                    device.complete_events(DeviceStream(stream));
                    busy.retain(|&(_, _, s, _)| s != stream);
                }
                Op::FailQuery => device.fail_next(SimCall::QueryEvent),
                Op::FailRecord => device.fail_next(SimCall::RecordEvent),
                Op::FailWait => device.fail_next(SimCall::WaitEvent),
                Op::EmptyCache => {
                    let _ = alloc.empty_cache();
                }
            }
            if device.counters().frees > frees || alloc.stats().num_sync_all_streams > syncs {
                busy.clear();
            }
            // A stream's completed work covers the work of other streams it waited for on the
            // device before it (the device's vector clocks).
            busy.retain(|&(_, _, s, recorded)| {
                device.completed_through(DeviceStream(s)) <= recorded
            });
            if let Some((block, stream)) = live.last()
                && matches!(op, Op::Malloc { .. })
            {
                let (start, end) = (block.address(), block.address() + block.size());
                for &(s, e, other, recorded) in &busy {
                    let ordered =
                        device.waited_for(DeviceStream(*stream), DeviceStream(other)) > recorded;
                    prop_assert!(
                        other == *stream || end <= s || e <= start || ordered,
                        "stream {stream} was given [{start:#x}, {end:#x}) while stream \
                         {other}'s work may still use [{s:#x}, {e:#x}), with no wait for it"
                    );
                }
            }
            check_invariants(&alloc, &device);
        }
        for (block, _) in live {
            let _ = alloc.free(block); // may meet one armed record failure
        }
        device.complete_all_events();
        let _ = alloc.empty_cache(); // may meet one armed failure
        device.complete_all_events();
        alloc.empty_cache().unwrap();
        prop_assert_eq!(device.bytes_in_use(), 0);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn no_stream_is_given_memory_another_streams_work_may_still_use(
            ops in prop::collection::vec(op(), 1..120)
        ) {
            run(ops, false)?;
        }

        /// On a device with waits between streams, memory behind another stream's pending
        /// work is handed over only behind a wait for an event recorded there after the free.
        #[test]
        fn with_device_waits_no_stream_uses_memory_of_another_streams_work_before_waiting_for_it(
            ops in prop::collection::vec(op(), 1..120)
        ) {
            run(ops, true)?;
        }
    }
}

/// A busy stream lends only small-pool room its own use has never needed: after the loan its
/// free bytes must still cover its peak own use minus its use now (`has_surplus` in the
/// engine's `sharing`). Stream 1 held 1.5 MiB of its 2 MiB small segment at its peak and
/// holds 512 bytes now: 1.5 MiB of its room is what its own work needs back; 400 KiB of the
/// rest is lent, 512 KiB is not (a segment of the requester's own instead).
#[test]
fn a_busy_stream_lends_only_small_pool_room_its_own_use_never_needed() {
    for (config, request, lent) in [(SHARING, 400 * KIB, true), (SHARING, 512 * KIB, false)] {
        let (alloc, device) = allocator(64 * MIB, config);
        let big = alloc.malloc(MIB, S1).unwrap();
        let half = alloc.malloc(512 * KIB, S1).unwrap();
        let held = alloc.malloc(512, S1).unwrap();
        alloc.free(big).unwrap();
        alloc.free(half).unwrap();
        // [1.5 MiB free, freed behind stream 1's work][512 held][never used]
        assert_eq!(
            layout(&alloc),
            vec![vec![(MIB + 512 * KIB, F), (512, A), (512 * KIB - 512, F)]],
            "{config}"
        );
        let events = device.counters().events_recorded;
        let new = alloc.malloc(request, S2).unwrap();
        let what = format!("{config}, {request} bytes");
        assert_eq!(alloc.stats().num_stream_lends, u64::from(lent), "{what}");
        assert_eq!(device.counters().allocs, if lent { 1 } else { 2 }, "{what}");
        if lent {
            // The never-used room after the held block: no fence needed.
            assert_eq!(new.stream(), S1, "{what}");
            assert_eq!(new.address(), held.address() + 512, "{what}");
            assert_eq!(device.counters().events_recorded, events, "{what}");
        } else {
            assert_eq!(new.stream(), S2, "{what}");
        }
        check_invariants(&alloc, &device);
        alloc.free(new).unwrap();
        alloc.free(held).unwrap();
        device.complete_all_events();
        check_invariants(&alloc, &device);
    }
}

/// A busy stream lends only to a stream that holds no segment of the request's pool (a new
/// thread's first memory): once a stream has memory of its own in the pool its misses grow
/// it, so its cache comes to cover its own work and stops depending on what other threads
/// happen to hold at the time (threads that keep working settle, as under PyTorch's rule).
#[test]
fn a_busy_stream_lends_only_to_a_stream_without_a_segment_of_the_pool() {
    let (alloc, device) = allocator(64 * MIB, SHARING);
    const S3: DeviceStream = DeviceStream(3);
    // Stream 2 fills a small segment of its own; stream 1, with none, finds no room to
    // borrow and takes one too.
    let a = alloc.malloc(MIB, S2).unwrap();
    let b = alloc.malloc(MIB, S2).unwrap();
    let c = alloc.malloc(512, S1).unwrap();
    assert_eq!(c.stream(), S1);
    assert_eq!(alloc.stats().num_device_alloc, 2);
    // Stream 2 misses: stream 1 is busy with room it never needed, but stream 2 has a small
    // segment of its own, so it grows another.
    let d = alloc.malloc(100 * KIB, S2).unwrap();
    assert_eq!(d.stream(), S2);
    assert_eq!(alloc.stats().num_stream_lends, 0);
    assert_eq!(alloc.stats().num_device_alloc, 3);
    // A new stream with no segment is lent: the best fit among the busy streams' room is the
    // rest of stream 2's new segment.
    let e = alloc.malloc(100 * KIB, S3).unwrap();
    assert_eq!(e.stream(), S2);
    assert_eq!(e.address(), d.address() + 100 * KIB);
    assert_eq!(alloc.stats().num_stream_lends, 1);
    assert_eq!(alloc.stats().num_device_alloc, 3);
    check_invariants(&alloc, &device);
    for x in [a, b, c, d, e] {
        alloc.free(x).unwrap();
    }
    device.complete_all_events();
    check_invariants(&alloc, &device);
}

/// A busy stream never lends large-pool memory, however much of it is free: a large block is
/// a working tensor of its own loop, which lending made the lender grow a segment for in a
/// later round (the runtime's soak).
#[test]
fn a_busy_stream_lends_no_large_block() {
    let (alloc, device) = allocator(256 * MIB, SHARING);
    let a = alloc.malloc(3 * MIB, S1).unwrap();
    let b = alloc.malloc(3 * MIB, S1).unwrap();
    assert_eq!(alloc.stats().num_device_alloc, 1, "one large segment");
    alloc.free(a).unwrap();
    // Stream 1 still holds `b`: busy, with 3 MiB and more free in its segment.
    let new = alloc.malloc(2 * MIB + 1, S2).unwrap();
    assert_eq!(alloc.stats().num_stream_lends, 0);
    assert_eq!(new.stream(), S2);
    assert_eq!(alloc.stats().num_device_alloc, 2);
    alloc.free(new).unwrap();
    alloc.free(b).unwrap();
    device.complete_all_events();
    check_invariants(&alloc, &device);
}

/// Lending never hands out a block of an expandable segment: such a segment is one stream's
/// growing address range. Turning `expandable_segments` off at run time leaves the segments
/// it made in the cache; a new stream's miss afterwards gets a segment of its own, not the
/// free part of another stream's expandable segment (it was lent before the fix).
#[test]
fn blocks_of_expandable_segments_are_never_lent_after_expandable_segments_is_turned_off() {
    let (alloc, device) = allocator(64 * MIB, "expandable_segments:true,cross_stream_reuse:true");
    let held = alloc.malloc(512, S1).unwrap();
    assert!(alloc.snapshot().segments[0].is_expandable);
    alloc
        .set_allocator_settings("expandable_segments:false")
        .unwrap();
    let other = alloc.malloc(100 * KIB, S2).unwrap();
    assert_eq!(other.stream(), S2, "a block of the requesting stream's own");
    let stats = alloc.stats();
    assert_eq!(stats.num_stream_lends, 0);
    let streams: Vec<u64> = alloc.snapshot().segments.iter().map(|s| s.stream).collect();
    assert_eq!(
        streams,
        vec![S1.0, S2.0],
        "one segment each: {:?}",
        alloc.snapshot().segments
    );
    for x in [held, other] {
        alloc.free(x).unwrap();
    }
    // The engine's self-check (the suite's recount assumes one setting throughout).
    alloc.check_invariants().unwrap();
    drop(device);
}

/// An allocator as `allocator` makes, over a device whose streams can wait for each other on
/// the device (as CUDA's can: `cuStreamWaitEvent`).
fn allocator_with_waits(capacity: u64, config: &str) -> (CachingAllocator<SimDevice>, SimDevice) {
    allocator_on(SimDevice::new(capacity).with_device_waits(), config)
}

/// Where the device can make a stream wait for another (RMM's stream-ordered pool takes another
/// stream's free block behind `cudaStreamWaitEvent`), a segment freed behind pending work is
/// handed to the missing stream at once: the engine records an event on the lender after the
/// free and makes the requester wait for it on the device, instead of asking the lender's
/// fence and allocating new memory while it is pending (the test above, on a device without
/// such waits).
#[test]
fn with_device_waits_a_segment_freed_behind_pending_work_is_taken_behind_a_wait() {
    let (alloc, device) = allocator_with_waits(64 * MIB, SHARING);
    let a = alloc.malloc(MIB, S0).unwrap();
    let a_address = a.address();
    alloc.free(a).unwrap();
    let freed_after = device.last_recorded(S0);

    // Nothing of stream 0 has completed; stream 1's miss takes its segment all the same.
    let b = alloc.malloc(MIB, S1).unwrap();
    assert_eq!(b.address(), a_address);
    assert_eq!(b.stream(), S1);
    let counters = device.counters();
    assert_eq!(counters.allocs, 1, "no new segment");
    assert_eq!(counters.events_waited, 1);
    assert!(
        device.waited_for(S1, S0) > freed_after,
        "stream 1 waits for an event recorded on stream 0 after the free"
    );
    assert_eq!(alloc.stats().num_stream_shares, 1);
    assert_eq!(segment_streams(&alloc), vec![1]);
    check_invariants(&alloc, &device);

    // A failed wait leaves the segment where it is: the request gets new memory (both waits
    // fail: for the whole segment, then for lending its block).
    alloc.free(b).unwrap();
    device.fail_nth(caching_alloc_engine::device::sim::SimCall::WaitEvent, 1);
    device.fail_nth(caching_alloc_engine::device::sim::SimCall::WaitEvent, 2);
    let c = alloc.malloc(MIB, S0).unwrap();
    assert_ne!(c.address(), a_address);
    assert_eq!(device.counters().allocs, 2);
    assert_eq!(segment_streams(&alloc), vec![1, 0]);
    alloc.free(c).unwrap();
    check_invariants(&alloc, &device);
}

/// With device waits, a busy stream's free small-pool room is lent behind a wait as well (under
/// the same limits as without: only to a stream with no segment of the pool, only room the
/// lender's own use never needed), and the loan's free is recorded on the borrower's stream.
#[test]
fn with_device_waits_a_busy_streams_room_is_lent_behind_a_wait() {
    let (alloc, device) = allocator_with_waits(64 * MIB, SHARING);
    let keep = alloc.malloc(512, S0).unwrap();
    let freed = alloc.malloc(64 * KIB, S0).unwrap();
    alloc.free(freed).unwrap();
    let freed_after = device.last_recorded(S0);
    let lent = alloc.malloc(100 * KIB, S1).unwrap();
    assert_eq!(lent.stream(), S0, "the block stays stream 0's");
    assert_eq!(alloc.stats().num_stream_lends, 1);
    assert_eq!(device.counters().allocs, 1);
    assert!(device.waited_for(S1, S0) > freed_after);
    alloc.free(lent).unwrap();
    alloc.free(keep).unwrap();
    check_invariants(&alloc, &device);
}

/// A data loader on CUDA's rule (a device with waits between streams): a training stream holds
/// the model (small and large tensors) and each step's activations; every step, each of the
/// workers' streams makes a batch (images and labels) that the training stream uses (recorded)
/// and frees. The workers never hold a small segment of their own: their batches are lent the
/// room of the training stream's small segment that its own use never needed, so reserved
/// memory is the training stream's alone whatever the number of workers, and level over
/// epochs. Without lending each worker stream takes a 2 MiB small segment of its own (2
/// workers: 26 MiB here instead of 22; `docs/decisions/threads-and-streams.md` has the family).
#[test]
fn with_device_waits_a_loaders_workers_live_on_loans_and_reserve_nothing_of_their_own() {
    for workers in [2u64, 4, 8] {
        let (alloc, device) = allocator_with_waits(1024 * MIB, SHARING);
        let trainer = S0;
        let model: Vec<_> = [400 * KIB, 512, 40 * KIB, 3 * MIB, 512]
            .iter()
            .map(|&size| alloc.malloc(size, trainer).unwrap())
            .collect();
        let mut reserved = Vec::new();
        for _epoch in 0..4 {
            for step in 0..8u64 {
                let batches: Vec<_> = (1..=workers)
                    .map(|w| {
                        let stream = DeviceStream(w);
                        let images = alloc.malloc(100 * KIB, stream).unwrap();
                        let labels = alloc.malloc(256, stream).unwrap();
                        (images, labels)
                    })
                    .collect();
                for (images, labels) in batches {
                    alloc.record_stream(&images, trainer).unwrap();
                    alloc.record_stream(&labels, trainer).unwrap();
                    let activations = alloc.malloc(51 * KIB, trainer).unwrap();
                    let grads = alloc.malloc(64 * KIB + step * 512, trainer).unwrap();
                    for x in [images, labels, activations, grads] {
                        alloc.free(x).unwrap();
                    }
                }
                device.complete_all_events();
                check_invariants(&alloc, &device);
            }
            reserved.push(alloc.stats().reserved_bytes.all.current);
        }
        let stats = alloc.stats();
        // The training stream's 2 MiB small segment and 20 MiB large one, nothing else.
        assert_eq!(reserved, vec![22 * MIB; 4], "{workers} workers");
        assert!(stats.num_stream_lends > 0, "{workers} workers");
        let streams = segment_streams(&alloc);
        assert!(
            streams.iter().all(|&s| s == 0),
            "{workers} workers: {streams:?}"
        );
        for x in model {
            alloc.free(x).unwrap();
        }
    }
}
