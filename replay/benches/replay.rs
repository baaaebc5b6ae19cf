//! Per-operation latency of replaying the built-in traces through each allocator
//! (criterion). Throughput is in operations, so criterion reports time per operation.
//! Kept quick: 10 samples per replay, 1 s warm-up, 3 s of measurement.
//!
//! Every replay runs on a fresh simulated device (`SimDevice`), through the allocators'
//! simulated-device constructors. `cargo bench -p replay` (add `-- NAME` to filter, e.g.
//! `-- many-params`). The `replay` binary (`cargo run --release -p replay`) gives the same
//! replays' median and p99 latencies, device calls and peak memory, on the simulated device or
//! CUDA.

use std::time::Duration;

use burn_caching_alloc::device::sim::SimDevice;
use criterion::{BatchSize, BenchmarkGroup, Criterion, Throughput, measurement::WallTime};
use replay::allocator::{CachingStackAllocator, CubeclAllocator, EngineAllocator, ReplayAllocator};
use replay::{AllocatorKind, DEFAULT_DEVICE_CAPACITY, Program, builtin_traces, replay};

fn bench_allocator<A: ReplayAllocator>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    kind: AllocatorKind,
    program: &Program,
    make: impl Fn(SimDevice) -> A,
) {
    group.bench_function(kind.name(), |b| {
        b.iter_batched_ref(
            || make(SimDevice::new(DEFAULT_DEVICE_CAPACITY)),
            |allocator| replay(allocator, program).expect("built-in traces replay"),
            BatchSize::PerIteration,
        )
    });
}

fn replays(c: &mut Criterion) {
    for named in builtin_traces() {
        let program = Program::compile(&named.trace).expect("built-in traces compile");
        let mut group = c.benchmark_group(format!("replay/{}", named.name));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements(program.ops().len() as u64));
        for kind in AllocatorKind::ALL {
            match kind {
                AllocatorKind::Caching => {
                    bench_allocator(&mut group, kind, &program, EngineAllocator::new)
                }
                AllocatorKind::CubeclSubslices => {
                    bench_allocator(&mut group, kind, &program, CubeclAllocator::subslices)
                }
                AllocatorKind::CubeclExclusive => {
                    bench_allocator(&mut group, kind, &program, CubeclAllocator::exclusive)
                }
                AllocatorKind::CachingStack => {
                    bench_allocator(&mut group, kind, &program, CachingStackAllocator::new)
                }
            }
        }
        group.finish();
    }
}

criterion::criterion_group!(benches, replays);
criterion::criterion_main!(benches);
