//! The harness: a `CachingServer` over the recording driver, its constructors and the
//! helpers the tests share.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use cubecl_common::device::DeviceId;
use cubecl_common::stream_id::StreamId;
use cubecl_runtime::server::{
    ComputeServer, CubeCount, ExecutionMode, Handle, KernelArguments, MetadataBindingInfo,
};
use parking_lot::Mutex;

use super::super::super::driver::MetadataLayout;
use super::super::CachingServer;
use super::recording::{NoKernel, Recording, Seen};
use crate::alloc::AllocatorConfig;
use crate::device::DeviceStream;
use crate::device::metered::{Meter, Metered};
use crate::device::sim::SimDevice;

pub(crate) struct Harness {
    pub(crate) server: CachingServer<Recording>,
    pub(super) meter: Meter,
    pub(crate) seen: Arc<Mutex<Seen>>,
}

pub(super) fn harness(layout: MetadataLayout, max_streams: usize) -> Harness {
    harness_on(SimDevice::new(1 << 30), layout, max_streams)
}

/// A server over a simulated device of `capacity` bytes.
pub(crate) fn harness_of(layout: MetadataLayout, max_streams: usize, capacity: u64) -> Harness {
    harness_on(SimDevice::new(capacity), layout, max_streams)
}

pub(crate) fn harness_on(device: SimDevice, layout: MetadataLayout, max_streams: usize) -> Harness {
    harness_configured(device, layout, max_streams, AllocatorConfig::default())
}

pub(super) fn harness_configured(
    device: SimDevice,
    layout: MetadataLayout,
    max_streams: usize,
    config: AllocatorConfig,
) -> Harness {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let memory = Metered::new(device);
    let meter = memory.meter();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let driver = Recording {
        memory: Some(memory),
        layout,
        seen: seen.clone(),
    };
    // A device id of its own per test: the registry keeps one engine per device.
    let device = DeviceId {
        type_id: 0xCA11,
        index_id: NEXT.fetch_add(1, Ordering::Relaxed),
    };
    let mut server = CachingServer::new(driver, device, config)
        .expect("every device serves the configuration")
        .with_max_streams(max_streams);
    // The tests' stream ids are made up and may equal the ids of real threads of other tests,
    // whose exits would be read as theirs: the harness hears no thread exits unless a test
    // asks (`listen_to_thread_exits`).
    server.streams.ignore_thread_exits();
    Harness {
        server,
        meter,
        seen,
    }
}

pub(crate) fn stream(value: u64) -> StreamId {
    StreamId { value }
}

impl Harness {
    pub(crate) fn buffer(&mut self, size: u64, on: StreamId) -> Handle {
        let handle = Handle::new(on, size);
        self.server
            .initialize_memory(handle.memory.clone(), size, on);
        handle
    }

    pub(super) fn launch(&mut self, buffers: &[&Handle], info: MetadataBindingInfo, on: StreamId) {
        self.issue_launch(buffers, info, on);
        self.server.flush(on).expect("the launch succeeded");
    }

    /// Issues a kernel over `buffers` on `on` without flushing: a failed launch stays queued
    /// on the stream as its error.
    pub(crate) fn issue_launch(
        &mut self,
        buffers: &[&Handle],
        info: MetadataBindingInfo,
        on: StreamId,
    ) {
        let args = KernelArguments {
            buffers: buffers.iter().map(|h| (*h).clone().binding()).collect(),
            info,
            tensor_maps: Vec::new(),
        };
        // SAFETY: the recording driver runs nothing.
        unsafe {
            self.server.launch(
                Box::new(NoKernel),
                CubeCount::Static(1, 1, 1),
                args,
                ExecutionMode::Checked,
                on,
            )
        };
    }

    pub(super) fn waits(&self) -> usize {
        self.seen.lock().waits
    }

    /// Where a buffer lives: its segment and offset.
    pub(crate) fn location(&mut self, handle: &Handle) -> (u64, u64) {
        let on = handle.stream;
        let resource = self
            .server
            .get_resource(handle.clone().binding(), on)
            .expect("a live buffer");
        (resource.resource().segment, resource.resource().offset)
    }

    /// The events recorded on `stream` so far, by id.
    pub(super) fn events_on(&self, stream: DeviceStream) -> Vec<u64> {
        let seen = self.seen.lock();
        (0..seen.event_streams.len() as u64)
            .filter(|id| seen.event_streams[*id as usize] == stream)
            .collect()
    }

    pub(crate) fn complete(&self, events: &[u64]) {
        self.seen.lock().completed.extend(events.iter().copied());
    }
}

pub(super) fn ne_bytes(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}
