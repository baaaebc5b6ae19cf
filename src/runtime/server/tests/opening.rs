//! Opening a device the way CubeCL does, and what every operation then looks up: handle
//! offsets and existing streams.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use cubecl_common::device::DeviceId;
use cubecl_runtime::server::{ComputeServer, ServerError};
use parking_lot::Mutex;

use super::super::super::driver::MetadataLayout;
use super::super::super::error::DriverError;
use super::super::CachingServer;
use super::harness::{harness, stream};
use super::recording::{NEXT_OPENED, Recording, Seen};
use crate::alloc::AllocatorConfig;
use crate::device::metered::Metered;
use crate::device::sim::SimDevice;

/// A device id of its own for a test that opens a server the way CubeCL does
/// (`DeviceService::init`): the registry keeps one engine and one configuration per device.
fn opened_device() -> DeviceId {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    DeviceId {
        type_id: 0xCA12,
        index_id: NEXT.fetch_add(1, Ordering::Relaxed),
    }
}

/// A recording driver over `device` for `Recording::open` to hand out on this thread.
fn next_opened(device: SimDevice) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let driver = Recording {
        memory: Some(Metered::new(device)),
        layout: MetadataLayout::DriverBinding,
        seen: seen.clone(),
    };
    NEXT_OPENED.with(|next| *next.borrow_mut() = Some(driver));
    seen
}

/// Issue 19 item 3: `init` opened the device memory once to read the virtual-memory
/// granularity and again for the engine (on CUDA a second `CudaMemory`, with an event pool
/// of its own), against `Driver::memory`'s "called once per server".
#[test]
fn opening_a_device_opens_its_memory_once() {
    let device = opened_device();
    let seen = next_opened(SimDevice::new(1 << 30));
    let server = CachingServer::<Recording>::open(device).expect("the device opens");
    assert_eq!(seen.lock().memory_opened, 1);
    assert_eq!(server.allocator().memory_reserved(), 0);

    // A configuration given in code that asks for expandable segments, on a device with
    // virtual memory: still one opening.
    let device = opened_device();
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    assert!(super::registry::configure::<Metered<SimDevice>>(
        device,
        expandable.clone()
    ));
    let seen = next_opened(SimDevice::new(1 << 30));
    let server = CachingServer::<Recording>::open(device).expect("the device opens");
    assert_eq!(seen.lock().memory_opened, 1);
    assert_eq!(server.allocator().config(), expandable);
}

/// Issue 19 item 3: one policy for a missing capability. The server refused expandable
/// segments on a device without virtual memory (a panic at `init`) while the engine warned and
/// served ordinary segments; both now refuse with the engine's `ConfigError::Unsupported`.
#[test]
fn expandable_segments_without_virtual_memory_are_refused_by_the_engine_and_the_server() {
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let engine_err = crate::alloc::CachingAllocator::new(
        SimDevice::new(1 << 30).without_virtual_memory(),
        expandable.clone(),
    )
    .err()
    .expect("refused");
    assert!(
        matches!(&engine_err, crate::alloc::ConfigError::Unsupported { key, .. } if key == "expandable_segments"),
        "{engine_err:?}"
    );

    // The server over such a device: the same error, from one opening of its memory.
    let device = opened_device();
    assert!(super::registry::configure::<Metered<SimDevice>>(
        device, expandable
    ));
    let seen = next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    let err = CachingServer::<Recording>::open(device).expect_err("refused");
    assert_eq!(
        err,
        DriverError::Config {
            var: "backend::configure",
            source: engine_err,
        }
    );
    assert_eq!(seen.lock().memory_opened, 1);

    // The same device serves every configuration that needs no virtual memory.
    let device = opened_device();
    next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    assert!(CachingServer::<Recording>::open(device).is_ok());
}

