//! Loading a model of n parameters through the layering users run (CubeCL's persistent
//! `MemoryManagement` over `EngineStorage`, with the amortised reclaim policy), on the
//! simulated device. Every parameter is a new size over 10 MiB, so every reservation is a new
//! large size (a placement reclaim candidate), misses both caches and would grow the engine:
//! the worst case for the reclaim. With the budget (2 slice-visits per reservation, 32 more
//! per new large size) the time per parameter stays flat as n grows from 1,000 to 10,000; a
//! reclaim at every miss would make it grow linearly (the scan covers every live slice).

use std::sync::Arc;

use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};

const MIB: u64 = 1 << 20;
use burn_caching_alloc::device::DeviceStream;
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::runtime::StreamMemory;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cubecl_ir::MemoryDeviceProperties;

fn load(n: u64) -> u64 {
    let allocator = Arc::new(
        CachingAllocator::new(SimDevice::new(1 << 50), AllocatorConfig::default())
            .expect("the default configuration"),
    );
    let props = MemoryDeviceProperties {
        max_page_size: 1 << 30,
        alignment: 256,
    };
    let mut memory = StreamMemory::new(allocator, DeviceStream(0), &props);
    let params: Vec<_> = (0..n)
        .map(|i| {
            memory
                .reserve(10 * MIB + (i + 1) * 512)
                .expect("the simulated device is large enough")
        })
        .collect();
    drop(params);
    memory.counters().reclaim_work
}

fn model_load(c: &mut Criterion) {
    let mut group = c.benchmark_group("model_load");
    group.sample_size(10);
    for n in [1_000u64, 2_000, 5_000, 10_000] {
        group.throughput(Throughput::Elements(n));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter(|| load(n))
        });
    }
    group.finish();
}

criterion_group!(benches, model_load);
criterion_main!(benches);
