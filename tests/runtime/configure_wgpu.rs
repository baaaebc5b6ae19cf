//! `backend::configure`: a configuration in code for a device before its first use, per
//! device, before `BURN_CACHING_ALLOC_CONF`; refused with a typed error once the device is open.
//!
//! lavapipe offers two wgpu devices with servers of their own: `WgpuDevice::Cpu` (device id
//! 3:0) and `WgpuDevice::DefaultDevice` (4:0, the adapter wgpu picks, lavapipe here). Each
//! scenario runs in a child process of this binary: a device's configuration is fixed when it
//! first opens, and the other tests of this binary open `Cpu` with the defaults.

use std::ffi::OsStr;

use crate::MIB;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::Tensor;
use burn_caching_alloc::alloc::{AllocatorConfig, ConfigError};
use burn_caching_alloc::backend::{self, CachingWgpu, ConfigureError};

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;

const CONF: &str = burn_caching_alloc::alloc::CONFIG_ENV;

fn config(text: &str) -> AllocatorConfig {
    AllocatorConfig::parse(text).expect("a valid configuration")
}

/// The `max_split_size` the device's engine runs with (PyTorch's stat, -1 when unlimited).
fn max_split_size(device: &WgpuDevice) -> i64 {
    backend::memory_stats(device).engine.max_split_size
}

#[test]
fn two_devices_take_their_own_configuration_and_an_open_device_refuses_one() {
    let Some((cpu, _turn)) = cpu_device() else {
        return;
    };
    let test =
        "configure_wgpu::two_devices_take_their_own_configuration_and_an_open_device_refuses_one";
    if !in_child(test, &[(CONF, None)]) {
        return;
    }
    let default = WgpuDevice::DefaultDevice;
    backend::configure(&cpu, config("max_split_size_mb:64")).expect("cpu not open yet");
    // A second call before the device opens replaces the first.
    backend::configure(&default, config("max_split_size_mb:200")).expect("not open yet");
    backend::configure(
        &default,
        config("max_split_size_mb:128,garbage_collection_threshold:0.5"),
    )
    .expect("not open yet");

    // Both devices compute, each with its own engine.
    let a = Tensor::<CachingWgpu, 1>::ones([1024], &cpu);
    let b = Tensor::<CachingWgpu, 1>::ones([1024], &default);
    assert_eq!(a.sum().into_scalar(), 1024.0);
    assert_eq!(b.sum().into_scalar(), 1024.0);
    assert_eq!(max_split_size(&cpu), 64 * MIB as i64);
    assert_eq!(max_split_size(&default), 128 * MIB as i64);
    let snapshot = backend::memory_snapshot(&default);
    assert_eq!(snapshot.config.garbage_collection_threshold, Some(0.5));
    assert_eq!(
        backend::memory_snapshot(&cpu)
            .config
            .garbage_collection_threshold,
        None
    );

    // Open now: configuring again is an error, and the configuration in force stays.
    let err = backend::configure(&cpu, config("max_split_size_mb:32")).unwrap_err();
    assert!(matches!(err, ConfigureError::AlreadyOpen { .. }), "{err}");
    assert!(err.to_string().contains("already open"), "{err}");
    assert_eq!(max_split_size(&cpu), 64 * MIB as i64);
}

#[test]
fn configure_comes_before_the_environment_variable() {
    let Some((cpu, _turn)) = cpu_device() else {
        return;
    };
    let test = "configure_wgpu::configure_comes_before_the_environment_variable";
    if !in_child(test, &[(CONF, Some(OsStr::new("max_split_size_mb:48")))]) {
        return;
    }
    backend::configure(&cpu, config("max_split_size_mb:96")).expect("cpu not open yet");
    // Configured in code: the variable is not used.
    assert_eq!(max_split_size(&cpu), 96 * MIB as i64);
    // Not configured: the variable is.
    assert_eq!(max_split_size(&WgpuDevice::DefaultDevice), 48 * MIB as i64);
}

#[test]
fn an_invalid_configuration_is_refused_before_the_device_opens() {
    // No device is opened: the refusal is the configuration's, so any device id will do.
    let device = WgpuDevice::VirtualGpu(7);
    let expandable = config("expandable_segments:True");
    let err = backend::configure(&device, expandable).unwrap_err();
    assert!(
        matches!(
            &err,
            ConfigureError::Invalid { source: ConfigError::Unsupported { key, .. }, .. }
                if key == "expandable_segments"
        ),
        "{err}"
    );
    let mut fraction = AllocatorConfig::default();
    fraction.memory_fraction = Some(1.5);
    let err = backend::configure(&device, fraction).unwrap_err();
    assert!(
        matches!(
            &err,
            ConfigureError::Invalid { source: ConfigError::InvalidValue { key, .. }, .. }
                if key == "per_process_memory_fraction"
        ),
        "{err}"
    );
}
