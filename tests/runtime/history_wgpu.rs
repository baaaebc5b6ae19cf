//! History through Burn (`backend::record_memory_history`, `dump_snapshot`, `dump_html`) on
//! `CachingWgpu`, and what the stacks captured at the engine's `malloc` hold there: CubeCL 0.10
//! runs every server call on its device thread (`ChannelDeviceHandle`, one thread per device
//! on native targets), so a stack shows CubeCL's request (`ComputeClient`) down to the engine,
//! and not the model code that called the tensor operation, which ran on another thread.

use burn::tensor::Tensor;
use burn_caching_alloc::alloc::{HistoryOptions, StackResolver, TraceAction};
use burn_caching_alloc::backend::{self, CachingWgpu};

use crate::support::lavapipe::cpu_device;

type B = CachingWgpu;

/// The "model": the function whose name the allocation stacks must hold.
#[inline(never)]
fn tiny_model_forward(device: &burn::backend::wgpu::WgpuDevice) -> Tensor<B, 2> {
    let x = Tensor::<B, 2>::ones([123, 77], device);
    let w = Tensor::<B, 2>::ones([77, 31], device);
    x.matmul(w)
}

#[test]
fn stacks_through_burn_show_cubecls_request_served_on_its_device_thread() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    backend::record_memory_history(&device, HistoryOptions::default());
    let y = tiny_model_forward(&device);
    assert_eq!(y.clone().into_data().to_vec::<f32>().expect("f32")[0], 77.0);

    let snapshot = backend::memory_snapshot(&device);
    let mut resolver = StackResolver::new();
    let allocs: Vec<_> = snapshot
        .history
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .collect();
    assert!(allocs.len() >= 3, "x, w and y: {:?}", snapshot.history);
    let stacks: Vec<Vec<String>> = allocs
        .iter()
        .map(|e| {
            resolver
                .frames(e.stack.as_ref().expect("stacks recorded"))
                .into_iter()
                .map(|f| f.name)
                .collect()
        })
        .collect();
    println!("frames of one allocation through Burn, innermost first:");
    for name in stacks[0].iter().take(14) {
        println!("  {name}");
    }
    for names in &stacks {
        let has = |part: &str| names.iter().any(|n| n.contains(part));
        // The capture and the allocator's entry point are not in the stack: it starts at the
        // caller of `malloc`, CubeCL's storage.
        assert!(
            !has("Stack::capture") && !has("CachingAllocator"),
            "{names:#?}"
        );
        assert!(has("EngineStorage"), "{names:#?}");
        // CubeCL's request, served on its device thread.
        assert!(has("cubecl_runtime::client::ComputeClient"), "{names:#?}");
        assert!(has("ChannelDeviceHandle"), "{names:#?}");
        assert!(
            !has("tiny_model_forward"),
            "on the caller's thread after all: {names:#?}"
        );
    }

    let dir = std::env::temp_dir();
    let pickle = dir.join(format!("burn-history-{}.pickle", std::process::id()));
    let html = dir.join(format!("burn-history-{}.html", std::process::id()));
    backend::dump_snapshot(&device, &pickle).expect("snapshot written");
    backend::dump_html(&device, &html).expect("viewer written");
    assert_eq!(&std::fs::read(&pickle).expect("read")[..2], &[0x80, 2]);
    let page = std::fs::read_to_string(&html).expect("read");
    assert!(page.contains("CubeCL layer: cached in free slices"));
    assert!(
        page.contains("ComputeClient"),
        "the page carries the stacks"
    );
    let _ = std::fs::remove_file(pickle);
    let _ = std::fs::remove_file(html);

    backend::record_memory_history(&device, HistoryOptions::off());
    drop(y);
    backend::empty_cache(&device);
}

/// `BURN_CACHING_ALLOC_OOM_SNAPSHOT`, set before the device opens, makes the first
/// out-of-memory write a PyTorch-format snapshot there; the error reaching Burn states what
/// CubeCL's layer holds. Runs in a child process: the variable is read when the device opens.
#[test]
fn the_oom_snapshot_variable_writes_a_snapshot_at_the_first_out_of_memory() {
    use std::ffi::OsStr;

    use burn_caching_alloc::alloc::MIB;

    use crate::support::child::in_child;

    const VAR: &str = "BURN_CACHING_ALLOC_OOM_SNAPSHOT";
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
    let live = Tensor::<B, 1>::ones([4 * MIB as usize], &device); // 16 MiB
    let err = Tensor::<B, 1>::ones([5 * MIB as usize], &device) // 20 MiB more
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
