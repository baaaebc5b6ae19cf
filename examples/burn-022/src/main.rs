//! Burn 0.22.1's stock `Wgpu` backend with every tensor in the caching engine: installs the hook,
//! runs a matmul (checked against the CPU), and prints the engine's statistics as tensors live,
//! drop and CubeCL's memory cleanup empties the engine's cache.
//!
//! On a CPU: `VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json cargo run --release`.

use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
use burn_022_caching_hook::caching_alloc_engine::registry::{self, DeviceKey};
use burn_022_caching_hook::install_wgpu;

/// Each matrix is 2.25 MiB: above 1 MiB, so the engine's large pool holds it.
const N: usize = 768;

fn report(step: &str, device: &Device) -> (u64, u64, u64) {
    let numbers = match registry::engine(DeviceKey::new("wgpu", 0)) {
        Some(engine) => {
            let stats = engine.stats();
            (
                stats.memory_allocated(),
                stats.memory_reserved(),
                stats.num_device_alloc,
            )
        }
        None => (0, 0, 0),
    };
    println!(
        "{step:<26} engine: allocated {:>9} B, reserved {:>9} B, num_device_alloc {}",
        numbers.0, numbers.1, numbers.2
    );
    // CubeCL's own view (every stream; its staging and uniform buffers too).
    if let Some(usage) = device.memory_pool_usage() {
        println!(
            "{:<26} cubecl: {} allocs, {} B in use, {} B reserved",
            "", usage.number_allocs, usage.bytes_in_use, usage.bytes_reserved
        );
    }
    numbers
}

fn main() {
    let hook = install_wgpu(None).expect("BURN_CACHING_ALLOC_CONF is malformed");
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    report("installed", &device);

    let a: Vec<f32> = (0..N * N).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
    let b: Vec<f32> = (0..N * N).map(|i| ((i * 5) % 11) as f32 * 0.5).collect();
    let ta = Tensor::<2>::from_data(TensorData::new(a.clone(), [N, N]), &device);
    let tb = Tensor::<2>::from_data(TensorData::new(b.clone(), [N, N]), &device);
    let tc = ta.clone().matmul(tb.clone()) + 1.0;
    let got = tc.to_data();
    let got = got.as_slice::<f32>().expect("f32 data");
    let mut worst = 0f32;
    // Every 17th row and column: the debug build checks them in a moment.
    for i in (0..N).step_by(17) {
        for j in (0..N).step_by(17) {
            let want: f32 = (0..N).map(|k| a[i * N + k] * b[k * N + j]).sum::<f32>() + 1.0;
            worst = worst.max((got[i * N + j] - want).abs());
        }
    }
    println!("matmul {N}x{N}: largest error against the CPU {worst}");
    assert!(worst < 1e-2, "the matmul read wrong memory");
    let live = report("three tensors live", &device);
    assert!(
        live.0 >= 3 * (N * N * 4) as u64,
        "the tensors are in the engine"
    );

    drop((ta, tb, tc));
    device.sync().expect("sync");
    // CubeCL returns freed buffers at its next reservation: make one.
    let small = Tensor::<1>::from_data(TensorData::new(vec![1f32; 4], [4]), &device);
    let _ = small.to_data();
    let dropped = report("dropped, next reservation", &device);

    device.sync().expect("sync");
    device.memory_cleanup();
    let cleaned = report("memory_cleanup", &device);
    assert!(
        dropped.0 < live.0,
        "dropped tensors went back to the engine"
    );
    assert!(
        cleaned.1 < dropped.1,
        "memory_cleanup emptied the engine's cache"
    );

    if let Some(engine) = hook.engine(0) {
        println!("\n{}", engine.summary());
    }
}
