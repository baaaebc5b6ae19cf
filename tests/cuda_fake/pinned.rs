//! The pinned host pool that stages uploads and reads (`src/cuda/staging.rs`), made visible:
//! its statistics after each upload and read (`memory_stats`'s `host_*` keys, PyTorch's
//! `host_memory_stats`), its limits from the configuration (`pinned_max_idle_mb`,
//! `pinned_max_cached_size_mb`, `pinned_reserve_segment_size_mb`), on fake device 7
//! configured in code; and a dropped server leaving no pinned memory behind.

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::AllocatorConfig;
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::{CachingCudaRuntime, CudaDriver};
use burn_caching_alloc::runtime::{CachingServer, Driver as _, PinnedHostStats};
use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use crate::MIB;
use crate::fake_cuda::fake_or_skip;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// The pool's numbers now.
fn host(device: &CudaDevice) -> PinnedHostStats {
    backend::memory_stats(device)
        .host
        .expect("CUDA has a pinned host pool")
}

/// Waits until every write issued so far completed and its staging buffer went back: a sync
/// collects the buffers of copies already done, then waits for the stream; the second
/// collects the rest.
fn settle(client: &ComputeClient<CachingCudaRuntime>) {
    for _ in 0..2 {
        cubecl_common::future::block_on(client.sync()).expect("sync");
    }
}

/// `(in use, held, allocations held, cuMemHostAlloc calls, cuMemFreeHost calls)`.
fn counts(h: &PinnedHostStats) -> (u64, u64, u64, u64, u64) {
    (
        h.allocated_bytes.current,
        h.reserved_bytes.current,
        h.segment.current,
        h.num_host_alloc(),
        h.num_host_free(),
    )
}

