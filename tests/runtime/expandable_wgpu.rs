//! `expandable_segments:True` on wgpu: wgpu has no virtual memory, so opening the device with
//! it set is a configuration error that names the key, not a silent fallback. The variable is
//! read when the device first opens, so the scenario runs in a child process of this binary.

use std::ffi::OsStr;

use burn::tensor::Tensor;
use burn_caching_alloc::backend::CachingWgpu;

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;

#[test]
fn expandable_segments_are_refused_when_the_wgpu_device_opens() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let test = "expandable_wgpu::expandable_segments_are_refused_when_the_wgpu_device_opens";
    let conf = OsStr::new("expandable_segments:True");
    if !in_child(test, &[("BURN_CACHING_ALLOC_CONF", Some(conf))]) {
        return;
    }
    // CubeCL opens the device on a thread of its own: its panic reaches this thread only as
    // a dropped channel, so the hook keeps every panic message of the process.
    let messages = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = messages.clone();
    std::panic::set_hook(Box::new(move |info| {
        seen.lock().unwrap().push(info.to_string());
    }));
    let opened = std::panic::catch_unwind(|| Tensor::<CachingWgpu, 1>::ones([4], &device));
    let _ = std::panic::take_hook();
    assert!(
        opened.is_err(),
        "the device must not open with expandable segments"
    );
    let messages = messages.lock().unwrap();
    assert!(
        messages
            .iter()
            .any(|m| m.contains("expandable_segments") && m.contains("virtual memory")),
        "the error names the key and why: {messages:?}"
    );
}
