//! Memory scopes and phases through Burn on the wgpu CPU adapter (lavapipe in CI), on the fused
//! `CachingWgpu` and on `CachingWgpuUnfused`: a scope counts exactly the blocks of the tensors
//! made inside it (fused operations execute on burn-fusion's thread, inside the caller's
//! stream), not another thread's, and gives them back when they drop; a slice CubeCL reuses
//! counts under the scope of the tensor that reuses it; phases reach the history.

use std::time::Instant;

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_caching_alloc::alloc::{HistoryOptions, PhaseStage, TraceAction};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;

/// The live bytes of scope `name` (after CubeCL's free slices were handed back).
fn scope_bytes(device: &WgpuDevice, name: &str) -> u64 {
    backend::memory_stats(device)
        .engine
        .scopes
        .get(name)
        .map_or(0, |s| s.current)
}

/// Tensors made inside scopes, checked after each step.
fn scopes_count_the_tensors_made_inside<B: Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    prefix: &str,
) {
    let weights = format!("{prefix}.weights");
    let acts = format!("{prefix}.activations");
    let before_outside = Tensor::<B, 2>::ones([64, 64], device);
    let w = {
        let _scope = backend::memory_scope(device, &weights);
        Tensor::<B, 2>::ones([256, 256], device)
    };
    assert_eq!(scope_bytes(device, &weights), 256 * 256 * 4);
    let (a, b) = {
        let _scope = backend::memory_scope(device, &acts);
        // Element-wise results (fused into one kernel under fusion), and a padded copy that
        // the addition consumes (in place, or into a new tensor while the copy drops).
        let a = (w.clone() * 2.0).exp();
        let b = before_outside.clone().pad((0, 192, 0, 192), 0.0) + w.clone();
        (a, b)
    };
    assert_eq!(scope_bytes(device, &weights), 256 * 256 * 4, "unchanged");
    assert_eq!(scope_bytes(device, &acts), 2 * 256 * 256 * 4);
    // Another thread's tensor, made while this thread's scope is active, is not the scope's.
    let other = {
        let _scope = backend::memory_scope(device, &acts);
        let dev = device.clone();
        std::thread::spawn(move || {
            let t = Tensor::<B, 1>::ones([4096], &dev);
            // Settled on that thread, so that it is allocated before the scope ends.
            let _ = backend::memory_allocated(&dev);
            t
        })
        .join()
        .expect("the thread runs")
    };
    assert_eq!(scope_bytes(device, &acts), 2 * 256 * 256 * 4);
    // A tensor of `a`'s size made outside any scope just after `a` dropped reuses its CubeCL
    // slice (CubeCL's exact-size reuse, before anything is handed back to the engine): that
    // block is no longer the scope's.
    drop(a);
    let reuse = Tensor::<B, 2>::zeros([256, 256], device);
    assert_eq!(scope_bytes(device, &acts), 256 * 256 * 4);
    drop((b, w, reuse, other, before_outside));
    assert_eq!(scope_bytes(device, &acts), 0);
    assert_eq!(scope_bytes(device, &weights), 0);
    let stats = backend::memory_stats(device).engine.to_map();
    assert_eq!(
        stats[&format!("scope.{acts}.allocated_bytes.peak")],
        2 * 256 * 256 * 4
    );
    backend::empty_cache(device);
}

#[test]
fn a_scope_counts_exactly_the_tensors_made_inside_it_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    scopes_count_the_tensors_made_inside::<CachingWgpu>(&device, "fused");
}

#[test]
fn a_scope_counts_exactly_the_tensors_made_inside_it_unfused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    scopes_count_the_tensors_made_inside::<CachingWgpuUnfused>(&device, "unfused");
}

