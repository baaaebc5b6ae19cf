//! A buffer whose reservation failed is never resolved, on the recording driver over the
//! simulated device: its writes, launches, reads and `get_resource` return the reservation's
//! error, no kernel is launched over it, and every live buffer keeps its bytes (PyTorch's
//! `DeviceCachingAllocator::malloc` raises `OutOfMemoryError` and every live tensor keeps its
//! values). Without the stream's
//! guard slice, the failed buffer resolved to the stream's first slice: whatever buffer held
//! it was overwritten.

use cubecl_common::bytes::Bytes;
use cubecl_common::future::block_on;
use cubecl_common::stream_id::StreamId;
use cubecl_runtime::server::{
    ComputeServer, CopyDescriptor, Handle, MetadataBindingInfo, ServerError,
};
use proptest::prelude::*;

use super::super::driver::MetadataLayout;
use super::tests::{Harness, harness_on, stream};
use crate::device::sim::{SimCall, SimDevice};

const MIB: u64 = 1 << 20;

fn copy_of(handle: &Handle, len: usize) -> CopyDescriptor {
    CopyDescriptor::new(handle.clone().binding(), [len].into(), [1].into(), 1)
}

/// What CubeCL's `create` sends after `initialize_memory`: the bytes, written on `on`.
fn write(h: &mut Harness, handle: &Handle, bytes: Vec<u8>, on: StreamId) {
    let desc = copy_of(handle, bytes.len());
    h.server
        .write(vec![(desc, Bytes::from_bytes_vec(bytes))], on);
}

fn read(
    h: &mut Harness,
    handle: &Handle,
    len: usize,
    on: StreamId,
) -> Result<Vec<u8>, ServerError> {
    let mut bytes = block_on(h.server.read(vec![copy_of(handle, len)], on))?;
    Ok(bytes.remove(0).to_vec())
}

/// A kernel over `buffers` on `on` (the recording driver runs nothing, it counts).
fn launch(h: &mut Harness, buffers: &[&Handle], on: StreamId) {
    h.issue_launch(buffers, MetadataBindingInfo::new(vec![1, 2], 2), on);
}

fn launches(h: &Harness) -> usize {
    h.seen.lock().launches.len()
}

