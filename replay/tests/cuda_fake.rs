//! `replay --device cuda` under the fake CUDA driver (`fake-cuda/`): the replay's CUDA device
//! (`CudaReplayDevice`, a `CudaMemory` per pass) runs every allocator on a small trace with the
//! numbers the simulated device gives, the binary's `--device cuda` path runs end to end, and
//! the fake logs no broken driver contract and holds nothing afterwards.
//!
//! The binary re-executes itself before `main` with the fake on the library path (the library's
//! `tests/support/fake_cuda.rs`). Without the fake built (`cargo build -p fake-cuda`) the tests
//! skip with the reason; with `CI` set they fail.
#![cfg(feature = "cuda")]

#[path = "../../tests/support/fake_cuda.rs"]
mod fake_cuda;

use replay::devices::CudaReplayDevice;
use replay::{
    AllocatorKind, MeasureOptions, Program, ReplayDevice, SimReplayDevice, builtin_trace,
    measure_on,
};

/// One fake device of 4 GiB with virtual memory on CUDA's 2 MiB granularity (the simulated
/// device's).
// SAFETY (`unsafe` in the attribute): runs before `main`, where std is set up on Linux; it
// reads the environment, creates a folder and links, and re-executes this binary.
#[ctor::ctor(unsafe)]
fn under_the_fake() {
    fake_cuda::start(&[
        ("FAKE_CUDA_DEVICES", "1"),
        ("FAKE_CUDA_MEMORY", "4G"),
        ("FAKE_CUDA_VMM", "1"),
        ("FAKE_CUDA_GRANULARITY", "2M"),
        ("FAKE_CUDA_SCHEDULE", "random"),
    ]);
}

/// The tests share the fake's device 0 and read its totals: one at a time.
static DEVICE_0: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Nothing held on the fake's device and no contract broken (on the fake only).
fn finish(driver: &fake_cuda::Driver) {
    if let Some(fake) = driver.fake() {
        fake.assert_no_violations();
        let live = fake.live(0);
        assert_eq!(
            (live.allocated, live.created, live.reserved_ranges),
            (0, 0, 0),
            "left on the fake: {:?}",
            fake.leaks()
        );
    }
}

#[test]
fn every_allocator_replays_on_cuda_with_the_simulated_devices_numbers() {
    let Some(driver) = fake_cuda::fake_or_skip() else {
        return;
    };
    let _turn = DEVICE_0.lock();
    let name = "mlp-mnist";
    let trace = builtin_trace(name).expect("a built-in trace");
    let program = Program::compile(&trace).expect("the trace compiles");
    {
        let cuda = CudaReplayDevice::new(0).expect("the fake's device 0 opens");
        let sim = SimReplayDevice::new(cuda.capacity());
        for config in ["", "expandable_segments:true"] {
            let options = MeasureOptions::new(1)
                .with_config(config)
                .expect("the engine accepts it");
            for kind in AllocatorKind::ALL {
                let on_cuda = measure_on(&cuda, name, &program, kind, &options)
                    .unwrap_or_else(|err| panic!("{kind:?} {config:?} on CUDA: {err}"));
                let on_sim = measure_on(&sim, name, &program, kind, &options)
                    .unwrap_or_else(|err| panic!("{kind:?} {config:?} simulated: {err}"));
                let numbers = |m: &replay::Measurement| {
                    (
                        m.peak_allocated,
                        m.peak_reserved,
                        m.device_allocs,
                        m.device_frees,
                        m.ooms,
                    )
                };
                assert!(on_cuda.peak_reserved > 0, "{kind:?} {config:?}");
                assert_eq!(
                    numbers(&on_cuda),
                    numbers(&on_sim),
                    "{kind:?} {config:?}: (peak allocated, peak reserved, device allocs, frees, \
                     OOMs) on CUDA and simulated"
                );
                assert_eq!(on_cuda.reserved_curve, on_sim.reserved_curve, "{kind:?}");
            }
        }
    }
    finish(&driver);
}

#[test]
fn the_binary_replays_a_trace_with_device_cuda() {
    let Some(driver) = fake_cuda::fake_or_skip() else {
        return;
    };
    let _turn = DEVICE_0.lock();
    let dir = std::env::temp_dir().join(format!("replay-cuda-fake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let json = dir.join("results.json");
    // The child inherits the library path this process was re-executed with: the same fake.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_replay"))
        .args(["--device", "cuda", "--runs", "1", "mlp-mnist", "--json"])
        .arg(&json)
        .output()
        .expect("the replay binary starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "replay --device cuda failed:\n{stdout}\n{stderr}"
    );
    // The report names the device it ran on (on stderr, with the progress notes).
    assert!(
        stdout.contains("CUDA device 0") || stderr.contains("CUDA device 0"),
        "{stdout}\n{stderr}"
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON was written"))
            .expect("JSON");
    // Four allocators; the two engine ones under both default configurations.
    assert_eq!(rows.len(), 6, "{rows:#?}");
    for row in &rows {
        assert_eq!(row["trace"], "mlp-mnist");
        assert!(
            row["peak_reserved"].as_u64().is_some_and(|b| b > 0),
            "{row}"
        );
        assert_eq!(row["ooms"], 0, "{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    // The child's fake kept its own log (and reports leaks at its exit, to its stderr).
    assert!(!stderr.contains("violation"), "{stderr}");
    finish(&driver);
}
