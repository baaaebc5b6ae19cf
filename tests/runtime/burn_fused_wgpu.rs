//! Burn on the fused `CachingWgpu` (`Fusion<CubeBackend<..>>`, as Burn's default `Wgpu` is),
//! on the wgpu CPU adapter (lavapipe in CI): the memory API drains the fusion queue first, and
//! its numbers mean what PyTorch's mean: "allocated" is what live tensors hold, everywhere.

use crate::MIB;
use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_caching_alloc::alloc::{BlockState, format_bytes};
use burn_caching_alloc::backend::{self, CachingMemoryStats, CachingWgpu};

use crate::support::lavapipe::cpu_device;

const PIXELS: usize = 28 * 28;
const HIDDEN: usize = 64;
const CLASSES: usize = 10;
const BATCH: usize = 32;
const STEPS: usize = 12;

/// An MNIST-shaped classifier: 784 -> 64 -> 10.
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Classifier<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(PIXELS, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.output
            .forward(self.activation.forward(self.hidden.forward(x)))
    }
}

/// Bytes of the engine blocks of one f32 tensor of `elements` (PyTorch's 512-byte rounding).
fn block(elements: usize) -> u64 {
    ((elements as u64 * 4).div_ceil(512) * 512).max(512)
}

/// The sum of the allocated blocks of a snapshot: the engine's state, block by block.
fn allocated_in_snapshot(device: &burn::backend::wgpu::WgpuDevice) -> u64 {
    backend::memory_snapshot(device)
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.state == BlockState::ActiveAllocated)
        .map(|block| block.size)
        .sum()
}

/// The "Allocated memory" row's current value in the summary.
fn summary_allocated(summary: &str) -> String {
    let row = summary
        .lines()
        .find(|line| line.starts_with("| Allocated memory"))
        .unwrap_or_else(|| panic!("no Allocated memory row in\n{summary}"));
    row.split('|')
        .nth(2)
        .expect("a current column")
        .trim()
        .to_string()
}

/// Every way the API reports "allocated" gives `expected`.
fn assert_allocated_everywhere(
    device: &burn::backend::wgpu::WgpuDevice,
    stats: &CachingMemoryStats,
    expected: u64,
) {
    let map = stats.to_map();
    assert_eq!(stats.memory_allocated(), expected, "{stats:#?}");
    // wgpu stages nothing in pinned host memory: no pool, no `host_*` keys.
    assert!(stats.host.is_none());
    assert!(!map.keys().any(|key| key.starts_with("host_")));
    assert_eq!(map["allocated_bytes.all.current"], expected as i64);
    assert_eq!(map["active_bytes.all.current"], expected as i64);
    assert_eq!(
        map["allocated_bytes.small_pool.current"] + map["allocated_bytes.large_pool.current"],
        expected as i64
    );
    assert_eq!(backend::memory_allocated(device), expected);
    assert_eq!(allocated_in_snapshot(device), expected);
    let summary = backend::memory_summary(device);
    assert_eq!(
        summary_allocated(&summary),
        format_bytes(expected),
        "{summary}"
    );
}

#[test]
fn the_memory_api_drains_the_fusion_queue_first() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    assert_eq!(backend::memory_allocated(&device), 0);
    // Queued in the fusion stream and never read: without the drain, nothing is allocated yet.
    let elements = MIB as usize;
    let a = Tensor::<CachingWgpu, 1>::ones([elements], &device);
    let b = a.clone() * 3.0;
    let stats = backend::memory_stats(&device);
    assert_allocated_everywhere(&device, &stats, 2 * block(elements));
    assert_eq!(stats.tensor_bytes(), 2 * 4 * elements as u64);
    drop((a, b));
    backend::empty_cache(&device);
}

#[test]
fn fused_training_reports_what_live_tensors_hold_and_the_engines_state() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    type B = Autodiff<CachingWgpu>;
    backend::empty_cache(&device);
    B::seed(&device, 7);
    let images: Vec<f32> = (0..BATCH * PIXELS)
        .map(|i| ((i * 7919) % 255) as f32 / 255.0)
        .collect();
    let labels: Vec<i64> = (0..BATCH).map(|i| (i % CLASSES) as i64).collect();

    let mut model = Classifier::<B>::new(&device);
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut last_loss = f32::NAN;
    for step in 0..STEPS {
        let x =
            Tensor::<B, 2>::from_data(TensorData::new(images.clone(), [BATCH, PIXELS]), &device);
        let y = Tensor::<B, 1, Int>::from_data(TensorData::new(labels.clone(), [BATCH]), &device);
        let loss = loss_fn.forward(model.forward(x), y);
        // Read the loss only on the last step: the other steps stay queued in fusion until
        // the optimizer's work needs them.
        if step + 1 == STEPS {
            last_loss = loss.clone().into_scalar();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
    }
    assert!(last_loss.is_finite(), "loss {last_loss}");

    // After the last step the live tensors are the parameters and Adam's two moments of each.
    let parameters = [PIXELS * HIDDEN, HIDDEN, HIDDEN * CLASSES, CLASSES];
    let live: u64 = parameters.iter().map(|&n| 3 * block(n)).sum();
    let stats = backend::memory_stats(&device);
    assert_allocated_everywhere(&device, &stats, live);
    // What the tensors asked CubeCL for: at least their elements' bytes (CubeCL may pad a
    // small tensor's buffer), at most their blocks.
    let elements: u64 = parameters.iter().map(|&n| 3 * 4 * n as u64).sum();
    assert!(
        (elements..=live).contains(&stats.tensor_bytes()),
        "{} B asked for {elements} B of elements",
        stats.tensor_bytes()
    );
    assert!(stats.max_memory_allocated() >= live);
    assert_eq!(
        stats.memory_reserved(),
        stats.memory_allocated() + stats.cached_in_cubecl() + stats.cached_in_engine()
    );

    // Everything dropped: nothing is allocated, the cache CubeCL kept is reserved.
    drop((model, optim));
    let stats = backend::memory_stats(&device);
    assert_allocated_everywhere(&device, &stats, 0);
    assert_eq!(stats.to_map()["requested_bytes.all.current"], 0);
    assert!(
        stats.cached_in_cubecl() >= elements,
        "the model's slices were cached in CubeCL: {:?}",
        stats.cubecl
    );
    assert!(stats.memory_reserved() >= live);
    assert_eq!(
        stats.cached_in_cubecl() + stats.cached_in_engine(),
        stats.memory_reserved()
    );
    let summary = backend::memory_summary(&device);
    assert!(
        summary.contains("Live tensors: 0 B in 0 slices"),
        "{summary}"
    );

    backend::empty_cache(&device);
    assert_eq!(backend::memory_reserved(&device), 0);
}
