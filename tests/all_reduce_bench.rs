//! Benchmark, ignored by default: a 64 MiB f32 all-reduce (sum) across the two caching wgpu
//! devices of one process (`Cpu` and `DefaultDevice`, lavapipe here), each device driven from
//! its own thread as Burn's DDP drives them, through CubeCL's `ComputeClient::all_reduce`: the
//! host path (`src/runtime/server/comm.rs`). Prints the time of each round, from both calls
//! issued to both devices synchronised, and checks the values. Run it with an optimised
//! library, e.g.
//! `cargo test --all-features --config 'profile.test.package.burn-caching-alloc.opt-level=3'
//! -p burn-caching-alloc --test all_reduce_bench -- --ignored --nocapture`. A test binary of
//! its own, so that an optimised build of it stays small.
#![cfg(feature = "wgpu")]

use std::sync::Barrier;
use std::time::{Duration, Instant};

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::backend;
use burn_caching_alloc::wgpu::CachingWgpuRuntime;
use cubecl_common::device::Device;
use cubecl_ir::{ElemType, FloatKind};
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::ReduceOperation;

const F32: ElemType = ElemType::Float(FloatKind::F32);
const ELEMENTS: usize = 16 << 20;
const WARMUP: usize = 2;
const ROUNDS: usize = 8;

/// Device `rank`'s input: small integers, so that every sum below is exact in f32.
fn input(rank: usize) -> Vec<f32> {
    (0..ELEMENTS)
        .map(|i| ((i % 1000) * (rank + 1)) as f32)
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// Runs `WARMUP + ROUNDS` all-reduces on `device` (rank `rank` of `devices`), meeting the other
/// thread at `start` before each; returns each round's time and the final values.
fn member(
    device: &WgpuDevice,
    rank: usize,
    devices: &[WgpuDevice],
    start: &Barrier,
) -> (Vec<Duration>, Vec<f32>) {
    let mut client = CachingWgpuRuntime::client(device);
    let buffer = client.create_from_slice(&bytes(&input(rank)));
    let ids = devices.iter().map(Device::to_id).collect::<Vec<_>>();
    client.sync_collective();
    cubecl_common::future::block_on(client.sync()).expect("sync");
    let mut times = Vec::new();
    for _ in 0..WARMUP + ROUNDS {
        start.wait();
        let began = Instant::now();
        client.all_reduce(
            buffer.clone(),
            buffer.clone(),
            F32,
            ids.clone(),
            ReduceOperation::Sum,
        );
        client.sync_collective();
        cubecl_common::future::block_on(client.sync()).expect("sync");
        times.push(began.elapsed());
    }
    let out = client.read_one(buffer).expect("read").to_vec();
    let values = out
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    (times.split_off(WARMUP), values)
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture (see the module docs)"]
fn all_reduce_bench_64_mib_across_two_wgpu_devices() {
    // Two CubeCL devices (two servers, two engines) on the one adapter lavapipe offers.
    let (a, b) = (WgpuDevice::Cpu, WgpuDevice::DefaultDevice);
    if !burn_caching_alloc::wgpu::adapter_available(&a) {
        eprintln!("skipping: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
        return;
    }
    let devices = [a.clone(), b.clone()];
    let start = Barrier::new(2);
    let (results_a, results_b) = std::thread::scope(|scope| {
        let on_a = scope.spawn(|| member(&a, 0, &devices, &start));
        let on_b = scope.spawn(|| member(&b, 1, &devices, &start));
        (on_a.join().expect("a"), on_b.join().expect("b"))
    });
    // Each round doubles the sum of the first: 3x, then 6x, ... (all exact in f32).
    let factor = 3.0 * f32::powi(2.0, (WARMUP + ROUNDS - 1) as i32);
    let expected: Vec<f32> = (0..ELEMENTS).map(|i| (i % 1000) as f32 * factor).collect();
    assert!(results_a.1 == expected, "device a's values");
    assert!(results_b.1 == expected, "device b's values");

    let mut rounds: Vec<Duration> = results_a
        .0
        .iter()
        .zip(&results_b.0)
        .map(|(x, y)| *x.max(y))
        .collect();
    let listed: Vec<String> = rounds
        .iter()
        .map(|t| format!("{:.1}", t.as_secs_f64() * 1e3))
        .collect();
    rounds.sort();
    let median = rounds[rounds.len() / 2];
    let mib = (ELEMENTS * 4) as f64 / (1 << 20) as f64;
    println!(
        "all_reduce {mib} MiB f32 sum, 2 wgpu devices, {} threads available: rounds [{}] ms; \
         median {:.1} ms, min {:.1} ms ({:.2} GB/s of one buffer at the median)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        listed.join(", "),
        median.as_secs_f64() * 1e3,
        rounds[0].as_secs_f64() * 1e3,
        (ELEMENTS * 4) as f64 / median.as_secs_f64() / 1e9,
    );
    backend::empty_cache(&a);
    backend::empty_cache(&b);
}
