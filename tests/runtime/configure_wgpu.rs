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
use burn_caching_alloc::alloc::{AllocatorConfig, ConfigError, PoolKind};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused, ConfigureError};

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

/// `backend::set_allocator_settings` on an open device changes the next placement: a 20 MiB
/// tensor splits a cached 40 MiB block under the default (unlimited) `max_split_size`, and
/// after `max_split_size_mb:32` it takes a segment of its own (PyTorch's `get_free_block`:
/// a request under the limit never takes a block at or above it). `allocator_settings` says
/// what is in force; a key wgpu cannot serve is refused and changes nothing.
#[test]
fn a_settings_change_on_an_open_device_changes_the_next_layout() {
    let Some((cpu, _turn)) = cpu_device() else {
        return;
    };
    let test = "configure_wgpu::a_settings_change_on_an_open_device_changes_the_next_layout";
    if !in_child(test, &[(CONF, Some(OsStr::new("pool_borrowing:false")))]) {
        return;
    }
    // Unfused: each tensor is allocated when it is made (a fused `ones` that nothing reads
    // is never executed).
    const FLOATS_PER_MIB: usize = (MIB / 4) as usize;
    // Large-pool segments: (total size, allocated size), by address.
    let large_segments = |device: &WgpuDevice| -> Vec<(u64, u64)> {
        backend::memory_snapshot(device)
            .segments
            .iter()
            .filter(|s| s.pool == PoolKind::Large)
            .map(|s| (s.total_size, s.allocated_size))
            .collect()
    };
    let big = Tensor::<CachingWgpuUnfused, 1>::ones([40 * FLOATS_PER_MIB], &cpu);
    drop(big);
    assert_eq!(large_segments(&cpu), vec![(40 * MIB, 0)]);

    let before = Tensor::<CachingWgpuUnfused, 1>::ones([20 * FLOATS_PER_MIB], &cpu);
    assert_eq!(large_segments(&cpu), vec![(40 * MIB, 20 * MIB)], "split");
    drop(before);
    assert_eq!(large_segments(&cpu), vec![(40 * MIB, 0)]);

    assert_eq!(backend::allocator_settings(&cpu).max_split_size, None);
    backend::set_allocator_settings(&cpu, "max_split_size_mb:32").expect("a key that changes");
    assert_eq!(
        backend::allocator_settings(&cpu).max_split_size,
        Some(32 * MIB)
    );
    assert!(!backend::allocator_settings(&cpu).pool_borrowing, "kept");
    // 18 MiB, a size CubeCL's pool does not hold: the stream walks first (a new large size),
    // the 40 MiB segment is whole and free again, and at or over 32 MiB it is an oversize
    // block a smaller request may not split.
    let after = Tensor::<CachingWgpuUnfused, 1>::ones([18 * FLOATS_PER_MIB], &cpu);
    let mut layout = large_segments(&cpu);
    layout.sort();
    assert_eq!(
        layout,
        vec![(18 * MIB, 18 * MIB), (40 * MIB, 0)],
        "a segment of its own"
    );
    assert_eq!(max_split_size(&cpu), 32 * MIB as i64);
    assert_eq!(
        backend::memory_stats(&cpu).engine.oversize_segments.current,
        1
    );

    let err = backend::set_allocator_settings(&cpu, "expandable_segments:True").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Unsupported { key, .. } if key == "expandable_segments"),
        "{err}"
    );
    assert!(!backend::allocator_settings(&cpu).expandable_segments);
    drop(after);
    backend::empty_cache(&cpu);
}
