//! A soak of the real backend (issue 33): several threads on one device, each its own CubeCL
//! stream, creating tensors of varied sizes, computing on them, reading them back and dropping
//! them out of order, for several rounds, on `CachingWgpu` (fused) and `CachingWgpuUnfused`.
//! Every value read back is exact, nothing is allocated after a round beyond what the first
//! round left (the stream's launch metadata), no request fails, and no round reserves more
//! than the threads would need each at its own peak at once, plus a small segment each. On
//! wgpu every thread's work goes into one queue, so all of them allocate from one cache
//! (`Driver::SINGLE_QUEUE`); the numbers of each round are printed (`--nocapture`).
//!
//! Each soak runs alone in a child process (`support::child`), on a device no other test
//! used.

use std::sync::{Arc, Barrier};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;

const THREADS: usize = 4;
const ROUNDS: usize = 5;
/// Elements of the tensors a thread makes each round: from one element to 1 MiB of f32, sizes
/// that fall in the small pool, the large pool and between.
const SIZES: [usize; 9] = [1, 7, 130, 1000, 4096, 33_000, 100_000, 262_144, 300_001];

/// The value at index `i` of a tensor of thread `thread`: small integers, exact in f32.
fn value(thread: usize, i: usize) -> f32 {
    ((i * 7 + thread * 13) % 1000) as f32
}

/// One thread's round: every size made, computed on (`x * 2 + 1` and `(x * 2 + 1) - x`), read
/// back and checked; the tensors are dropped in an order that interleaves sizes.
fn round<B: Backend>(device: &B::Device, thread: usize, round: usize) {
    let mut kept: Vec<(usize, Tensor<B, 1>, Tensor<B, 1>)> = Vec::new();
    for (k, &elements) in SIZES.iter().enumerate() {
        let elements = elements + thread + round % 2;
        let data: Vec<f32> = (0..elements).map(|i| value(thread, i)).collect();
        let x = Tensor::<B, 1>::from_data(TensorData::new(data, [elements]), device);
        let y = x.clone().mul_scalar(2.0).add_scalar(1.0);
        let z = y.clone().sub(x.clone());
        let ys = y.clone().into_data().to_vec::<f32>().expect("f32");
        let zs = z.into_data().to_vec::<f32>().expect("f32");
        for i in (0..elements)
            .step_by(1 + elements / 97)
            .chain([elements - 1])
        {
            let v = value(thread, i);
            assert_eq!(
                ys[i],
                v * 2.0 + 1.0,
                "thread {thread} size {elements} at {i}"
            );
            assert_eq!(zs[i], v + 1.0, "thread {thread} size {elements} at {i}");
        }
        kept.push((k, x, y));
        // Out of order: every third step drops the oldest tensor kept, the rest wait.
        if k % 3 == 2 {
            kept.remove(0);
        }
    }
    // The rest go in reverse, odd positions first.
    let (odd, even): (Vec<_>, Vec<_>) = kept.into_iter().partition(|(k, _, _)| k % 2 == 1);
    drop(odd.into_iter().rev().collect::<Vec<_>>());
    drop(even);
}

/// Allocated and reserved bytes after each round.
fn soak<B: Backend<Device = burn::backend::wgpu::WgpuDevice>>(
    device: &burn::backend::wgpu::WgpuDevice,
    name: &str,
) -> Vec<(u64, u64)> {
    backend::empty_cache(device);
    let before = backend::memory_stats(device);
    let start = Arc::new(Barrier::new(THREADS + 1));
    let done = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (device, start, done) = (device.clone(), start.clone(), done.clone());
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    start.wait();
                    round::<B>(&device, thread, r);
                    B::sync(&device).expect("the device syncs");
                    done.wait();
                }
            })
        })
        .collect();
    let mut rounds = Vec::new();
    for r in 0..ROUNDS {
        start.wait();
        done.wait();
        let stats = backend::memory_stats(device);
        let map = stats.to_map();
        let key = |k: &str| map.get(k).copied().unwrap_or(-1);
        println!(
            "{name}, round {}: {THREADS} threads, allocated {} bytes, reserved {} bytes, \
             CubeCL tensors {} bytes, segments small {} large {}, peak allocated {}",
            r + 1,
            stats.memory_allocated(),
            stats.memory_reserved(),
            stats.tensor_bytes(),
            key("segment.small_pool.current"),
            key("segment.large_pool.current"),
            key("allocated_bytes.all.peak"),
        );
        rounds.push((stats.memory_allocated(), stats.memory_reserved()));
    }
    for worker in workers {
        worker.join().expect("a soak thread failed");
    }
    let after = backend::memory_stats(device);
    assert_eq!(
        after.engine.num_ooms, before.engine.num_ooms,
        "{name}: no OOM"
    );
    backend::empty_cache(device);
    rounds
}

