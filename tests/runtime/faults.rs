//! Issue 20 points 4 and 5 at the runtime layer, on the simulated device: dropping a stream's
//! memory (CubeCL's manager over `EngineStorage`, as a dropped server drops it) returns its
//! blocks to the engine, and an engine poisoned by a panic refuses CubeCL's requests with
//! the reason instead of serving them from half-updated structures.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::MIB;
use burn_caching_alloc::device::DeviceStream;
use burn_caching_alloc::device::sim::SimCall;
use burn_caching_alloc::runtime::{EngineStorage, StreamMemory};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::ComputeStorage;

use crate::storage::{engine, props};

const STREAM: DeviceStream = DeviceStream(3);

/// `EngineStorage` had no `Drop`: its blocks stayed allocated in the engine for good.
#[test]
fn a_dropped_storage_returns_its_blocks_to_the_engine() {
    let (device, allocator) = engine(1 << 30);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);
    for size in [1000, 3 * MIB, 64 * MIB] {
        storage.alloc(size).expect("alloc");
    }
    assert_eq!(allocator.stats().allocation.all.current, 3);
    drop(storage);
    let stats = allocator.stats();
    assert_eq!(stats.allocation.all.current, 0);
    assert_eq!(stats.allocated_bytes.all.current, 0);
    // Now cached, so `empty_cache` gives every segment back to the device.
    allocator.empty_cache().unwrap();
    assert_eq!(device.live_segments(), vec![]);
}

/// The same through CubeCL's persistent manager, with live handles still held: the stream's
/// memory dies whole (a dropped server drops every stream's).
#[test]
fn a_dropped_stream_memory_returns_its_blocks_live_or_free() {
    let (device, allocator) = engine(1 << 30);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    let live = memory.reserve(4 * MIB).expect("reserve");
    let dropped = memory.reserve(8 * MIB).expect("reserve");
    drop(dropped);
    assert_eq!(allocator.stats().allocation.all.current, 2);
    drop(memory);
    assert_eq!(allocator.stats().allocation.all.current, 0);
    allocator.empty_cache().unwrap();
    assert_eq!(device.bytes_in_use(), 0);
    drop(live);
}

/// A device panic in the middle of an engine `malloc` (CubeCL would catch it in the server's
/// task): the storage's next `alloc` is refused with the reason, and nothing more is
/// allocated on the device.
#[test]
fn after_a_panic_the_storage_refuses_with_the_reason() {
    let (device, allocator) = engine(1 << 30);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);
    device.panic_next(SimCall::Allocate);
    assert!(catch_unwind(AssertUnwindSafe(|| storage.alloc(1000))).is_err());
    let err = storage.alloc(1000).expect_err("poisoned");
    match err {
        IoError::Unknown { description, .. } => {
            assert!(description.contains("`malloc` panicked"), "{description}")
        }
        other => panic!("expected the engine's reason, got {other:?}"),
    }
    assert_eq!(device.counters().allocs, 0);
    assert!(allocator.poisoned().is_some());
}
