//! `no_cuda_memory_caching`: a dropped tensor's memory goes back to the device, only after
//! its stream.

use cubecl_runtime::server::MetadataBindingInfo;

use super::super::super::driver::MetadataLayout;
use super::harness::{harness_configured, stream};
use crate::alloc::AllocatorConfig;
use crate::device::DeviceStream;
use crate::device::sim::SimDevice;

/// `no_cuda_memory_caching` through the server (PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`,
/// `forceUncachedAllocator`): CubeCL's exact-size reuse is bypassed as well, so a dropped
/// tensor's memory is neither handed to the next tensor of its size nor returned to the
/// device before an event on its stream, recorded at its free, has completed.
#[test]
fn without_caching_a_dropped_tensor_goes_back_to_the_device_only_after_its_stream() {
    let sim = SimDevice::new(1 << 30);
    let config = AllocatorConfig::parse("no_cuda_memory_caching:True").expect("parses");
    let mut h = harness_configured(sim.clone(), MetadataLayout::DriverBinding, 8, config);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let a = h.buffer(4096, stream(1));
    let first = h.location(&a);
    h.launch(&[&a], info(), stream(1));
    assert_eq!(h.meter.allocs(), 1);
    drop(a);
    // The next tensor of the same size: a device allocation of its own. The dropped one went
    // to the engine at this reservation; its stream's event has not completed.
    let b = h.buffer(4096, stream(1));
    assert_ne!(h.location(&b), first);
    assert_eq!((h.meter.allocs(), h.meter.frees()), (2, 0));
    let stats = h.server.allocator().stats();
    assert_eq!(stats.allocated_bytes.all.current, 4096);
    assert_eq!(
        stats.active_bytes.all.current,
        2 * 4096,
        "pending until its stream is done"
    );
    assert_eq!(stats.reserved_bytes.all.current, 2 * 4096);
    // Its stream's work done: the next request returns it.
    sim.complete_events(DeviceStream(1));
    let c = h.buffer(512, stream(1));
    assert_eq!((h.meter.allocs(), h.meter.frees()), (3, 1));
    let stats = h.server.allocator().stats();
    assert_eq!(stats.reserved_bytes.all.current, 4096 + 512);
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(
        sim.counters().events_synchronized,
        0,
        "nothing waited on the host"
    );
    drop((b, c));
}
