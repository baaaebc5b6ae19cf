//! History through Burn (`backend::record_memory_history`, `dump_snapshot`, `dump_html`) on
//! the wgpu backends, and what the stacks of its blocks hold: the model's code. CubeCL 0.10
//! serves every server call on its device thread, but applies the server's memory layout
//! policy on the caller's thread first; the policy captures the caller's stack there and the
//! server hands it to the engine's allocation (`src/runtime/server/caller_stack.rs`). So a
//! block allocated by a tensor operation names the model's `forward` that called it.
//! `caller_stacks_wgpu` checks the pairing's edge cases.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::alloc::inspect;
use burn_caching_alloc::alloc::{Frame, HistoryOptions, Snapshot, StackResolver, TraceAction};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;

type Device = burn::backend::wgpu::WgpuDevice;

/// The model whose `forward` the allocation stacks must name.
#[derive(Module, Debug)]
struct TinyModel<B: Backend> {
    input: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> TinyModel<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(24, 40).init(device),
            output: LinearConfig::new(40, 3).init(device),
            activation: Relu::new(),
        }
    }

    #[inline(never)]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let hidden = self.activation.forward(self.input.forward(x));
        self.output.forward(hidden)
    }
}

/// A few Adam steps of `TinyModel` on `device` with stacks recorded; returns the snapshot taken
/// with the last step's output still alive.
fn train_with_stacks<B: AutodiffBackend<Device = Device>>(device: &Device) -> Snapshot {
    backend::empty_cache(device);
    backend::record_memory_history(device, HistoryOptions::default());
    let mut model = TinyModel::<B>::new(device);
    let mut optim = AdamConfig::new().init();
    let x = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32; 32 * 24], [32, 24]), device);
    let mut kept = None;
    for _ in 0..3 {
        let y = model.forward(x.clone());
        let loss = y.clone().powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        kept = Some(y);
    }
    let kept = kept.expect("three steps");
    assert_eq!(kept.dims(), [32, 3]);
    let snapshot = backend::memory_snapshot(device);
    backend::record_memory_history(device, HistoryOptions::off());
    drop((kept, x, model, optim));
    backend::empty_cache(device);
    snapshot
}

fn names(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.name.as_str()).collect()
}

/// The resolved stack of every allocation in the history, in order.
fn alloc_frames(snapshot: &Snapshot, resolver: &mut StackResolver) -> Vec<Vec<Frame>> {
    snapshot
        .history
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .map(|e| resolver.frames(e.stack.as_ref().expect("stacks recorded")))
        .collect()
}

fn is_forward(frame: &Frame) -> bool {
    frame.name.contains("TinyModel<") && frame.name.ends_with("::forward")
}

#[test]
fn stacks_of_blocks_allocated_through_burn_name_the_models_forward() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let snapshot = train_with_stacks::<Autodiff<CachingWgpuUnfused>>(&device);
    let mut resolver = StackResolver::new();

    // Every allocation of the forward passes: its stack runs from CubeCL's client call (on
    // the caller's thread, not the device thread) through Burn's operation to the model.
    let allocs = alloc_frames(&snapshot, &mut resolver);
    let in_forward: Vec<&Vec<Frame>> = allocs
        .iter()
        .filter(|frames| frames.iter().any(is_forward))
        .collect();
    println!(
        "{} of {} allocations name TinyModel::forward; one of them, innermost first:",
        in_forward.len(),
        allocs.len()
    );
    for name in names(in_forward.first().expect("a forward allocation"))
        .iter()
        .take(24)
    {
        println!("  {name}");
    }
    // At least the first step's two linear layers' outputs and its activation: recording
    // changes no placement, so later steps' tensors may reuse those slices in CubeCL's pool
    // without an engine event (`BURN_CACHING_ALLOC_TRACE` would show every one).
    assert!(in_forward.len() >= 3, "{}", in_forward.len());
    for frames in &in_forward {
        let names = names(frames);
        let has = |part: &str| names.iter().any(|n| n.contains(part));
        assert!(
            names[0].starts_with("cubecl_runtime::client::ComputeClient"),
            "the stack starts at CubeCL's client call: {names:#?}"
        );
        assert!(
            !has("ChannelDeviceHandle"),
            "not the device thread: {names:#?}"
        );
        assert!(
            !has("EngineStorage") && !has("CallerStackPolicy"),
            "{names:#?}"
        );
        assert!(has("burn_"), "Burn's operation: {names:#?}");
        assert!(
            has("stacks_of_blocks_allocated_through_burn_name_the_models_forward"),
            "down to the test: {names:#?}"
        );
    }

    // The live block of the last step's output (32 x 3 f32) carries the same stack.
    let output_blocks: Vec<Vec<Frame>> = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.requested_size == 32 * 3 * 4)
        .filter_map(|b| b.stack.as_ref().map(|s| resolver.frames(s)))
        .collect();
    assert!(
        output_blocks
            .iter()
            .any(|frames| frames.iter().any(is_forward)),
        "the live output's block names forward: {output_blocks:#?}"
    );

    // The pickle and the viewer carry the model's frames. With HISTORY_VIEWER_OUT set, the
    // page is written there and the output's block named for `#select=S:B` (how
    // docs/src/images/viewer-model-frames.png was rendered).
    let page = inspect::viewer_html(&snapshot, "TinyModel on CachingWgpuUnfused", &[]);
    if let Some(path) = std::env::var_os("HISTORY_VIEWER_OUT") {
        std::fs::write(&path, &page).expect("viewer written");
        for (s, segment) in snapshot.segments.iter().enumerate() {
            for (b, block) in segment.blocks.iter().enumerate() {
                if block.requested_size == 32 * 3 * 4 {
                    println!("the output's block: #select={s}:{b}");
                }
            }
        }
    }
    // The page's embedded data writes `<` as `\u003c` (so no string can end the script).
    assert!(
        page.matches("TinyModel\\u003c").count() > 1,
        "the page carries the model's frames"
    );
    let pickle = inspect::torch_snapshot_pickle(&snapshot, 0);
    let needle = b"::forward";
    assert!(
        pickle.windows(needle.len()).any(|w| w == needle),
        "the pickle carries the model's frames"
    );
}