/// A small-pool segment (PyTorch's `kSmallBuffer`).
const SMALL_SEGMENT: u64 = 2 << 20;

/// Each thread's round alone, one thread after the other, on a device emptied before each:
/// the engine's peak allocated bytes (tensors and the free slices CubeCL kept) of each.
fn alone<B: Backend<Device = burn::backend::wgpu::WgpuDevice>>(
    device: &burn::backend::wgpu::WgpuDevice,
) -> Vec<u64> {
    (0..THREADS)
        .map(|thread| {
            backend::empty_cache(device);
            backend::reset_peak_memory_stats(device);
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    round::<B>(device, thread, 0);
                    B::sync(device).expect("the device syncs");
                });
            });
            backend::max_memory_allocated(device)
        })
        .collect()
}

/// Every round leaves as much allocated as the first, and reserves no more than every thread
/// at its own peak at once, plus one small segment each for where their blocks interleave. On
/// wgpu every thread allocates from one cache (one queue, `Driver::SINGLE_QUEUE`): what a round
/// reserves follows how the threads' peaks meet, which varies from run to run (seen unfused:
/// 24 to 40 MiB after round 5, against the bound's 44), so the bound is on the worst meeting,
/// not on the rounds being equal.
fn check(name: &str, rounds: &[(u64, u64)], alone: &[u64]) {
    let (first_allocated, _) = rounds[0];
    for (r, &(allocated, _)) in rounds.iter().enumerate() {
        assert_eq!(
            allocated,
            first_allocated,
            "{name}: round {} left {allocated} bytes allocated, the first {first_allocated}",
            r + 1
        );
    }
    let bound = alone.iter().sum::<u64>() + THREADS as u64 * SMALL_SEGMENT;
    println!("{name}: each thread's peak alone {alone:?}, bound {bound} bytes");
    for (r, &(_, reserved)) in rounds.iter().enumerate() {
        assert!(
            reserved <= bound,
            "{name}: round {} reserved {reserved} bytes, more than every thread's peak alone \
             ({alone:?}) at once plus a small segment each ({bound}): {rounds:?}",
            r + 1
        );
    }
    // What stays allocated is the stream's launch metadata, not the tensors: far less than
    // one round's tensors (about 3.5 MiB a thread).
    assert!(
        first_allocated < 1 << 20,
        "{name}: {first_allocated} bytes allocated after a round"
    );
}

/// Runs the soak on backend `B` in a child process started for `test` (on a device no other
/// test used), and checks it.
fn soak_in_child<B: Backend<Device = burn::backend::wgpu::WgpuDevice>>(test: &str, name: &str) {
    if !in_child(&format!("soak_wgpu::{test}"), &[]) {
        return;
    }
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let alone = alone::<B>(&device);
    let rounds = soak::<B>(&device, name);
    check(name, &rounds, &alone);
}

#[test]
fn threads_soak_the_unfused_backend() {
    soak_in_child::<CachingWgpuUnfused>("threads_soak_the_unfused_backend", "unfused");
}

#[test]
fn threads_soak_the_fused_backend() {
    soak_in_child::<CachingWgpu>("threads_soak_the_fused_backend", "fused");
}
