//! A training loop over MNIST fed by Burn's `MultiThreadDataLoader` (four workers), ten epochs,
//! on the caching backends and on Burn's stock ones, fused and unfused. The loader spawns its
//! workers anew at every `iter()` (burn-core 0.21 `data/dataloader/multithread.rs`), as
//! burn-train's training and validation loops call it every epoch, and CubeCL names a stream
//! after its thread: every epoch's batches are allocated on streams never seen before. wgpu has
//! one queue, so the server maps every CubeCL stream onto one slot (`Driver::SINGLE_QUEUE`,
//! `src/runtime/server/streams.rs`): the new workers' batches come from the one cache the old
//! workers freed into, and reserved memory stays level. Stock's numbers are printed beside
//! ours.
//!
//! The loop is burn-train's (`SupervisedTraining` runs the same: one training and one
//! validation `iter()` of multi-threaded loaders per epoch), written out so that reserved
//! memory is read between epochs.

use std::io::Read;
use std::path::Path;

use burn::backend::Autodiff;
use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};
use cubecl_runtime::runtime::Runtime;
use flate2::read::GzDecoder;

use crate::support::child::in_child;
use crate::support::lavapipe::cpu_device;
use crate::support::stock::stock_reserved;

const EPOCHS: usize = 10;
const WORKERS: usize = 4;
const BATCH: usize = 32;
/// Training images an epoch (the first of MNIST's training set).
const TRAIN_IMAGES: usize = 320;
/// Validation images an epoch (the first of MNIST's test set).
const VALID_IMAGES: usize = 128;
const PIXELS: usize = 28 * 28;
/// Hidden units.
const HIDDEN: usize = 64;
/// A small-pool segment (PyTorch's `kSmallBuffer`).
const SMALL_SEGMENT: u64 = 2 << 20;

/// One image, normalised with MNIST's usual mean and standard deviation, and its digit.
#[derive(Clone, Debug)]
struct Item {
    pixels: Vec<f32>,
    label: i64,
}

/// The first `count` images and labels of one split of the MNIST data the repository ships
/// (`examples/mnist/data`, gzip-compressed IDX files).
fn mnist(images: &str, labels: &str, count: usize) -> Vec<Item> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/mnist/data");
    let read = |name: &str, header: usize, bytes: usize| {
        let file = std::fs::File::open(dir.join(name)).expect("MNIST data in examples/mnist/data");
        let mut data = vec![0u8; header + bytes];
        GzDecoder::new(file)
            .read_exact(&mut data)
            .expect("an MNIST IDX file");
        data.split_off(header)
    };
    let pixels = read(images, 16, count * PIXELS);
    let digits = read(labels, 8, count);
    pixels
        .chunks(PIXELS)
        .zip(digits)
        .map(|(image, digit)| Item {
            pixels: image
                .iter()
                .map(|&p| (p as f32 / 255.0 - 0.1307) / 0.3081)
                .collect(),
            label: digit as i64,
        })
        .collect()
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    images: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
}

#[derive(Clone, Default)]
struct ItemBatcher;

impl<B: Backend> Batcher<B, Item, Batch<B>> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let pixels: Vec<f32> = items.iter().flat_map(|item| item.pixels.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|item| item.label).collect();
        Batch {
            images: Tensor::from_data(TensorData::new(pixels, [n, PIXELS]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// 784 -> `HIDDEN` -> 10 with ReLU.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(PIXELS, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, 10).init(device),
            relu: Relu::new(),
        }
    }

    /// The cross-entropy loss of a batch.
    fn loss(&self, batch: Batch<B>) -> Tensor<B, 1> {
        let logits = self
            .output
            .forward(self.relu.forward(self.hidden.forward(batch.images)));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.targets)
    }
}

