//! Out-of-memory observers on `CachingWgpuUnfused` (lavapipe in CI): one failed tensor is one
//! out-of-memory (`num_ooms` once, each observer once), and an observer may use the backend's
//! memory API (`memory_stats`, `empty_cache`) without deadlock, stale numbers or a lost
//! tensor, while a panicking observer beside it is reported and changes nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, Once};
use std::time::Duration;

use crate::MIB;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;

type B = CachingWgpuUnfused;

/// Observers stay registered on the process's device: they act only while this test arms them.
static ARMED: AtomicBool = AtomicBool::new(false);
static REPORTS: Mutex<Option<Sender<Observed>>> = Mutex::new(None);
static REGISTER: Once = Once::new();

/// What the observer saw through the backend's API.
#[derive(Debug)]
struct Observed {
    message: String,
    num_ooms: u64,
    reserved_before_empty: u64,
    reserved_after_empty: u64,
}

/// Gives the whole device back when the test ends, passed or failed.
struct Uncap<'a>(&'a WgpuDevice);

impl Drop for Uncap<'_> {
    fn drop(&mut self) {
        ARMED.store(false, Ordering::SeqCst);
        let _ = backend::set_per_process_memory_fraction(self.0, 1.0);
    }
}

#[test]
fn observers_may_use_the_memory_api_and_a_failed_tensor_is_one_out_of_memory() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    REGISTER.call_once(|| {
        backend::on_out_of_memory(&device, |_| {
            if ARMED.load(Ordering::SeqCst) {
                panic!("an observer that panics");
            }
        });
        backend::on_out_of_memory(&device, |err| {
            if !ARMED.load(Ordering::SeqCst) {
                return;
            }
            let device = WgpuDevice::Cpu;
            let stats = backend::memory_stats(&device);
            backend::empty_cache(&device);
            let after = backend::memory_stats(&device);
            let observed = Observed {
                message: err.to_string(),
                num_ooms: stats.engine.num_ooms,
                reserved_before_empty: stats.memory_reserved(),
                reserved_after_empty: after.memory_reserved(),
            };
            if let Some(sender) = REPORTS.lock().expect("reports").as_ref() {
                let _ = sender.send(observed);
            }
        });
    });
    let (sender, reports) = channel();
    *REPORTS.lock().expect("reports") = Some(sender);

    backend::empty_cache(&device);
    let before = backend::memory_stats(&device);
    let total = before.device.total;
    let limit = 64 * MIB;
    let _uncap = Uncap(&device);
    backend::set_per_process_memory_fraction(&device, limit as f64 / total as f64)
        .expect("valid fraction");
    ARMED.store(true, Ordering::SeqCst);

    // 24 MiB live; 48 MiB cannot fit beside it under a 64 MiB cap.
    let live = Tensor::<B, 1>::ones([6 * MIB as usize], &device);
    let too_big = Tensor::<B, 1>::ones([12 * MIB as usize], &device);
    let err = too_big
        .try_into_data()
        .expect_err("48 MiB beside 24 MiB cannot fit in 64 MiB");
    assert!(format!("{err:?}").contains("out of memory"), "{err:?}");

    let observed = reports
        .recv_timeout(Duration::from_secs(120))
        .expect("the observer ran, and could call the backend from where it runs");
    ARMED.store(false, Ordering::SeqCst);
    assert!(observed.message.contains("out of memory"), "{observed:?}");
    // Not stale: the observer's numbers already count this failure, once.
    assert_eq!(
        observed.num_ooms,
        before.engine.num_ooms + 1,
        "{observed:?}"
    );
    assert!(observed.reserved_before_empty >= 24 * MIB, "{observed:?}");
    assert!(
        observed.reserved_after_empty >= 24 * MIB,
        "the live tensor's segment stays"
    );
    assert!(
        reports.recv_timeout(Duration::from_millis(500)).is_err(),
        "one failed tensor, one observer call"
    );
    let stats = backend::memory_stats(&device);
    assert_eq!(
        stats.engine.num_ooms,
        before.engine.num_ooms + 1,
        "one failed tensor is one out-of-memory"
    );

    // No tensor was lost, and the server goes on after the panicking observer.
    let values = live.clone().into_data().to_vec::<f32>().expect("f32");
    let wrong = values.iter().filter(|value| **value != 1.0).count();
    assert_eq!(wrong, 0, "the live tensor's values changed");
    let a = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]), &device);
    let head = live.clone().narrow(0, 0, 3);
    assert_eq!(
        (a + head).into_data().to_vec::<f32>().expect("f32"),
        vec![2.0, 3.0, 4.0]
    );

    *REPORTS.lock().expect("reports") = None;
    backend::set_per_process_memory_fraction(&device, 1.0).expect("valid fraction");
    drop(live);
    backend::empty_cache(&device);
    // What this test reserved went back (tests before it may have left fused work queued).
    assert!(
        backend::memory_stats(&device).memory_reserved() <= before.memory_reserved(),
        "the test's memory stayed reserved"
    );
}
