//! The side-by-side benchmark end to end, tiny: the MNIST MLP for 2 steps on lavapipe (or any
//! wgpu adapter), unfused, caching against Burn's stock `CubeBackend<WgpuRuntime>`. Without an
//! adapter it skips with a message, except under `CI` where that is a failure.

use burn::backend::Autodiff;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_caching_alloc::backend::CachingWgpuUnfused;

use bench_burn::{CachingReading, CompareOptions, Report, StockReading, Workload, compare};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

#[test]
fn two_mlp_steps_side_by_side_see_the_same_losses_and_read_both_pools() {
    let device = WgpuDevice::DefaultDevice;
    if !burn_caching_alloc::wgpu::adapter_available(&device) {
        assert!(!in_ci(), "no wgpu adapter; CI is set, so this is a failure");
        eprintln!("skipped: no wgpu adapter (install Mesa's lavapipe)");
        return;
    }
    let options = CompareOptions {
        steps: 2,
        warmup: 1,
        ..CompareOptions::default()
    };
    let caching = CachingReading::new(device.clone());
    let stock = StockReading::<WgpuRuntime>::new(device.clone());
    let result =
        compare::<Autodiff<CachingWgpuUnfused>, Autodiff<CubeBackend<WgpuRuntime, f32, i32, u32>>>(
            Workload::MnistMlp,
            "unfused",
            &options,
            ("CachingWgpuUnfused", &device, &caching),
            ("CubeBackend<WgpuRuntime>", &device, &stock),
        )
        .expect("both sides train");

    for side in [&result.caching, &result.stock] {
        assert_eq!(side.step_seconds.len(), 2, "{}", side.backend);
        assert_eq!(side.reserved_after_step.len(), 2, "{}", side.backend);
        assert!(
            side.reserved_after_step.iter().all(|&r| r > 0),
            "{}: a step ran with nothing reserved: {:?}",
            side.backend,
            side.reserved_after_step
        );
        assert_eq!(
            side.peak_reserved_sampled,
            *side.reserved_after_step.iter().max().unwrap()
        );
    }
    // Same seed, same batches: the same model sees the same losses on both backends.
    for (c, s) in result.caching.losses.iter().zip(&result.stock.losses) {
        assert!((c - s).abs() < 1e-4, "losses differ: {c} vs {s}");
    }
    // The engine's own peak can be missed by no sample.
    let exact = result
        .caching
        .exact_peak_reserved
        .expect("the engine keeps a peak");
    assert!(exact >= result.caching.peak_reserved_sampled);
    assert_eq!(result.stock.exact_peak_reserved, None);
    assert_eq!(
        result.reserved_ratio,
        result.caching.peak_reserved_sampled as f64 / result.stock.peak_reserved_sampled as f64
    );

    let report = Report {
        device: "wgpu".into(),
        steps: 2,
        warmup: 1,
        seed: options.seed,
        results: vec![result],
    };
    let json = serde_json::to_string(&report).unwrap();
    assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), report);
    let table = bench_burn::markdown_table(&report.results);
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(table.contains("| mnist-mlp | unfused |"), "{table}");
}