/// Under Burn's fusion (`CachingWgpu`), operations are registered with burn-fusion's server,
/// which runs on a device thread of its own (`GlobalFusionClient::register` submits through
/// CubeCL's `ChannelDeviceHandle`) and allocates when it executes the queued operations. The
/// CubeCL client call is then made on that thread: the stack names burn-fusion's execution
/// and the operation executed (`RandomOps`, a fused block, ...), never the `forward` that
/// queued it. This test checks exactly that.
#[test]
fn under_fusion_stacks_name_burn_fusions_execution_not_the_model() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let snapshot = train_with_stacks::<Autodiff<CachingWgpu>>(&device);
    let mut resolver = StackResolver::new();
    let allocs = alloc_frames(&snapshot, &mut resolver);
    let fused = allocs
        .iter()
        .filter(|frames| names(frames).iter().any(|n| n.starts_with("burn_fusion::")))
        .count();
    let in_forward = allocs
        .iter()
        .filter(|frames| frames.iter().any(is_forward))
        .count();
    println!(
        "{} allocations: {fused} in burn-fusion's execution, {in_forward} naming forward",
        allocs.len()
    );
    if let Some(frames) = allocs
        .iter()
        .find(|frames| names(frames).iter().any(|n| n.starts_with("burn_fusion::")))
    {
        for name in names(frames).iter().take(24) {
            println!("  {name}");
        }
    }
    assert!(
        fused > 0,
        "fused operations allocate in burn-fusion's execution"
    );
    assert_eq!(
        in_forward, 0,
        "the caller's thread is not where fusion allocates"
    );
}

/// `BURN_CACHING_ALLOC_OOM_SNAPSHOT`, set before the device opens, makes the first
/// out-of-memory write a PyTorch-format snapshot there; the error reaching Burn states what
/// CubeCL's layer holds. Runs in a child process: the variable is read when the device opens.
#[test]
fn the_oom_snapshot_variable_writes_a_snapshot_at_the_first_out_of_memory() {
    use std::ffi::OsStr;

    use crate::MIB;

    use crate::support::child::in_child;

    const VAR: &str = burn_caching_alloc::runtime::OOM_SNAPSHOT_ENV;
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let path = std::env::temp_dir().join(format!("oom-env-{}.pickle", std::process::id()));
    let test =
        "history_wgpu::the_oom_snapshot_variable_writes_a_snapshot_at_the_first_out_of_memory";
    if !in_child(test, &[(VAR, Some(OsStr::new(&path)))]) {
        let _ = std::fs::remove_file(&path);
        return;
    }
    let path = std::path::PathBuf::from(std::env::var_os(VAR).expect("set by the parent"));
    let _ = std::fs::remove_file(&path);
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = seen.clone();
    backend::on_out_of_memory(&device, move |err| {
        assert!(err.is_out_of_memory());
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    let total = backend::memory_stats(&device).device.total;
    backend::set_per_process_memory_fraction(&device, (32 * MIB) as f64 / total as f64)
        .expect("valid fraction");
    let live = Tensor::<CachingWgpu, 1>::ones([4 * MIB as usize], &device); // 16 MiB
    let err = Tensor::<CachingWgpu, 1>::ones([5 * MIB as usize], &device) // 20 MiB more
        .try_into_data()
        .expect_err("36 MiB cannot fit under a 32 MiB cap");
    let message = format!("{err:?}");
    assert!(message.contains("largest free block"), "{message}");
    assert!(message.contains("CubeCL's layer holds"), "{message}");
    // Observers run on the allocator's own thread, not inside the server's task: wait for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while seen.load(std::sync::atomic::Ordering::SeqCst) == 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one failed tensor, one observer call"
    );
    let bytes = std::fs::read(&path).expect("the snapshot was written at the first OOM");
    assert_eq!(&bytes[..2], &[0x80, 2], "a pickle");
    drop(live);
    backend::set_per_process_memory_fraction(&device, 1.0).expect("valid fraction");
    backend::empty_cache(&device);
}
