//! `BURN_CACHING_ALLOC_TRACE`: set before the device opens, it turns history recording on, and
//! `backend::write_trace(&device)` writes the engine's trace there as JSON.
#![cfg(feature = "wgpu")]

#[path = "support/lavapipe.rs"]
mod lavapipe;

use lavapipe::cpu_device;

use burn::tensor::Tensor;
use burn_caching_alloc::alloc::Trace;
use burn_caching_alloc::alloc::TraceEvent;
use burn_caching_alloc::backend::{self, CachingWgpu};

#[test]
fn trace_env_records_and_write_trace_writes_json() {
    let Some(device) = cpu_device() else {
        return;
    };
    let path = std::env::temp_dir().join(format!("caching-trace-{}.json", std::process::id()));
    // SAFETY: this test binary has one test, and nothing else reads the environment yet.
    unsafe { std::env::set_var("BURN_CACHING_ALLOC_TRACE", &path) };

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
