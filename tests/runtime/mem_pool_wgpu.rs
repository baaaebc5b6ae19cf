//! Private pools through Burn on the fused `CachingWgpu` (lavapipe in CI): `backend::MemPool`
//! and `backend::use_mem_pool` (PyTorch's `torch.cuda.MemPool` / `use_mem_pool`, whose
//! allocator side is `beginAllocateToPool` / `endAllocateToPool` / `releasePool`).
//!
//! What is queued in the fusion stream inside the guard is allocated inside; other threads and
//! tensors made outside stay in the allocator's own pools; the pool's numbers, snapshot and
//! `empty_cache`; and a frozen backbone's parameters loaded into a pool before a
//! variable-length training loop, against the same run without the pool: the default pool's
//! cached bytes and segments (the numbers in the guide's benchmarks chapter).

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::alloc::{MemPoolOptions, format_bytes};
use burn_caching_alloc::backend::{self, CachingWgpu, MemPool, use_mem_pool};

use crate::MIB;
use crate::support::lavapipe::cpu_device;

/// Bytes of the engine block of one f32 tensor of `elements` (512-byte rounding).
fn block(elements: usize) -> u64 {
    ((elements as u64 * 4).div_ceil(512) * 512).max(512)
}

#[test]
fn tensors_queued_inside_use_mem_pool_take_the_pools_memory() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let elements = MIB as usize;
    let pool = MemPool::new(&device, MemPoolOptions::default()).expect("pool");
    // Queued before the guard (never read): drained at its start, so allocated outside.
    let before = Tensor::<CachingWgpu, 1>::ones([elements], &device);
    let inside = {
        let _guard = use_mem_pool(&pool);
        let a = Tensor::<CachingWgpu, 1>::ones([elements], &device);
        // Queued in the fusion stream, never read inside: drained when the guard ends.
        a.clone() * 2.0 + 1.0
    };
    let after = Tensor::<CachingWgpu, 1>::ones([elements], &device);
    // Another thread's tensors never take the pool's memory, guard or not.
    let other = std::thread::scope(|s| {
        s.spawn(|| {
            let t = Tensor::<CachingWgpu, 1>::ones([elements], &device);
            backend::memory_allocated(&device);
            t
        })
        .join()
        .expect("thread")
    });

    let stats = pool.memory_stats();
    // What the guard left alive inside: `inside` (its input `a` is gone, and so are the
    // fused intermediates, whose blocks went back to the pool's cache).
    assert_eq!(stats.allocated_bytes, block(elements), "{stats:?}");
    assert_eq!(stats.allocations, 1);
    assert!(stats.reserved_bytes >= stats.allocated_bytes);
    assert_eq!(
        backend::memory_allocated(&device),
        4 * block(elements),
        "before, inside, after and other's tensors"
    );
    let snapshot = pool.snapshot();
    assert!(!snapshot.segments.is_empty());
    assert!(
        snapshot
            .segments
            .iter()
            .all(|s| s.mem_pool == Some(pool.id().get()))
    );
    let all = backend::memory_snapshot(&device);
    let outside_allocated: u64 = all
        .segments
        .iter()
        .filter(|s| s.mem_pool.is_none())
        .map(|s| s.allocated_size)
        .sum();
    assert_eq!(outside_allocated, 3 * block(elements));

    // A dropped tensor's block goes back to the pool's cache; the device's `empty_cache`
    // leaves the pool alone, the pool's own returns it.
    drop(inside);
    assert_eq!(pool.memory_stats().allocated_bytes, 0);
    let pool_reserved = pool.memory_stats().reserved_bytes;
    backend::empty_cache(&device);
    assert_eq!(pool.memory_stats().reserved_bytes, pool_reserved);
    assert_eq!(pool.empty_cache().expect("empty"), pool_reserved);
    assert_eq!(pool.memory_stats().segments, 0);

    drop((before, after, other, pool));
    backend::empty_cache(&device);
    assert_eq!(backend::memory_reserved(&device), 0);
}

#[test]
fn a_dropped_pool_returns_its_memory_with_its_last_tensor() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let pool = MemPool::new(&device, MemPoolOptions::default()).expect("pool");
    let kept = {
        let _guard = use_mem_pool(&pool);
        Tensor::<CachingWgpu, 1>::ones([3 * MIB as usize], &device)
    };
    let id = pool.id().get();
    drop(pool); // releasePool: the tensor still holds its segment
    // The released pool's segments, as (bytes, allocated bytes).
    let pool_segments = |device| {
        backend::memory_snapshot(device)
            .segments
            .iter()
            .filter(|s| s.mem_pool == Some(id))
            .map(|s| (s.total_size, s.allocated_size))
            .collect::<Vec<_>>()
    };
    assert_eq!(pool_segments(&device), vec![(12 * MIB, 12 * MIB)]);
    drop(kept);
    // CubeCL keeps the freed slice (a reading only sees it as cache); once it reaches the
    // engine (here `empty_cache`), the block's free returns the released pool's segment.
    assert_eq!(pool_segments(&device), vec![(12 * MIB, 0)]);
    backend::empty_cache(&device);
    assert_eq!(pool_segments(&device), vec![]);
    assert_eq!(backend::memory_reserved(&device), 0);
}

