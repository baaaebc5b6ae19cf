//! Issue 47, "reading memory must not change what happens next": the same seeded program of
//! tensor creations and drops (512 B to 64 MiB, values that differ from tensor to tensor), run
//! once with every reading a user has after every operation and once reading only at the end,
//! each in a fresh process (a fresh device, engine and CubeCL pool), ends with the same
//! snapshot: the same device allocations, segments, blocks and statistics, every counter
//! included; and two runs without readings end the same. Before readings named CubeCL's free
//! slices instead of handing them back, the reading run placed later tensors in the
//! handed-back slices and made other segments.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use burn_caching_alloc::backend::{self, CachingWgpuUnfused};

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;
use crate::support::rng::next;

type B = CachingWgpuUnfused;

/// Where a child writes its final snapshot, and whether it reads after every operation.
const OUT: &str = "BURN_CACHING_ALLOC_TEST_AB_OUT";
const READ: &str = "BURN_CACHING_ALLOC_TEST_AB_READ";
const SEED: &str = "BURN_CACHING_ALLOC_TEST_AB_SEED";
const TEST: &str = "readings_ab_wgpu::one_run_of_the_program";

/// Every reading of the user API, in turn (one per operation).
fn read(device: &burn::backend::wgpu::WgpuDevice, op: usize) {
    match op % 5 {
        0 => drop(backend::memory_stats(device).to_map()),
        1 => drop(backend::memory_snapshot(device)),
        2 => drop(backend::memory_report(device, None)),
        3 => drop(backend::memory_summary(device)),
        _ => drop(backend::memory_allocated(device) + backend::max_memory_reserved(device)),
    }
}

/// Runs `seed`'s program (reading after every operation when `read_each`), then checks every
/// live tensor's values and returns the final snapshot as JSON.
fn run_program(seed: u64, read_each: bool) -> String {
    let (device, _turn) = cpu_device().expect("the parent checked for an adapter");
    let mut state = seed;
    let mut live: Vec<(Tensor<B, 1>, f32)> = Vec::new();
    for op in 0..160 {
        let create = live.len() < 3 || (live.len() < 10 && !next(&mut state).is_multiple_of(3));
        if create {
            // Log-uniform from 128 floats (512 B) to 16 Mi floats (64 MiB), mostly small.
            let exponent = 7 + next(&mut state) % 18; // 2^7 .. 2^24 floats
            let floats = (1u64 << exponent) + next(&mut state) % (1u64 << exponent);
            let floats = floats.min(1 << 24) as usize;
            let value = (op % 97) as f32 + 0.5;
            live.push((Tensor::<B, 1>::full([floats], value, &device), value));
        } else {
            let at = (next(&mut state) as usize) % live.len();
            live.swap_remove(at);
        }
        // Both runs wait for the server after every operation (a round trip that reads
        // nothing): CubeCL marks a slice free the moment its last handle drops, on the user's
        // thread, so without it what the server has seen freed when it places a request depends
        // on how far this thread ran ahead of it. The runs then differ in the readings alone.
        let _ = backend::allocator_settings(&device);
        if read_each {
            read(&device, op);
        }
    }
    for (tensor, value) in &live {
        let first = tensor.clone().slice(0..1).into_data();
        assert_eq!(first.to_vec::<f32>().expect("f32"), vec![*value]);
    }
    backend::memory_snapshot(&device).to_json_pretty()
}

/// In a child started by the test below: one run, its snapshot written to the file in `OUT`.
#[test]
fn one_run_of_the_program() {
    let Some(out) = std::env::var_os(OUT) else {
        return; // only in the children of the test below
    };
    let seed: u64 = std::env::var(SEED).expect("seed").parse().expect("a seed");
    let read_each = std::env::var_os(READ).is_some_and(|v| v == "1");
    std::fs::write(out, run_program(seed, read_each)).expect("the snapshot is written");
}

/// Runs the program in a fresh child process and returns its final snapshot.
fn in_fresh_process(seed: u64, read_each: bool, dir: &Path) -> String {
    let out: PathBuf = dir.join(format!("seed{seed}-read{}.json", u8::from(read_each)));
    let seed_text = seed.to_string();
    assert!(!in_child(
        TEST,
        &[
            (OUT, Some(out.as_os_str())),
            (SEED, Some(OsStr::new(&seed_text))),
            (READ, Some(OsStr::new(if read_each { "1" } else { "0" }))),
        ],
    ));
    std::fs::read_to_string(&out).expect("the child wrote its snapshot")
}

#[test]
fn a_program_that_reads_after_every_operation_allocates_as_one_that_never_reads() {
    if std::env::var_os(OUT).is_some() {
        return;
    }
    let Some((_device, turn)) = cpu_device() else {
        return;
    };
    drop(turn);
    let dir = std::env::temp_dir().join(format!("readings-ab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    for seed in [1, 2, 3] {
        let quiet = in_fresh_process(seed, false, &dir);
        let reading = in_fresh_process(seed, true, &dir);
        // The bound on what else moves placement: with the server caught up after every
        // operation, the same program places the same way in every process.
        let again = in_fresh_process(seed, false, &dir);
        assert!(
            quiet == again,
            "seed {seed}: two runs without readings differ"
        );
        assert!(
            quiet == reading,
            "seed {seed}: the run that read after every operation ended with another layout \
             ({} and {} in {})",
            "seed*-read0.json",
            "seed*-read1.json",
            dir.display()
        );
        assert!(quiet.contains("\"segments\""));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
