//! Rounds of new threads on one device (a data loader's workers, epoch after epoch): CubeCL
//! names a stream after its thread, so every round's threads are new streams. On wgpu all of
//! them issue their work into one queue and allocate from one cache (`Driver::SINGLE_QUEUE`):
//! a new round's threads find the blocks the last round's left, and reserved memory stays near
//! the rounds' peak demand instead of growing with every round, as stock Burn's per-stream
//! pools do.

use std::sync::Barrier;

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;
use crate::support::rng::next;
use crate::support::stock::stock_reserved;

const THREADS: usize = 6;
const ROUNDS: usize = 6;
const TENSORS: usize = 30;
/// Tensor sizes run from 1 KiB to 1.2 MiB.
const MIN_BYTES: usize = 1024;
const MAX_BYTES: usize = 1200 * 1024;

/// The sizes (in f32 elements) thread `thread` uses: the same in every round.
fn sizes(thread: usize) -> Vec<usize> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (thread as u64 + 1);
    (0..TENSORS)
        .map(|_| {
            let bytes = MIN_BYTES + next(&mut state) as usize % (MAX_BYTES - MIN_BYTES + 1);
            bytes / 4
        })
        .collect()
}

/// One worker: creates, computes on, reads back and drops its tensors, in step with the
/// round's other workers (`step`), so that every round asks for the same memory at the same
/// time and a round reserves more than the first only if the cache failed to serve it.
fn work<B: Backend>(device: &B::Device, thread: usize, step: &Barrier) {
    for (i, elements) in sizes(thread).into_iter().enumerate() {
        step.wait();
        let values: Vec<f32> = (0..elements).map(|e| (e % 97) as f32).collect();
        let x = Tensor::<B, 1>::from_data(TensorData::new(values, [elements]), device);
        let y = x.clone() * 2.0 + 1.0;
        let read: Vec<f32> = y.into_data().to_vec().expect("f32 data");
        assert_eq!(read[elements - 1], ((elements - 1) % 97) as f32 * 2.0 + 1.0);
        assert_eq!(read.len(), elements, "tensor {i} of thread {thread}");
    }
}

/// Runs `ROUNDS` rounds of `THREADS` new threads on backend `B` and returns `reserved()` read
/// after each.
fn rounds<B: Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    reserved: impl Fn() -> u64,
) -> Vec<u64> {
    (0..ROUNDS)
        .map(|_| {
            let step = Barrier::new(THREADS);
            std::thread::scope(|scope| {
                for thread in 0..THREADS {
                    let step = &step;
                    scope.spawn(move || work::<B>(device, thread, step));
                }
            });
            B::sync(device).expect("sync");
            reserved()
        })
        .collect()
}

/// Reserved memory after each round of `THREADS` new threads on a caching backend, with the
/// engine's numbers printed.
fn reserved_per_round<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice) -> Vec<u64> {
    rounds::<B>(device, || {
        let stats = backend::memory_stats(device);
        let map = stats.to_map();
        let key = |k: &str| map.get(k).copied().unwrap_or(-1);
        println!(
            "round: reserved {} allocated {} in cubecl {} device allocs {} shares {} lends {} \
             segments {} streams {} slot reuses {} reclaims {}",
            stats.memory_reserved(),
            stats.memory_allocated(),
            stats.cached_in_cubecl(),
            key("num_device_alloc"),
            key("num_stream_shares"),
            key("num_stream_lends"),
            key("segment.all.current"),
            key("cubecl.streams"),
            key("cubecl.slot_reuses"),
            key("cubecl.reclaims"),
        );
        stats.memory_reserved()
    })
}

/// The most the rounds can hold at once: at the step where the threads' tensors are largest,
/// every thread's input and its result live together, each rounded as the engine rounds
/// (to 512 bytes).
fn peak_demand() -> u64 {
    let per_thread: Vec<Vec<usize>> = (0..THREADS).map(sizes).collect();
    (0..TENSORS)
        .map(|step| {
            per_thread
                .iter()
                .map(|sizes| 2 * ((sizes[step] as u64 * 4).next_multiple_of(512)))
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

/// A small-pool segment (PyTorch's `kSmallBuffer`).
const SMALL_SEGMENT: u64 = 2 << 20;

/// Reserved memory does not climb with the rounds: no round reserves more than the rounds'
/// peak demand (every thread's largest step at once, 10.3 MiB) plus one small segment per
/// thread for where their blocks interleave. On wgpu every thread allocates from one cache
/// (one queue: `Driver::SINGLE_QUEUE`), so a new round's threads find what the last round's
/// left. Measured (lavapipe, debug build, default configuration): fused 12 x 6; 12, 14 x 5;
/// 10 x 5, 12; unfused 8 x 5, 12; 8 x 3, 10 x 3; 8, 10 x 5 MiB, against a bound of 22.3. A
/// round whose threads interleave their tensors worse than any before adds a segment, so the
/// rounds are not exactly level. With a CubeCL pool and an engine stream per thread slot (before
/// one queue was one cache) they reached 22 to 24 MiB, the bound's level; before issue 38, 44,
/// 88, 136, 204.
fn assert_flat(name: &str, reserved: &[u64]) {
    print_rounds(name, reserved);
    let bound = peak_demand() + THREADS as u64 * SMALL_SEGMENT;
    for (round, &bytes) in reserved.iter().enumerate() {
        assert!(
            bytes <= bound,
            "{name}: reserved after round {} is {:.1} MiB, more than the rounds' peak demand \
             plus a small segment per thread ({:.1} MiB): {reserved:?}",
            round + 1,
            mib(bytes),
            mib(bound),
        );
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn print_rounds(name: &str, reserved: &[u64]) {
    let rounds: Vec<String> = reserved.iter().map(|&b| format!("{:.1}", mib(b))).collect();
    println!(
        "{name}: reserved after each round (MiB): {}",
        rounds.join(", ")
    );
}

#[test]
fn reserved_memory_stays_flat_over_rounds_of_new_threads_unfused() {
    let Some((device, _lock)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let reserved = reserved_per_round::<CachingWgpuUnfused>(&device);
    assert_flat("CachingWgpuUnfused", &reserved);
    backend::empty_cache(&device);
}

/// Fused, and Burn's stock `Wgpu` on the same rounds after it, printed beside (measured: 48,
/// 96, 144, 192, 240, 288 MiB, each round's new threads on new stream slots with pools of their
/// own). In a child process: stock's pools of the gone threads stay reserved.
#[test]
fn reserved_memory_stays_flat_over_rounds_of_new_threads_fused() {
    if !in_child(
        "thread_rounds_wgpu::reserved_memory_stays_flat_over_rounds_of_new_threads_fused",
        &[],
    ) {
        return;
    }
    let Some((device, _lock)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let reserved = reserved_per_round::<CachingWgpu>(&device);
    backend::empty_cache(&device);
    // Burn's stock backend on the same rounds, printed for comparison; its pools are per
    // stream slot as well.
    let stock = rounds::<burn::backend::Wgpu>(&device, || stock_reserved::<WgpuRuntime>(&device));
    print_rounds("stock Wgpu", &stock);
    assert_flat("CachingWgpu", &reserved);
}