#[test]
fn a_dropped_pool_tensors_slice_never_serves_a_tensor_outside() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let elements = 2 * MIB as usize;
    let pool = MemPool::new(&device, MemPoolOptions::default()).expect("pool");
    let inside = {
        let _guard = use_mem_pool(&pool);
        Tensor::<CachingWgpu, 1>::ones([elements], &device)
    };
    // Dropped, then a tensor of exactly its size outside, with no reading between: CubeCL's
    // exact-size reuse holds the pool's free slice when the new tensor asks.
    drop(inside);
    let outside = Tensor::<CachingWgpu, 1>::ones([elements], &device);
    assert_eq!(pool.memory_stats().allocated_bytes, 0);
    let snapshot = backend::memory_snapshot(&device);
    let outside_allocated: u64 = snapshot
        .segments
        .iter()
        .filter(|s| s.mem_pool.is_none())
        .map(|s| s.allocated_size)
        .sum();
    assert_eq!(outside_allocated, block(elements));
    drop((outside, pool));
    backend::empty_cache(&device);
    assert_eq!(backend::memory_reserved(&device), 0);
}

const WIDTH: usize = 256;
const HIDDEN: usize = 2048;
const LAYERS: usize = 4;
const STEPS: usize = 24;

/// A frozen backbone (its parameters loaded once) and a small trained head.
#[derive(Module, Debug)]
struct Model<B: Backend> {
    up: Vec<Linear<B>>,
    down: Vec<Linear<B>>,
    head: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Model<B> {
    fn backbone(device: &B::Device) -> (Vec<Linear<B>>, Vec<Linear<B>>) {
        let up = (0..LAYERS)
            .map(|_| LinearConfig::new(WIDTH, HIDDEN).init(device).no_grad())
            .collect();
        let down = (0..LAYERS)
            .map(|_| LinearConfig::new(HIDDEN, WIDTH).init(device).no_grad())
            .collect();
        (up, down)
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for (up, down) in self.up.iter().zip(&self.down) {
            x = x.clone() + down.forward(self.activation.forward(up.forward(x)));
        }
        self.head.forward(x)
    }
}

/// What one run left in the allocator's own pools.
#[derive(Debug)]
struct Fragmentation {
    /// Reserved minus allocated in the allocator's own pools, at the end of each step.
    cached_max: u64,
    cached_end: u64,
    segments_end: usize,
    reserved_peak: u64,
    parameters_in_pool: u64,
}

/// Loads the backbone (into `pool` if given), then trains the head on sequences of varying
/// length; returns the default pool's numbers.
fn varlen_run(device: &burn::backend::wgpu::WgpuDevice, pooled: bool) -> Fragmentation {
    type B = Autodiff<CachingWgpu>;
    backend::empty_cache(device);
    backend::reset_peak_memory_stats(device);
    B::seed(device, 11);
    let pool = pooled.then(|| MemPool::new(device, MemPoolOptions::default()).expect("pool"));
    let (up, down) = {
        let _guard = pool.as_ref().map(use_mem_pool);
        Model::<B>::backbone(device)
    };
    let mut model = Model {
        up,
        down,
        head: LinearConfig::new(WIDTH, 16).init(device),
        activation: Relu::new(),
    };
    let mut optim = AdamConfig::new().init();
    let default_pool = |device| {
        let snapshot = backend::memory_snapshot(device);
        let own: Vec<_> = snapshot
            .segments
            .iter()
            .filter(|s| s.mem_pool.is_none())
            .collect();
        let reserved: u64 = own.iter().map(|s| s.total_size).sum();
        let allocated: u64 = own.iter().map(|s| s.allocated_size).sum();
        (reserved - allocated, own.len())
    };
    let mut cached_max = 0;
    for step in 0..STEPS {
        // Lengths from a fixed set, out of order (a varlen batch sampler).
        let len = [96, 320, 160, 384, 64, 256, 224, 128][(step * 5) % 8];
        let x: Vec<f32> = (0..len * WIDTH)
            .map(|i| ((i * 31) % 97) as f32 / 97.0)
            .collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(x, [len, WIDTH]), device);
        let loss = model.forward(x).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
        cached_max = cached_max.max(default_pool(device).0);
    }
    let (cached_end, segments_end) = default_pool(device);
    let parameters_in_pool = pool
        .as_ref()
        .map_or(0, |p| p.memory_stats().allocated_bytes);
    let reserved_peak = backend::memory_stats(device).max_memory_reserved();
    drop((model, optim, pool));
    backend::empty_cache(device);
    Fragmentation {
        cached_max,
        cached_end,
        segments_end,
        reserved_peak,
        parameters_in_pool,
    }
}

#[test]
fn a_parameter_pool_beside_a_varlen_training_loop() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let without = varlen_run(&device, false);
    let with = varlen_run(&device, true);
    // The whole backbone, and nothing else, was loaded into the pool.
    let weights = LAYERS as u64 * 2 * block(WIDTH * HIDDEN);
    let biases = LAYERS as u64 * (block(HIDDEN) + block(WIDTH));
    assert_eq!(with.parameters_in_pool, weights + biases);
    assert_eq!(without.parameters_in_pool, 0);
    for (name, run) in [
        ("without a pool", &without),
        ("with a parameter pool", &with),
    ] {
        println!(
            "{name}: default pool cached (reserved - allocated) max {} end {}, {} segments at \
             the end; device reserved peak {}",
            format_bytes(run.cached_max),
            format_bytes(run.cached_end),
            run.segments_end,
            format_bytes(run.reserved_peak),
        );
    }
    assert_eq!(backend::memory_reserved(&device), 0);
}
