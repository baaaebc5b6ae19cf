//! The engine's statistics follow the tensors of Burn 0.22.1's stock `Wgpu` backend: live
//! tensors are allocated bytes, dropped ones go back at CubeCL's next reservation, the peak
//! remembers them, a snapshot pickle loads in Python, and `memory_cleanup` empties the cache.
//!
//! Its own process (the hook is process-wide and must precede the first device use).
//! On a CPU: `VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json cargo test --test engine_stats_hook -- --nocapture`

use std::process::Command;

use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
use burn_022_caching_hook::caching_alloc_engine::alloc::{AllocatorConfig, MemoryStats};
use burn_022_caching_hook::install_wgpu;

/// Each tensor is 768 x 768 f32: 2.25 MiB, in the engine's large pool.
const N: usize = 768;
const TENSOR_BYTES: u64 = (N * N * 4) as u64;
const TENSORS: u64 = 3;

fn show(step: &str, stats: &MemoryStats) {
    println!(
        "{step:<28} allocated {:>9} B, reserved {:>9} B, peak allocated {:>9} B, device allocs {}, frees {}",
        stats.memory_allocated(),
        stats.memory_reserved(),
        stats.max_memory_allocated(),
        stats.num_device_alloc,
        stats.num_device_free
    );
}

/// A fresh 4-element reservation, read back: CubeCL returns buffers freed since its last
/// reservation (Dedicated mode) when it makes the next.
fn small_reservation(device: &Device) {
    let small = Tensor::<1>::from_data(TensorData::new(vec![1f32; 4], [4]), device);
    assert_eq!(small.to_data().as_slice::<f32>().unwrap(), &[1.0; 4]);
}

/// Loads `path` with Python's pickle and checks the keys PyTorch's memory viewer reads.
/// `Err` with the reason when Python cannot be run.
fn python_loads(path: &std::path::Path) -> Result<(), String> {
    let check = "import pickle,sys; d=pickle.load(open(sys.argv[1],'rb')); \
                 assert 'segments' in d and 'device_traces' in d, sorted(d)";
    match Command::new("python3")
        .arg("-c")
        .arg(check)
        .arg(path)
        .output()
    {
        Ok(output) => {
            assert!(
                output.status.success(),
                "python3 could not load the snapshot {}: {}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            Ok(())
        }
        Err(err) => Err(format!("python3 cannot be run: {err}")),
    }
}

#[test]
fn engine_statistics_follow_the_tensors() {
    let hook = install_wgpu(Some(AllocatorConfig::default())).expect("install the hook");
    let device = Device::wgpu(DeviceKind::DefaultDevice);

    // The first reservation creates the device's engine.
    small_reservation(&device);
    device.sync().expect("sync");
    let engine = hook.engine(0).expect("the device's engine");
    let before = engine.stats();
    show("warm", &before);

    // Three tensors of known size, live.
    let tensors: Vec<Tensor<2>> = (0..TENSORS as usize)
        .map(|t| {
            let values: Vec<f32> = (0..N * N).map(|i| ((i + t) % 251) as f32).collect();
            Tensor::<2>::from_data(TensorData::new(values, [N, N]), &device)
        })
        .collect();
    for (t, tensor) in tensors.iter().enumerate() {
        let data = tensor.to_data();
        let data = data.as_slice::<f32>().unwrap();
        assert_eq!(
            (data[0], data[N * N - 1]),
            (t as f32, ((N * N - 1 + t) % 251) as f32)
        );
    }
    device.sync().expect("sync");
    let live = engine.stats();
    show("three tensors live", &live);
    let live_bytes = TENSORS * TENSOR_BYTES;
    // (The warm-up tensor, dropped, went back at the first of these reservations.)
    assert!(
        live.memory_allocated() >= live_bytes,
        "allocated {} B with {live_bytes} B of tensors live",
        live.memory_allocated()
    );
    assert!(live.max_memory_allocated() >= live.memory_allocated());
    assert!(live.memory_reserved() >= live.memory_allocated());

    // Dropped, synchronized, and one new reservation: the three go back to the engine.
    drop(tensors);
    device.sync().expect("sync");
    small_reservation(&device);
    device.sync().expect("sync");
    let dropped = engine.stats();
    show("dropped, next reservation", &dropped);
    // Down by the three tensors, up by the new small reservation (as large as the warm-up's).
    let small = before.memory_allocated();
    assert!(
        dropped.memory_allocated() + live_bytes <= live.memory_allocated() + small,
        "allocated went from {} B to {} B; {live_bytes} B of tensors were dropped and {small} B reserved",
        live.memory_allocated(),
        dropped.memory_allocated()
    );
    assert!(
        dropped.max_memory_allocated() >= live_bytes,
        "the peak {} B forgot the {live_bytes} B that were live",
        dropped.max_memory_allocated()
    );
    assert!(dropped.max_memory_allocated() >= live.memory_allocated());
    assert!(dropped.memory_reserved() >= dropped.memory_allocated());
    assert!(
        dropped.memory_reserved() > dropped.memory_allocated(),
        "the freed blocks stay cached in the engine"
    );

    // A snapshot PyTorch's tools read.
    let path = std::env::temp_dir().join(format!(
        "burn022-engine-stats-{}.pickle",
        std::process::id()
    ));
    engine.dump_snapshot(&path).expect("dump_snapshot");
    let size = std::fs::metadata(&path).expect("the snapshot file").len();
    println!("snapshot: {} ({size} B)", path.display());
    assert!(size > 0);
    match python_loads(&path) {
        Ok(()) => println!("snapshot: python3's pickle loads it, with segments and device_traces"),
        Err(reason) if std::env::var_os("CI").is_some() => {
            let _ = std::fs::remove_file(&path);
            panic!("CI is set and the snapshot check cannot run: {reason}");
        }
        Err(reason) => println!("snapshot: pickle check skipped: {reason}"),
    }
    let _ = std::fs::remove_file(&path);

    // CubeCL's cleanup reaches the engine's empty_cache.
    device.sync().expect("sync");
    device.memory_cleanup();
    let cleaned = engine.stats();
    show("memory_cleanup", &cleaned);
    assert!(
        cleaned.memory_reserved() < dropped.memory_reserved(),
        "memory_cleanup left reserved at {} B (was {} B)",
        cleaned.memory_reserved(),
        dropped.memory_reserved()
    );
    assert!(cleaned.num_device_free > dropped.num_device_free);
    assert!(cleaned.memory_reserved() >= cleaned.memory_allocated());
    println!("\n{}", engine.summary());
}
