//! An MLP (784-128-10) trained on MNIST on Burn 0.22.1's stock `Wgpu` backend, with and without
//! the caching engine underneath, must learn the same: same losses, step by step.
//!
//! The hook is process-wide and only storage created after it is installed uses it, so one
//! process holds both runs: the stock run first, on `DeviceKind::DefaultDevice`, before
//! `install_wgpu`; then the hook is installed and the same training runs on a second logical
//! device on the same adapter (`DeviceKind::Cpu` on a software adapter such as lavapipe,
//! `DiscreteGpu(0)` otherwise; `BURN022_TEST_HOOKED_KIND=cpu|discrete|integrated` overrides),
//! which CubeCL opens with its own wgpu device, so its memory comes from the engine.
//!
//! The weights come from a seeded generator on the host, the batches are the first
//! `STEPS * BATCH` training images in file order, and the optimizer is plain SGD: the two runs
//! differ only in where their buffers live.
//!
//! On a CPU: `VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json cargo test --test mnist_hook -- --nocapture`

mod common;

use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, Relu};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, DeviceKind, Int, Tensor, TensorData};
use burn_022_caching_hook::caching_alloc_engine::alloc::AllocatorConfig;
use burn_022_caching_hook::caching_alloc_engine::registry::{self, DeviceKey};
use burn_022_caching_hook::{WgpuHook, install_wgpu};

const STEPS: usize = 30;
const BATCH: usize = 64;
const HIDDEN: usize = 128;
const CLASSES: usize = 10;
const LEARNING_RATE: f64 = 0.2;
const SEED: u64 = 0x5eed_0022;
/// Largest relative difference allowed between the two runs' losses.
const TOLERANCE: f32 = 1e-4;
/// Bytes of the model's parameters (f32): what the engine holds at least during training.
const PARAM_BYTES: u64 =
    ((common::IMAGE_PIXELS * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES) * 4) as u64;

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    activation: Relu,
    output: Linear,
}

impl Mlp {
    /// Kaiming-uniform-like weights, `U(-k, k)` with `k = 1/sqrt(d_input)`, from `rng`.
    fn new(rng: &mut SplitMix64, device: &Device) -> Self {
        Self {
            hidden: linear(common::IMAGE_PIXELS, HIDDEN, rng, device),
            activation: Relu::new(),
            output: linear(HIDDEN, CLASSES, rng, device),
        }
    }

    fn forward(&self, input: Tensor<2>) -> Tensor<2> {
        let x = self.activation.forward(self.hidden.forward(input));
        self.output.forward(x)
    }
}

fn linear(d_input: usize, d_output: usize, rng: &mut SplitMix64, device: &Device) -> Linear {
    let k = 1.0 / (d_input as f32).sqrt();
    let weight: Vec<f32> = (0..d_input * d_output)
        .map(|_| rng.uniform(-k, k))
        .collect();
    let bias: Vec<f32> = (0..d_output).map(|_| rng.uniform(-k, k)).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(weight, [d_input, d_output]),
            device,
        )),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(bias, [d_output]),
            device,
        ))),
    }
}

/// A small seeded generator, so both runs start from the same weights whatever the device.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, low: f32, high: f32) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        low + (high - low) * unit
    }
}

/// What one run saw: the loss of each step, and the engine's allocated bytes after each
/// step's forward pass (empty without a hook).
struct Run {
    losses: Vec<f32>,
    engine_allocated: Vec<u64>,
    /// The first step's time: CubeCL compiles (and autotunes) its kernels for this device then.
    first_step: Duration,
}