/// `len` bytes that say which buffer they belong to.
fn pattern(id: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| id.wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

/// The reason of a generic error (every error these tests expect).
fn reason(err: &ServerError) -> String {
    match err {
        ServerError::Generic { reason, .. } => reason.clone(),
        other => format!("{other:?}"),
    }
}

/// Every use of `failed` (a buffer of `len` bytes whose reservation failed with an error
/// containing `expected`) on `on` returns that error, launches nothing, and leaves `live` as
/// they were.
fn assert_unusable(
    h: &mut Harness,
    failed: &Handle,
    len: usize,
    expected: &str,
    on: StreamId,
    live: &[(Handle, Vec<u8>)],
) {
    let before = launches(h);
    write(h, failed, vec![0xEE; len], on);
    let written = h.server.flush(on);
    assert_live(h, live, "a write of the failed buffer");
    let written = written.expect_err("a write of a failed buffer fails");
    assert!(reason(&written).contains(expected), "{written:?}");
    launch(h, &[&live[0].0, failed], on);
    let launched = h.server.flush(on);
    assert_eq!(
        launches(h),
        before,
        "no kernel is launched over a failed buffer"
    );
    let launched = launched.expect_err("a launch over a failed buffer fails");
    assert!(reason(&launched).contains(expected), "{launched:?}");
    let unread = read(h, failed, len, on).expect_err("a failed buffer has nothing to read");
    assert!(reason(&unread).contains(expected), "{unread:?}");
    let resource = h
        .server
        .get_resource(failed.clone().binding(), on)
        .expect_err("a failed buffer has no resource");
    assert!(reason(&resource).contains(expected), "{resource:?}");
    assert_live(h, live, "the uses of the failed buffer");
}

/// Every buffer of `live` reads its bytes, after `what`.
fn assert_live(h: &mut Harness, live: &[(Handle, Vec<u8>)], what: &str) {
    for (n, (handle, bytes)) in live.iter().enumerate() {
        let back = read(h, handle, bytes.len(), handle.stream).expect("a live buffer reads");
        if let Some(at) = back.iter().zip(bytes).position(|(b, e)| b != e) {
            panic!(
                "live buffer {n} changed after {what}: byte {at} reads {}, not {}",
                back[at], bytes[at]
            );
        }
    }
}

/// Buffers a (2), b (3), c (4) of 4 MiB live; a request that cannot be served fails; its
/// bytes, a kernel over it, a read and `get_resource` of it all fail with its error; a, b and
/// c keep their bytes; the next request works. `fail` makes the request fail and returns what
/// its error says.
fn failed_request_keeps_live_buffers(
    device: SimDevice,
    fail: impl FnOnce(&mut Harness) -> &'static str,
) {
    let mut h = harness_on(device, MetadataLayout::DriverBinding, 4);
    let on = stream(0);
    let len = 4 * MIB as usize;
    let live: Vec<(Handle, Vec<u8>)> = [2u8, 3, 4]
        .into_iter()
        .map(|value| {
            let handle = h.buffer(len as u64, on);
            write(&mut h, &handle, vec![value; len], on);
            (handle, vec![value; len])
        })
        .collect();
    h.server.flush(on).expect("three buffers");
    let expected = fail(&mut h);

    // CubeCL's `create`: the reservation, then the bytes (a `full` of 7).
    let failed = h.buffer(64 * MIB, on);
    write(&mut h, &failed, vec![7; len], on);
    let err = h.server.flush(on);
    assert_live(&mut h, &live, "the failed request");
    let err = err.expect_err("the request fails");
    // The reservation's error, once: the write repeated it.
    assert!(reason(&err).contains(expected), "{err:?}");
    assert_unusable(&mut h, &failed, len, expected, on, &live);
    // From another stream too.
    assert_unusable(&mut h, &failed, len, expected, stream(1), &live);

    let next = h.buffer(len as u64, on);
    write(&mut h, &next, vec![5; len], on);
    h.server.flush(on).expect("the next request works");
    assert_eq!(read(&mut h, &next, len, on).expect("read"), vec![5; len]);
    drop(failed);
    assert_eq!(
        h.server.streams.get(&mut h.server.driver, on).failed.len(),
        0
    );
}

#[test]
fn an_out_of_memory_request_corrupts_no_live_buffer() {
    failed_request_keeps_live_buffers(SimDevice::new(72 * MIB), |_| "out of memory")
}

#[test]
fn a_request_rejected_at_the_memory_fraction_corrupts_no_live_buffer() {
    failed_request_keeps_live_buffers(SimDevice::new(1 << 30), |h| {
        let allocator = h.server.allocator();
        allocator
            .set_allocator_settings("throw_on_cudamalloc_oom:True")
            .expect("setting");
        allocator.set_memory_fraction(0.0625).expect("a 64 MiB cap");
        "throw_on_cudamalloc_oom"
    })
}

#[test]
fn a_request_over_the_memory_fraction_corrupts_no_live_buffer() {
    failed_request_keeps_live_buffers(SimDevice::new(1 << 30), |h| {
        h.server
            .allocator()
            .set_memory_fraction(0.0625)
            .expect("a 64 MiB cap");
        "out of memory"
    })
}

#[test]
fn a_device_error_on_allocation_corrupts_no_live_buffer() {
    let device = SimDevice::new(1 << 30);
    let armed = device.clone();
    failed_request_keeps_live_buffers(device, move |_| {
        armed.fail_next(SimCall::Allocate);
        "reserving 67108864 bytes failed"
    })
}

#[test]
fn a_private_pool_out_of_room_corrupts_no_live_buffer() {
    failed_request_keeps_live_buffers(SimDevice::new(72 * MIB), |h| {
        let pool = h
            .server
            .allocator()
            .create_pool(Default::default())
            .expect("pool");
        // The stream's next reservations go to the pool (as `use_mem_pool` routes them).
        h.server.route_to_pool(stream(0), Some(pool));
        "out of memory"
    })
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Step {
    /// A buffer of `SIZES[size]` bytes on stream `on`, its bytes written as `create` does;
    /// with `inject`, the device fails the next allocation (out of memory) or the next
    /// allocation call (a driver error) first; `huge` asks for more than the device allows.
    Create {
        size: usize,
        on: u64,
        inject: Option<bool>,
        huge: bool,
    },
    /// A write, a kernel, a read and `get_resource` of the `n`-th failed buffer, on `on`.
    UseFailed { n: usize, on: u64 },
    /// Drops the `n`-th live buffer.
    DropLive { n: usize },
    /// Drops the `n`-th failed buffer.
    DropFailed { n: usize },
    /// `empty_cache`.
    EmptyCache,
}

/// Sizes of the buffers that fit (the small pool's 2 MiB segments, or one large segment).
const SIZES: [u64; 5] = [100, 512, 4096, 64 << 10, 3 * MIB];
/// Allocations over this many bytes fail: the huge request always does.
const DEVICE_LIMIT: u64 = 32 * MIB;
const HUGE: u64 = 48 * MIB;

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (
            0..SIZES.len(),
            0..2u64,
            prop::option::weighted(0.3, any::<bool>()),
            prop::bool::weighted(0.2),
        )
            .prop_map(|(size, on, inject, huge)| Step::Create { size, on, inject, huge }),
        2 => (0..8usize, 0..2u64).prop_map(|(n, on)| Step::UseFailed { n, on }),
        1 => (0..8usize).prop_map(|n| Step::DropLive { n }),
        1 => (0..8usize).prop_map(|n| Step::DropFailed { n }),
        1 => Just(Step::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random buffers with known bytes, random requests failed by the device (out of memory
    /// beyond its limit, an injected out-of-memory, an injected driver error): no live buffer
    /// ever changes, every failed one stays unusable, and no kernel runs over one.
    #[test]
    fn failed_requests_never_change_a_live_buffer(steps in prop::collection::vec(step(), 1..32)) {
        let device = SimDevice::new(1 << 30);
        device.fail_allocations_over(Some(DEVICE_LIMIT));
        let mut h = harness_on(device.clone(), MetadataLayout::DriverBinding, 4);
        let mut live: Vec<(Handle, Vec<u8>)> = Vec::new();
        let mut failed: Vec<(Handle, usize)> = Vec::new();
        let mut next_id = 0u8;
        for step in steps {
            match step {
                Step::Create { size, on, inject, huge } => {
                    match inject {
                        Some(true) => device.fail_nth_allocation(1),
                        Some(false) => device.fail_next(SimCall::Allocate),
                        None => {}
                    }
                    let on = stream(on);
                    let len = if huge { HUGE } else { SIZES[size] };
                    next_id = next_id.wrapping_add(1);
                    // A huge request's bytes are few: any buffer it lands on would hold them.
                    let bytes = pattern(next_id, if huge { 100 } else { len as usize });
                    let handle = h.buffer(len, on);
                    write(&mut h, &handle, bytes.clone(), on);
                    match h.server.flush(on) {
                        Ok(()) => {
                            prop_assert!(!huge, "more than the device allows was served");
                            live.push((handle, bytes));
                        }
                        Err(_) => failed.push((handle, bytes.len())),
                    }
                    // An armed failure the request did not meet stays for a later one.
                }
                Step::UseFailed { n, on } => {
                    if failed.is_empty() {
                        continue;
                    }
                    let on = stream(on);
                    let (handle, len) = failed[n % failed.len()].clone();
                    let before = launches(&h);
                    write(&mut h, &handle, vec![0xEE; len], on);
                    let written = h.server.flush(on);
                    let mut over: Vec<&Handle> = live.iter().map(|(h, _)| h).take(1).collect();
                    over.push(&handle);
                    launch(&mut h, &over, on);
                    let launched = h.server.flush(on);
                    let launched_kernels = launches(&h) - before;
                    let unread = read(&mut h, &handle, len, on);
                    let resource = h.server.get_resource(handle.binding(), on);
                    // What the uses did to the live buffers first, then what they returned.
                    for (handle, bytes) in &live {
                        let back = read(&mut h, handle, bytes.len(), handle.stream);
                        prop_assert!(
                            back.as_ref().ok() == Some(bytes),
                            "a use of a failed buffer changed a live one"
                        );
                    }
                    prop_assert!(written.is_err(), "a write of a failed buffer");
                    prop_assert!(launched.is_err(), "a launch over a failed buffer");
                    prop_assert_eq!(launched_kernels, 0);
                    prop_assert!(unread.is_err(), "a read of a failed buffer");
                    prop_assert!(resource.is_err(), "get_resource of a failed buffer");
                }
                Step::DropLive { n } => {
                    if !live.is_empty() {
                        live.remove(n % live.len());
                    }
                }
                Step::DropFailed { n } => {
                    if !failed.is_empty() {
                        failed.remove(n % failed.len());
                    }
                }
                Step::EmptyCache => h.server.memory_cleanup(stream(0)),
            }
            for (handle, bytes) in &live {
                let on = handle.stream;
                let back = read(&mut h, handle, bytes.len(), on);
                prop_assert!(
                    back.as_ref().ok() == Some(bytes),
                    "a live buffer changed: {:?}",
                    back.err()
                );
            }
        }
    }
}