/// Ten epochs of training and validation on `device`, each through a new `iter()` of a
/// four-worker loader; `reserved` is read after each epoch, once the device has synced.
/// Returns reserved bytes after each epoch and the mean training loss of the first and the
/// last epoch.
fn epochs<B: AutodiffBackend>(
    device: &B::Device,
    reserved: impl Fn() -> u64,
) -> (Vec<u64>, f32, f32) {
    let train = DataLoaderBuilder::<B, _, _>::new(ItemBatcher)
        .batch_size(BATCH)
        .shuffle(7)
        .num_workers(WORKERS)
        .set_device(device.clone())
        .build(InMemDataset::new(mnist(
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz",
            TRAIN_IMAGES,
        )));
    let valid = DataLoaderBuilder::<B::InnerBackend, _, _>::new(ItemBatcher)
        .batch_size(BATCH)
        .num_workers(WORKERS)
        .set_device(device.clone())
        .build(InMemDataset::new(mnist(
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
            VALID_IMAGES,
        )));
    let mut model = Mlp::<B>::new(device);
    let mut optim = AdamConfig::new().init();
    let mut per_epoch = Vec::with_capacity(EPOCHS);
    let mut losses = Vec::with_capacity(EPOCHS);
    for _ in 0..EPOCHS {
        let mut sum = 0.0;
        let mut steps = 0;
        for batch in train.iter() {
            let loss = model.loss(batch);
            sum += loss.clone().into_scalar().elem::<f32>();
            steps += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
        }
        assert_eq!(steps, TRAIN_IMAGES / BATCH, "every training batch ran");
        losses.push(sum / steps as f32);
        let inference = model.valid();
        let mut batches = 0;
        for batch in valid.iter() {
            let loss: f32 = inference.loss(batch).into_scalar().elem();
            assert!(loss.is_finite());
            batches += 1;
        }
        assert_eq!(batches, VALID_IMAGES / BATCH, "every validation batch ran");
        B::sync(device).expect("sync");
        per_epoch.push(reserved());
    }
    (per_epoch, losses[0], losses[EPOCHS - 1])
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

fn print(name: &str, reserved: &[u64], first_loss: f32, last_loss: f32) {
    let epochs: Vec<String> = reserved.iter().map(|&b| mib(b)).collect();
    println!(
        "{name}: reserved after each epoch (MiB): {}; mean training loss {first_loss:.3} -> \
         {last_loss:.3}",
        epochs.join(", ")
    );
}

/// The caching backend's numbers after each epoch, read the way `memory_stats` reports them.
fn caching_reserved(device: &WgpuDevice) -> u64 {
    let stats = backend::memory_stats(device);
    let map = stats.to_map();
    let key = |k: &str| map.get(k).copied().unwrap_or(-1);
    println!(
        "epoch: reserved {} allocated {} segments {} streams {} slot reuses {} stream shares {} \
         live slices {}",
        stats.memory_reserved(),
        stats.memory_allocated(),
        key("segment.all.current"),
        key("cubecl.streams"),
        key("cubecl.slot_reuses"),
        key("num_stream_shares"),
        key("cubecl.live_slices"),
    );
    stats.memory_reserved()
}

/// Runs the loop on the caching backend `C` on the CPU device and returns its reserved bytes
/// after each epoch (printed); with `BURN_CACHING_ALLOC_TRACE=path.json.gz` set, its trace is
/// written there.
fn caching_epochs<C: AutodiffBackend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    name: &str,
) -> Vec<u64> {
    backend::empty_cache(device);
    let (caching, first, last) = epochs::<C>(device, || caching_reserved(device));
    print(name, &caching, first, last);
    assert!(last < first, "{name}: the model learns: {first} -> {last}");
    if std::env::var_os("BURN_CACHING_ALLOC_TRACE").is_some_and(|path| !path.is_empty()) {
        let path = backend::write_trace(device).expect("the trace is written");
        println!("trace written to {}", path.display());
    }
    backend::empty_cache(device);
    caching
}

/// No epoch reserves more than the first plus two 2 MiB small-pool segments (measured: at most
/// one more than the first, unfused, when the first epoch fit in the main thread's segment).
fn assert_bounded(name: &str, reserved: &[u64]) {
    let bound = reserved[0] + 2 * SMALL_SEGMENT;
    for (epoch, &bytes) in reserved.iter().enumerate() {
        assert!(
            bytes <= bound,
            "{name}: reserved after epoch {} is {} MiB, more than epoch 1's {} MiB plus two \
             2 MiB segments: {reserved:?}",
            epoch + 1,
            mib(bytes),
            mib(reserved[0]),
        );
    }
}

/// Fused, against stock `Wgpu` (fused, as with Burn's default features) on the same device:
/// reserved memory does not grow with the epochs (`assert_bounded`) and the model learns.
/// Measured (lavapipe, debug build): `CachingWgpu` 4.0 MiB after every epoch (see the guide's
/// benchmarks chapter for the runs); stock `Wgpu` (every stream slot read, `support::stock`)
/// 72, 136, 200, ... 640: each epoch's workers take new slots with pools of their own.
///
/// burn-fusion keeps each worker's last batch of targets (a 128-byte integer tensor) alive for
/// good (`cubecl.live_slices` grows by eight an epoch): the test runs in a child process
/// (`support::child`), as the live tensors it leaves would disturb the tests after it.
#[test]
fn reserved_memory_stays_level_over_epochs_of_a_multi_threaded_loader_fused() {
    if !in_child(
        "loader_epochs_wgpu::reserved_memory_stays_level_over_epochs_of_a_multi_threaded_loader_fused",
        &[],
    ) {
        return;
    }
    let Some((device, _lock)) = cpu_device() else {
        return;
    };
    let caching = caching_epochs::<Autodiff<CachingWgpu>>(&device, "CachingWgpu");
    let (stock, first, last) =
        epochs::<Autodiff<burn::backend::Wgpu>>(&device, || stock_reserved::<WgpuRuntime>(&device));
    print("stock Wgpu", &stock, first, last);
    WgpuRuntime::client(&device).memory_cleanup();
    assert_bounded("CachingWgpu", &caching);
}

/// Unfused: the same bound. Measured: 2.0 MiB after every epoch. In a child process as
/// well, so that it starts from a device no other test used.
#[test]
fn reserved_memory_stays_level_over_epochs_of_a_multi_threaded_loader_unfused() {
    if !in_child(
        "loader_epochs_wgpu::reserved_memory_stays_level_over_epochs_of_a_multi_threaded_loader_unfused",
        &[],
    ) {
        return;
    }
    let Some((device, _lock)) = cpu_device() else {
        return;
    };
    let caching = caching_epochs::<Autodiff<CachingWgpuUnfused>>(&device, "CachingWgpuUnfused");
    assert_bounded("CachingWgpuUnfused", &caching);
}