/// `STEPS` steps of SGD on `device`, with autodiff; reads the engine `hook` names, if any.
fn train(device: &Device, data: &common::Mnist, hook: Option<&WgpuHook>) -> Run {
    let device = device.clone().autodiff();
    let mut rng = SplitMix64(SEED);
    let mut model = Mlp::new(&mut rng, &device);
    let mut optim = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut run = Run {
        losses: Vec::with_capacity(STEPS),
        engine_allocated: Vec::new(),
        first_step: Duration::ZERO,
    };

    let timer = Instant::now();
    for step in 0..STEPS {
        let start = step * BATCH;
        let images = Tensor::<2>::from_data(
            TensorData::new(data.images_f32(start, BATCH), [BATCH, common::IMAGE_PIXELS]),
            &device,
        );
        let labels = Tensor::<1, Int>::from_data(
            TensorData::new(data.labels_i64(start, BATCH), [BATCH]),
            &device,
        );
        let logits = model.forward(images);
        let loss = loss_fn.forward(logits, labels);
        // Reading the loss runs the forward pass: the parameters and activations are live now.
        run.losses.push(loss.clone().into_scalar::<f32>());
        if let Some(hook) = hook {
            let engine = hook
                .engine(0)
                .expect("the hooked device allocated in the engine");
            run.engine_allocated.push(engine.stats().memory_allocated());
        }

        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LEARNING_RATE, model, grads);
        if step == 0 {
            run.first_step = timer.elapsed();
        }
    }
    device.sync().expect("sync after training");
    run
}

/// The second logical device on the adapter `DefaultDevice` lands on.
fn second_device_kind(stock: &Device) -> DeviceKind {
    match std::env::var("BURN022_TEST_HOOKED_KIND").as_deref() {
        Ok("cpu") => return DeviceKind::Cpu,
        Ok("discrete") => return DeviceKind::DiscreteGpu(0),
        Ok("integrated") => return DeviceKind::IntegratedGpu(0),
        Ok(other) => {
            panic!("BURN022_TEST_HOOKED_KIND={other}: expected cpu, discrete or integrated")
        }
        Err(_) => {}
    }
    // A device that is no card (a software rasterizer, a CPU) is wgpu's `Cpu` adapter.
    match stock.identity().and_then(|identity| identity.physical) {
        None => DeviceKind::Cpu,
        Some(_) => DeviceKind::DiscreteGpu(0),
    }
}