#[test]
fn phases_and_scopes_reach_the_history_in_order() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::record_memory_history(&device, HistoryOptions::default());
    let x = Tensor::<CachingWgpu, 2>::ones([128, 128], &device);
    let y = {
        let _phase = backend::annotate(&device, "forward");
        let _scope = backend::memory_scope(&device, "phase.forward");
        (x.clone() + 1.0).tanh()
    };
    let snapshot = backend::memory_snapshot(&device);
    backend::record_memory_history(&device, HistoryOptions::off());
    let marks: Vec<(&str, PhaseStage)> = snapshot
        .phases
        .iter()
        .map(|m| (m.name.as_str(), m.stage))
        .collect();
    assert_eq!(
        marks,
        [("forward", PhaseStage::Start), ("forward", PhaseStage::End)]
    );
    let (start, end) = (snapshot.phases[0].time_us, snapshot.phases[1].time_us);
    let tagged: Vec<u64> = snapshot
        .history
        .iter()
        .filter(|e| e.action == TraceAction::Alloc && e.user_metadata == "phase.forward")
        .map(|e| e.time_us)
        .collect();
    assert!(
        !tagged.is_empty(),
        "the forward's allocations carry its scope"
    );
    assert!(
        tagged.iter().all(|t| (start..=end).contains(t)),
        "the forward's allocations fall inside its phase: {start}..{end} {tagged:?}"
    );
    let live_tagged = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.scope.as_deref() == Some("phase.forward"))
        .count();
    assert_eq!(live_tagged, 1, "y's block");
    // Read back, so that no kernel is still being compiled when the process exits (lavapipe's
    // compiler threads can crash a process that exits under them).
    let _ = y.into_data();
    drop(x);
    backend::empty_cache(&device);
}

/// The cost of one empty scope (begin and end) against one small tensor operation, with and
/// without fusion: a measurement for docs/src/benchmarks.md, not a check
/// (`cargo test --all-features --test runtime -- --ignored scope_cost --nocapture`).
#[test]
#[ignore = "a measurement, printed: run it with --ignored --nocapture"]
fn scope_cost() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    fn measure<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice, name: &str) {
        const N: u32 = 2000;
        let x = Tensor::<B, 1>::ones([256], device);
        let mut y = x.clone();
        let _ = backend::memory_allocated(device);
        let t = Instant::now();
        for _ in 0..N {
            y = y + 1.0;
        }
        let _ = backend::memory_allocated(device);
        let op = t.elapsed() / N;
        let t = Instant::now();
        for _ in 0..N {
            let _scope = backend::memory_scope(device, "cost");
        }
        let scope = t.elapsed() / N;
        let t = Instant::now();
        for _ in 0..N {
            let _scope = backend::memory_scope(device, "cost");
            y = y + 1.0;
        }
        let _ = backend::memory_allocated(device);
        let scoped_op = t.elapsed() / N;
        println!(
            "{name}: one add {op:?}; one empty scope {scope:?} ({:.1} adds); one add in its own \
             scope {scoped_op:?} ({:.1}x the add)",
            scope.as_secs_f64() / op.as_secs_f64(),
            scoped_op.as_secs_f64() / op.as_secs_f64()
        );
        drop((x, y));
    }
    measure::<CachingWgpu>(&device, "fused");
    measure::<CachingWgpuUnfused>(&device, "unfused");
    backend::empty_cache(&device);

    // How much of a longer chain (burn-fusion executes fused blocks lazily, before the scope
    // ends) a scope sees: its peak against the growth of the allocated peak.
    fn coverage<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice, name: &str) {
        let x = Tensor::<B, 2>::ones([128, 128], device);
        let ws: Vec<_> = (0..6)
            .map(|_| Tensor::<B, 2>::ones([128, 128], device).mul_scalar(0.01))
            .collect();
        backend::reset_peak_memory_stats(device);
        let base = backend::memory_stats(device).max_memory_allocated();
        let scope = format!("coverage.{name}");
        let out = {
            let _scope = backend::memory_scope(device, &scope);
            let mut h = x.clone();
            for w in &ws {
                h = (h.matmul(w.clone()) + 0.5).tanh() * 2.0 - 1.0;
            }
            h
        };
        let stats = backend::memory_stats(device);
        let grew = stats.max_memory_allocated() - base;
        let seen = stats.engine.scopes.get(&scope).map_or(0, |s| s.peak);
        println!("{name}: a 6-layer chain's peak growth {grew} B, its scope's peak {seen} B");
        drop((x, ws, out));
    }
    coverage::<CachingWgpu>(&device, "fused");
    coverage::<CachingWgpuUnfused>(&device, "unfused");
    backend::empty_cache(&device);
}
