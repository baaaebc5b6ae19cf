//! `BURN_CACHING_ALLOC_TRACE`: set before the device opens, it turns history recording on, and
//! `backend::write_trace(&device)` writes the engine's trace there as JSON.
//!
//! The variable is read when a device first opens, and the other wgpu tests of this binary
//! open the same device without it (which they must: it also changes how the server hands
//! slices back). So the test runs its scenario in a child process of this binary, with the
//! variable set from the start.

use std::ffi::OsStr;
use std::path::PathBuf;

use burn::tensor::Tensor;
use burn_caching_alloc::alloc::{Trace, TraceEvent};
use burn_caching_alloc::backend::{self, CachingWgpu};

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;

const TRACE: &str = burn_caching_alloc::runtime::TRACE_ENV;

#[test]
fn trace_env_records_and_write_trace_writes_json() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let path = std::env::temp_dir().join(format!("caching-trace-{}.json", std::process::id()));
    let test = "trace_wgpu::trace_env_records_and_write_trace_writes_json";
    if !in_child(test, &[(TRACE, Some(OsStr::new(&path)))]) {
        return;
    }
    // In the child: the variable was set before anything ran.
    let path = PathBuf::from(std::env::var_os(TRACE).expect("the parent set the trace path"));

    let a = Tensor::<CachingWgpu, 1>::ones([4096], &device);
    let b = (a.clone() * 2.0).sum();
    assert_eq!(b.into_data().to_vec::<f32>().expect("f32"), vec![8192.0]);
    drop(a);
    backend::empty_cache(&device);

    let written = backend::write_trace(&device).expect("trace written");
    assert_eq!(written, path);
    let trace: Trace =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("trace JSON");
    let mallocs = trace
        .events
        .iter()
        .filter(|e| matches!(e, TraceEvent::Malloc { .. }))
        .count();
    assert!(mallocs >= 2, "{:?}", trace.events);
    assert!(
        trace
            .events
            .iter()
            .any(|e| matches!(e, TraceEvent::SegmentFree { .. })),
        "empty_cache freed the segment: {:?}",
        trace.events
    );
    let _ = std::fs::remove_file(&path);
}
