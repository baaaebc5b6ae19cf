//! Steady-state malloc + free pairs on the simulated device, for a small, a large and a
//! mixed size distribution. Every size is served from cache after the warm-up, so this
//! measures the engine's own CPU cost per pair. `history` measures the same pairs (mixed
//! sizes) with history recording off, on without stacks, and on with a stack per allocation
//! (`record_memory_history`): the cost of recording per allocation.

use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator, HistoryOptions, StackContext};
use burn_caching_alloc::device::DeviceStream;
use burn_caching_alloc::device::sim::SimDevice;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const MIB: u64 = 1 << 20;
use rand::{Rng, SeedableRng, rngs::SmallRng};

fn sizes(kind: &str, n: usize) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(7);
    (0..n)
        .map(|_| match kind {
            "small" => rng.random_range(1..=MIB),
            "large" => rng.random_range(MIB + 1..=64 * MIB),
            _ => {
                if rng.random_bool(0.8) {
                    rng.random_range(1..=MIB)
                } else {
                    rng.random_range(MIB + 1..=64 * MIB)
                }
            }
        })
        .collect()
}

fn steady_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("malloc_free_pair");
    for kind in ["small", "large", "mixed"] {
        let sizes = sizes(kind, 1024);
        let alloc =
            CachingAllocator::new(SimDevice::new(1 << 40), AllocatorConfig::default()).unwrap();
        let stream = DeviceStream::default();
        // Warm up: keep 64 live allocations around so the pools are realistically split.
        let background: Vec<_> = sizes[..64]
            .iter()
            .map(|&s| alloc.malloc(s, stream).unwrap())
            .collect();
        for &s in &sizes {
            let a = alloc.malloc(s, stream).unwrap();
            alloc.free(a).unwrap();
        }
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::from_parameter(kind), &sizes, |b, sizes| {
            let mut i = 0;
            b.iter(|| {
                let a = alloc.malloc(sizes[i % sizes.len()], stream).unwrap();
                alloc.free(a).unwrap();
                i += 1;
            });
        });
        for a in background {
            alloc.free(a).unwrap();
        }
    }
    group.finish();
}

fn history(c: &mut Criterion) {
    let mut group = c.benchmark_group("malloc_free_pair_history");
    let sizes = sizes("mixed", 1024);
    let trace = HistoryOptions::trace(1 << 16);
    let variants = [
        ("off", HistoryOptions::off()),
        ("trace", trace),
        ("trace_and_stacks", trace.with_context(StackContext::Alloc)),
    ];
    for (name, options) in variants {
        let alloc =
            CachingAllocator::new(SimDevice::new(1 << 40), AllocatorConfig::default()).unwrap();
        alloc.record_memory_history(options);
        let stream = DeviceStream::default();
        for &s in &sizes {
            let a = alloc.malloc(s, stream).unwrap();
            alloc.free(a).unwrap();
        }
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::from_parameter(name), &sizes, |b, sizes| {
            let mut i = 0;
            b.iter(|| {
                let a = alloc.malloc(sizes[i % sizes.len()], stream).unwrap();
                alloc.free(a).unwrap();
                i += 1;
            });
        });
    }
    group.finish();
}

criterion_group!(benches, steady_state, history);
criterion_main!(benches);