fn show(name: &str, losses: &[f32]) {
    let fmt = |values: &[f32]| {
        values
            .iter()
            .map(|v| format!("{v:.6}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "{name:<8} losses: first [{}] ... last [{}]",
        fmt(&losses[..5]),
        fmt(&losses[losses.len() - 5..])
    );
}

#[test]
fn mnist_mlp_trains_the_same_with_and_without_the_engine() {
    let data = common::load_train(STEPS * BATCH);
    assert_eq!(data.labels[0], 5, "MNIST's first training label is 5");

    // 1. Stock: no hook installed yet, so CubeCL's own pools hold this device's memory.
    let stock_device = Device::wgpu(DeviceKind::DefaultDevice);
    let timer = Instant::now();
    let stock = train(&stock_device, &data, None);
    let stock_time = timer.elapsed();
    assert!(
        registry::engine(DeviceKey::new("wgpu", 0)).is_none(),
        "an engine exists before the hook was installed"
    );
    let stock_usage = stock_device.memory_pool_usage();

    // 2. Hooked: the same training on a second logical device, opened after the hook.
    let hook = install_wgpu(Some(AllocatorConfig::default())).expect("install the hook");
    let hooked_device = Device::wgpu(second_device_kind(&stock_device));
    assert_ne!(hooked_device, stock_device, "two logical devices");
    let timer = Instant::now();
    let hooked = train(&hooked_device, &data, Some(hook));
    let hooked_time = timer.elapsed();

    let stock_name = stock_device.identity().map(|identity| identity.name);
    let hooked_name = hooked_device.identity().map(|identity| identity.name);
    println!("stock device  {stock_device:?} on {stock_name:?}");
    println!("hooked device {hooked_device:?} on {hooked_name:?}");
    assert_eq!(
        stock_name, hooked_name,
        "both devices are on the same adapter"
    );
    show("stock", &stock.losses);
    show("hooked", &hooked.losses);
    println!("stock losses:  {:?}", stock.losses);
    println!("hooked losses: {:?}", hooked.losses);
    println!(
        "stock run {stock_time:.2?} (first step {:.2?}), hooked run {hooked_time:.2?} (first step {:.2?})",
        stock.first_step, hooked.first_step
    );

    // (a) The model learns.
    let mean = |values: &[f32]| values.iter().sum::<f32>() / values.len() as f32;
    let (first, last) = (mean(&hooked.losses[..5]), mean(&hooked.losses[STEPS - 5..]));
    assert!(
        (1.9..2.7).contains(&hooked.losses[0]),
        "the first loss {} is not near ln(10)",
        hooked.losses[0]
    );
    assert!(
        last < 0.75 * first,
        "the loss did not decrease: mean of the first five steps {first}, of the last five {last}"
    );
    assert!(hooked.losses.iter().all(|loss| loss.is_finite()));

    // (b) The engine changes where the buffers are, not what is computed.
    let mut worst = 0f32;
    for (step, (&a, &b)) in hooked.losses.iter().zip(&stock.losses).enumerate() {
        let relative = (a - b).abs() / b.abs().max(f32::MIN_POSITIVE);
        worst = worst.max(relative);
        assert!(
            relative <= TOLERANCE,
            "step {step}: hooked loss {a} vs stock loss {b} (relative difference {relative:e})"
        );
    }
    println!("largest relative difference between the runs: {worst:e}");

    // The hooked device's tensors were in the engine throughout: at least the parameters.
    let engine = hook.engine(0).expect("the hooked device's engine");
    println!(
        "engine allocated after each forward pass: min {} B, max {} B (parameters: {PARAM_BYTES} B)",
        hooked.engine_allocated.iter().min().unwrap(),
        hooked.engine_allocated.iter().max().unwrap()
    );
    assert!(
        hooked
            .engine_allocated
            .iter()
            .all(|&bytes| bytes >= PARAM_BYTES),
        "the engine held less than the parameters at some step: {:?}",
        hooked.engine_allocated
    );
    let stats = engine.stats();
    println!(
        "engine after training: allocated {} B, reserved {} B, peak allocated {} B, device allocations {}",
        stats.memory_allocated(),
        stats.memory_reserved(),
        stats.max_memory_allocated(),
        stats.num_device_alloc
    );

    // ... and the stock device's were not: one engine only, which the stock device does not
    // touch when it allocates again.
    assert!(hook.engine(1).is_none(), "the stock device got an engine");
    let (allocated_total, device_allocs) =
        (stats.allocated_bytes.all.allocated, stats.num_device_alloc);
    // Read back, not summed: stock `sum` on lavapipe (Burn 0.22.1) is wrong from 2^18 elements,
    // hook or not.
    let values: Vec<f32> = (0..1 << 18).map(|i| (i % 97) as f32).collect();
    let probe = Tensor::<1>::from_data(TensorData::new(values.clone(), [1 << 18]), &stock_device);
    assert_eq!(probe.to_data().as_slice::<f32>().unwrap(), &values[..]);
    stock_device.sync().expect("sync");
    let after = engine.stats();
    assert_eq!(
        (after.allocated_bytes.all.allocated, after.num_device_alloc),
        (allocated_total, device_allocs),
        "a tensor on the stock device went to the engine"
    );
    assert!(hook.engine(1).is_none(), "the stock device got an engine");
    if let Some(usage) = stock_usage {
        println!(
            "stock device after its run (CubeCL's own pools): {} allocs, {} B in use, {} B reserved",
            usage.number_allocs, usage.bytes_in_use, usage.bytes_reserved
        );
        assert!(
            usage.bytes_reserved > 0,
            "the stock device's memory is CubeCL's"
        );
    }
}