/// Issue 33: a device that could not open panicked on CubeCL's device thread, and the caller
/// saw only `RecvError`. `open::ensure_open` (behind `Runtime::client` and `backend::open`)
/// opens on the caller's thread and returns the reason, the same one on every later call
/// without trying again; a device that opens is then served by CubeCL's device thread.
#[test]
fn a_device_that_cannot_open_tells_the_caller_why_on_every_try() {
    use super::super::super::open::ensure_open;
    use super::super::super::registry::{self, OpenState};
    use cubecl_common::device_handle::DeviceHandle;

    let device = opened_device();
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    assert!(registry::configure::<Metered<SimDevice>>(
        device, expandable
    ));
    next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    let err = ensure_open::<Recording>(device).expect_err("refused");
    assert!(
        matches!(
            &err,
            DriverError::Config { var: "backend::configure", source }
                if source.to_string().contains("expandable_segments")
        ),
        "{err:?}"
    );
    // Again: the same error, and the device is not opened a second time (the driver left for
    // a second opening stays where it was put).
    let second = next_opened(SimDevice::new(1 << 30));
    assert_eq!(ensure_open::<Recording>(device), Err(err.clone()));
    assert_eq!(
        registry::open_state::<Metered<SimDevice>>(device),
        OpenState::Failed(err)
    );
    assert_eq!(second.lock().memory_opened, 0);

    // A device that opens (with the driver left above): registered, and its server is the one
    // CubeCL's device thread runs.
    let device = opened_device();
    ensure_open::<Recording>(device).expect("the device opens");
    assert_eq!(second.lock().memory_opened, 1);
    assert_eq!(
        registry::open_state::<Metered<SimDevice>>(device),
        OpenState::Opened
    );
    let handle = DeviceHandle::<CachingServer<Recording>>::new(device);
    let engine = handle
        .submit_blocking(|server| Arc::as_ptr(server.allocator()) as usize)
        .expect("the device thread answers");
    let registered = registry::lookup::<Metered<SimDevice>>(device).expect("registered");
    assert_eq!(engine, Arc::as_ptr(&registered.allocator) as usize);
    // Opening an open device does nothing.
    assert_eq!(ensure_open::<Recording>(device), Ok(()));
}

/// Issue 33: CubeCL's `StorageHandle::offset_start`/`offset_end` subtract unchecked, so a
/// handle offset past its slice used to resolve outside the block (in a release build, 1 MiB
/// past a 1 KiB block with a size near 2^64; in a debug build, a panic inside CubeCL). The
/// server refuses it with an error; offsets inside the slice still resolve.
#[test]
fn handle_offsets_past_the_slice_are_an_error_not_a_resource_outside_the_block() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let on = stream(1);
    let small = h.buffer(1024, on);
    for (start, end) in [
        (Some(1u64 << 20), None),
        (None, Some(1025)),
        (Some(512), Some(513)),
    ] {
        let mut handle = small.clone();
        if let Some(start) = start {
            handle = handle.offset_start(start);
        }
        if let Some(end) = end {
            handle = handle.offset_end(end);
        }
        let err = h
            .server
            .get_resource(handle.binding(), on)
            .expect_err("offsets past the slice are refused");
        match err {
            ServerError::Io(cubecl_runtime::server::IoError::Unknown { description, .. }) => {
                assert!(
                    description.contains("outside its 1024-byte slice"),
                    "{description}"
                )
            }
            other => panic!("expected the offsets' error, got {other}"),
        }
    }
    let inside = h
        .server
        .get_resource(
            small.clone().offset_start(512).offset_end(256).binding(),
            on,
        )
        .expect("offsets inside the slice resolve");
    assert_eq!(inside.resource().size, 256);
    let whole = h.location(&small);
    assert_eq!(inside.resource().offset, whole.1 + 512);
}

/// Issue 33: `Streams::get_slot` asked the engine for its history options (taking the
/// engine's lock) on every stream lookup, which every operation makes. A lookup of an
/// existing stream now proceeds while another thread holds the engine's lock; only creating
/// a stream asks (its reclaim policy follows the recording).
#[test]
fn looking_up_an_existing_stream_takes_no_engine_lock() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let buffer = h.buffer(4096, stream(1));
    let allocator = h.server.allocator().clone();
    let held = allocator.hold_engine_lock();
    let (sender, received) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let server = &mut h.server;
        let cursor = server.streams.get(&mut server.driver, stream(1)).cursor;
        sender.send(cursor).expect("the test waits");
        h
    });
    let looked_up = received.recv_timeout(std::time::Duration::from_secs(20));
    drop(held);
    let h = worker
        .join()
        .expect("the lookup returns once the lock is free");
    assert!(looked_up.is_ok(), "the lookup waited for the engine's lock");
    drop(buffer);
    drop(h);
}