#[test]
fn pinned_statistics_after_each_upload_and_read_with_the_limits_configured() {
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let device = CudaDevice::new(driver.ordinal(7));
    // A 1 MiB reservation, 1 MiB of idle buffers at most, none over 2 MiB kept.
    let config = AllocatorConfig::parse(
        "pinned_reserve_segment_size_mb:1,pinned_max_idle_mb:1,pinned_max_cached_size_mb:2",
    )
    .expect("parses");
    if let Err(err) = backend::configure(&device, config) {
        assert!(driver.fake().is_none(), "device 7 is this test's: {err}");
        println!("skipping on the real driver: {err}");
        return;
    }
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);

    // Opened: the reservation is one pinned allocation made up front, nothing in use.
    let h = host(&device);
    assert_eq!(counts(&h), (0, MIB, 1, 1, 0));
    assert_eq!(h.reserve_segment_bytes, MIB);
    assert_eq!(h.cached_bytes(), MIB);
    assert_eq!(h.host_alloc_time.count, 1);
    if let Some(fake) = driver.fake() {
        assert!(
            fake.leaks()
                .iter()
                .any(|l| l.contains("cuMemHostAlloc") && l.contains(&format!("{MIB} bytes"))),
            "the reservation is held: {:#?}",
            fake.leaks()
        );
    }

    // An upload over 64 KiB is staged: a 128 KiB buffer carved from the reservation.
    let a = pattern(100_000, 1);
    let ha = client.create(Bytes::from_bytes_vec(a.clone()));
    settle(&client);
    let h = host(&device);
    assert_eq!(counts(&h), (0, MIB, 1, 1, 0), "no new pinned allocation");
    assert_eq!((h.allocation.allocated, h.allocation.freed), (1, 1));
    assert_eq!(h.allocated_bytes.peak, 128 << 10);

    // Its read reuses that buffer.
    assert!(client.read(vec![ha.clone()])[0].to_vec() == a);
    let h = host(&device);
    assert_eq!(counts(&h), (0, MIB, 1, 1, 0));
    assert_eq!(h.allocation.allocated, 2);

    // A 1 MiB buffer does not fit what is left of the reservation: cuMemHostAlloc, and kept
    // idle after the copy (1 MiB of idle buffers allowed).
    let b = pattern(700_000, 2);
    let hb = client.create(Bytes::from_bytes_vec(b.clone()));
    settle(&client);
    let h = host(&device);
    assert_eq!(counts(&h), (0, 2 * MIB, 2, 2, 0));
    assert_eq!(h.cached_bytes(), 2 * MIB);
    assert_eq!(h.host_alloc_time.count, 2);

    // Reused by the next upload of that class.
    let c = pattern(600_000, 3);
    let hc = client.create(Bytes::from_bytes_vec(c.clone()));
    settle(&client);
    assert_eq!(counts(&host(&device)), (0, 2 * MIB, 2, 2, 0));

    // One read of both: two 1 MiB buffers in use at once (a new one), and only one of them
    // kept when they come back: the idle limit frees the other.
    let back = client.read(vec![hb.clone(), hc.clone()]);
    assert!(back[0].to_vec() == b && back[1].to_vec() == c);
    let h = host(&device);
    assert_eq!(counts(&h), (0, 2 * MIB, 2, 3, 1));
    assert_eq!(h.allocated_bytes.peak, 2 * MIB);
    assert_eq!(h.reserved_bytes.peak, 3 * MIB);
    assert_eq!(h.host_free_time.count, 1);

    // A 4 MiB buffer is over `pinned_max_cached_size_mb`: freed as soon as its copy is done.
    let d = pattern(3 * MIB as usize, 4);
    let hd = client.create(Bytes::from_bytes_vec(d.clone()));
    settle(&client);
    let h = host(&device);
    assert_eq!(counts(&h), (0, 2 * MIB, 2, 4, 2));
    assert_eq!(h.reserved_bytes.peak, 6 * MIB);
    assert!(client.read(vec![hd.clone()])[0].to_vec() == d);
    assert_eq!(counts(&host(&device)), (0, 2 * MIB, 2, 5, 3));

    // The same numbers by name, and in the summary.
    let map = backend::memory_stats(&device).to_map();
    assert_eq!(map["host_reserved_bytes.current"], 2 * MIB as i64);
    assert_eq!(map["host_segment.current"], 2);
    assert_eq!(map["num_host_alloc"], 5);
    assert_eq!(map["num_host_free"], 3);
    assert_eq!(map["host_alloc_time.count"], 5);
    assert_eq!(map["host_reserve_segment_bytes"], MIB as i64);
    assert_eq!(map["host_cached_bytes"], 2 * MIB as i64);
    let summary = backend::memory_summary(&device);
    assert!(summary.contains("Pinned host memory"), "{summary}");
    assert!(summary.contains("5 cuMemHostAlloc calls"), "{summary}");

    // Peaks and totals reset with the device's.
    backend::reset_peak_memory_stats(&device);
    let h = host(&device);
    assert_eq!(h.reserved_bytes.peak, 2 * MIB);
    backend::reset_accumulated_memory_stats(&device);
    let h = host(&device);
    assert_eq!((h.num_host_alloc(), h.host_alloc_time.count), (0, 0));
    assert_eq!(h.segment.current, 2);
    drop((ha, hb, hc, hd));
    if let Some(fake) = driver.fake() {
        fake.assert_no_violations();
    }
}

/// The pool dies with its server: its reservation (and any idle buffer) is freed.
#[test]
fn a_dropped_server_frees_its_pinned_reservation_and_idle_buffers() {
    let Some(driver) = fake_or_skip() else { return };
    let Some(fake) = driver.fake() else {
        crate::fake_cuda::fake_only("needs the fake's list of what is still allocated");
        return;
    };
    if !crate::child::in_child(
        "pinned::a_dropped_server_frees_its_pinned_reservation_and_idle_buffers",
        &[],
    ) {
        return;
    }
    let id = DeviceId {
        type_id: 0,
        index_id: 3,
    };
    let pinned = |leaks: &[String]| {
        leaks
            .iter()
            .filter(|l| l.contains("cuMemHostAlloc"))
            .count()
    };
    assert_eq!(pinned(&fake.leaks()), 0);
    let config = AllocatorConfig::parse("pinned_reserve_segment_size_mb:8").expect("parses");
    let server =
        CachingServer::new(CudaDriver::open(id).expect("driver"), id, config).expect("server");
    assert_eq!(
        pinned(&fake.leaks()),
        1,
        "the reservation is made when the server opens the device: {:#?}",
        fake.leaks()
    );
    drop(server);
    let leaks = fake.leaks();
    assert_eq!(pinned(&leaks), 0, "{leaks:#?}");
    fake.assert_no_violations();
}
