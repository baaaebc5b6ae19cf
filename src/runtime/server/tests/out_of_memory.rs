//! Out of memory: one per failed request, after every stream's cache was given back; a
//! request that can never fit; a use whose event cannot be recorded.

use std::sync::Arc;

use cubecl_runtime::server::{
    ComputeServer, CubeCount, ExecutionMode, KernelArguments, MetadataBindingInfo,
};
use parking_lot::Mutex;

use super::super::super::driver::MetadataLayout;
use super::harness::{Harness, harness, harness_on, stream};
use super::recording::NoKernel;
use crate::device::DeviceStream;
use crate::device::sim::SimDevice;

/// A server on an 80 MiB device with 4 stream slots, counting its out-of-memory observer's
/// calls and writing its first-OOM snapshot to a file of the test's own.
fn small_device(name: &str) -> (Harness, Arc<Mutex<Vec<String>>>, std::path::PathBuf) {
    let h = harness_on(SimDevice::new(80 * MIB), MetadataLayout::DriverBinding, 4);
    let observed = Arc::new(Mutex::new(Vec::new()));
    let seen = observed.clone();
    h.server
        .allocator()
        .on_out_of_memory(move |err| seen.lock().push(err.to_string()));
    let path = std::env::temp_dir().join(format!("{name}-{}.pickle", std::process::id()));
    let _ = std::fs::remove_file(&path);
    h.server
        .allocator()
        .dump_snapshot_on_oom(Some(path.clone()));
    (h, observed, path)
}

const MIB: u64 = 1 << 20;

#[test]
fn a_request_other_streams_caches_can_serve_is_no_out_of_memory() {
    // PyTorch counts `num_ooms` only when `malloc` really fails, after every cache was freed
    // (`release_cached_blocks`) and the allocation retried; here the caches include CubeCL's
    // free slices of every stream, given back before the engine's cache flush.
    let (mut h, observed, snapshot) = small_device("recovered-oom");
    // Stream 1 holds 24 MiB; streams 2 and 3 dropped 26 MiB and 20 MiB (each a segment of its
    // own), cached in their CubeCL pools.
    let _live = h.buffer(24 * MIB, stream(1));
    drop(h.buffer(26 * MIB, stream(2)));
    drop(h.buffer(20 * MIB, stream(3)));
    assert_eq!(h.server.allocator().memory_reserved(), 70 * MIB);
    // 30 MiB on stream 1: the device has 10 MiB left; only stream 2's cache can make room.
    let fits = h.buffer(30 * MIB, stream(1));
    h.server
        .flush(stream(1))
        .expect("served after the reclaim and the flush");
    let stats = h.server.allocator().stats();
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.num_alloc_retries, 1, "one flush and retry");
    assert_eq!(h.server.allocator().wait_for_oom_observers().failures, 0);
    assert!(observed.lock().is_empty());
    assert!(!snapshot.exists(), "no out-of-memory, no snapshot");
    assert_eq!(h.server.allocator().memory_reserved(), 54 * MIB);
    drop(fits);
}

#[test]
fn a_request_that_fails_is_one_out_of_memory_with_one_observer_call_and_one_snapshot() {
    let (mut h, observed, snapshot) = small_device("one-oom");
    let _live = h.buffer(24 * MIB, stream(1));
    drop(h.buffer(26 * MIB, stream(2)));
    drop(h.buffer(8 * MIB, stream(3)));
    let _too_much = h.buffer(60 * MIB, stream(1));
    let err = h
        .server
        .flush(stream(1))
        .expect_err("60 MiB beside 24 MiB in 80 MiB");
    assert!(err.to_string().contains("out of memory"), "{err}");
    let stats = h.server.allocator().stats();
    assert_eq!(stats.num_ooms, 1, "one failed request, one out-of-memory");
    assert_eq!(stats.num_alloc_retries, 1);
    // Every layer gave back its cache before the failure: only the live tensor stays.
    assert_eq!(h.server.allocator().memory_reserved(), 24 * MIB);
    for slot in 1..4 {
        let counters = h
            .server
            .streams
            .get(&mut h.server.driver, stream(slot))
            .memory
            .policy_counters();
        assert_eq!(counters.oom_reclaims, 1, "stream {slot} reclaimed once");
    }
    let report = h.server.allocator().wait_for_oom_observers();
    assert_eq!((report.failures, report.ran, report.panicked), (1, 1, 0));
    assert_eq!(observed.lock().len(), 1);
    assert!(observed.lock()[0].contains("out of memory"));
    let pickle = std::fs::read(&snapshot).expect("the snapshot of the first out-of-memory");
    assert_eq!(&pickle[..2], &[0x80, 2], "a pickle");
    std::fs::remove_file(&snapshot).expect("removed");
    // The server goes on: what fits is served.
    let fits = h.buffer(40 * MIB, stream(1));
    h.server
        .flush(stream(1))
        .expect("40 MiB beside 24 MiB fits");
    drop(fits);
}

#[test]
fn a_request_that_can_never_fit_is_a_clear_error_at_once() {
    let (mut h, observed, snapshot) = small_device("too-large");
    // Stream 1's slot exists before stream 2 caches anything: a new slot makes idle slots
    // hand their free slices back, which is not what this test is about.
    h.server.flush(stream(1)).expect("nothing issued yet");
    drop(h.buffer(8 * MIB, stream(2)));
    let cached_before = h
        .server
        .streams
        .get(&mut h.server.driver, stream(2))
        .memory
        .usage();
    let _never = h.buffer(200 * MIB, stream(1));
    let err = h
        .server
        .flush(stream(1))
        .expect_err("200 MiB on an 80 MiB device");
    let message = err.to_string();
    assert!(
        message.contains("larger than the largest segment"),
        "{message}"
    );
    assert!(
        !message.contains("after returning every free CubeCL slice"),
        "{message}"
    );
    // No stream's cache was walked for it, the engine did not flush.
    let other = h
        .server
        .streams
        .get(&mut h.server.driver, stream(2))
        .memory
        .policy_counters();
    assert_eq!(other.oom_reclaims, 0);
    assert_eq!(
        h.server
            .streams
            .get(&mut h.server.driver, stream(2))
            .memory
            .usage(),
        cached_before
    );
    let stats = h.server.allocator().stats();
    assert_eq!(
        stats.num_ooms, 1,
        "counted as PyTorch counts a failed cudaMalloc"
    );
    assert_eq!(stats.num_alloc_retries, 0);
    // An out-of-memory for the observers and the snapshot too.
    assert_eq!(h.server.allocator().wait_for_oom_observers().failures, 1);
    assert!(observed.lock()[0].contains("larger than the largest segment"));
    assert!(snapshot.exists());
    std::fs::remove_file(&snapshot).expect("removed");
}

#[test]
fn a_use_whose_event_cannot_be_recorded_holds_its_buffer_until_the_stream_is_synced() {
    // PyTorch's `insert_events` raises when an event cannot be recorded and leaves the block
    // alone: never freed early.
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    h.seen.lock().failing_records = Some(DeviceStream(2));
    let args = KernelArguments {
        buffers: vec![batch.clone().binding()],
        info: MetadataBindingInfo::new(Vec::new(), 0),
        tensor_maps: Vec::new(),
    };
    // SAFETY: the recording driver runs nothing.
    unsafe {
        h.server.launch(
            Box::new(NoKernel),
            CubeCount::Static(1, 1, 1),
            args,
            ExecutionMode::Checked,
            stream(2),
        )
    };
    let err = h
        .server
        .flush(stream(2))
        .expect_err("the failed record is reported");
    assert!(err.to_string().contains("cannot record an event"), "{err}");
    assert_eq!(
        h.seen.lock().launches.len(),
        1,
        "the launch itself was issued"
    );
    assert_eq!(h.server.pending_uses(), (0, 1), "held without an event");
    drop(batch);
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "reused although its use was never proven done"
    );
    // `empty_cache` synchronises the stream itself, then lets the buffer go.
    drop(next);
    h.server.memory_cleanup(stream(1));
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
}
