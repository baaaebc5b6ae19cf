//! A failed request corrupts no live tensor, through CubeCL's client on fake device 8 (64 MiB):
//! PyTorch's contract is that a failed allocation raises (`DeviceCachingAllocator::malloc`'s
//! `OutOfMemoryError`) and every live tensor keeps its values. The server leaves a failed
//! tensor's handle unbound, and CubeCL resolves an unbound handle to the stream's first slice;
//! before the stream's guard slice (`StreamMemory`), the bytes of a failed `create` were written
//! into whatever tensor held that slice, and reads and copies of the failed tensor read it (on
//! CUDA, a kernel's output larger than that slice is written past it: out-of-bounds device
//! writes, which the fake reports).
//!
//! Each scenario: a (20 MiB), b (20 MiB), c (16 MiB) live with distinct bytes; a 16 MiB
//! `create` fails a way of its own; its read, a second read, a copy of it and `get_resource`
//! all fail with its error; a, b and c read back exact; the next request works; the fake logs
//! no violation. Nothing here launches a kernel over the failed tensor (the wgpu tests do).

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::MemPoolOptions;
use burn_caching_alloc::backend::{self, MemPool, use_mem_pool};
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_common::future::block_on;
use cubecl_ir::{ElemType, UIntKind};
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::{CopyDescriptor, Handle};
use parking_lot::Mutex;

use crate::MIB;
use crate::fake_cuda::{Driver, fake_or_skip};

/// The tests of this file share device 8: one at a time.
static DEVICE_8: Mutex<()> = Mutex::new(());

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
        .collect()
}

/// Caps the device at `mib` MiB beyond what it reserves now (no cap where that is its whole
/// memory, as on the fake's 64 MiB device), failing fast with `throw`, until dropped.
struct Capped(CudaDevice);

impl Capped {
    fn new(device: &CudaDevice, mib: u64, throw: bool) -> Self {
        let stats = backend::memory_stats(device);
        let limit = stats.memory_reserved() + mib * MIB;
        let fraction = (limit as f64 / stats.device.total as f64).min(1.0);
        backend::set_per_process_memory_fraction(device, fraction).expect("valid fraction");
        if throw {
            backend::set_allocator_settings(device, "throw_on_cudamalloc_oom:True")
                .expect("setting");
        }
        Self(device.clone())
    }
}

impl Drop for Capped {
    fn drop(&mut self) {
        let _ = backend::set_allocator_settings(&self.0, "throw_on_cudamalloc_oom:False");
        let _ = backend::set_per_process_memory_fraction(&self.0, 1.0);
    }
}

/// A copy of `handle` (`len` bytes) to the same device: the server's `send` and `recv`.
fn copy_of(client: &mut ComputeClient<CachingCudaRuntime>, handle: &Handle, len: usize) -> Handle {
    let desc = CopyDescriptor::new(handle.clone().binding(), [len].into(), [1].into(), 1);
    let same = client.clone();
    client.to_client_tensor(desc, &same, ElemType::UInt(UIntKind::U8))
}

fn assert_exact(client: &ComputeClient<CachingCudaRuntime>, live: &[(Handle, Vec<u8>)]) {
    for (n, (handle, bytes)) in live.iter().enumerate() {
        let read = client
            .read_one(handle.clone())
            .expect("a live tensor reads");
        if let Some(at) = read.iter().zip(bytes).position(|(r, b)| r != b) {
            panic!(
                "live tensor {n} changed: byte {at} of {} reads {}, not {}",
                bytes.len(),
                read[at],
                bytes[at]
            );
        }
    }
}

/// One scenario on device 8: the device capped at `cap_mib` MiB (failing fast with `throw`),
/// the failing `create` made in a private pool with `in_pool`; its error names `expected`.
fn scenario(driver: &Driver, name: &str, cap_mib: u64, throw: bool, in_pool: bool, expected: &str) {
    let _turn = DEVICE_8.lock();
    let _real = driver.real_turn();
    let device = CudaDevice::new(driver.ordinal(8));
    let mut client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    backend::empty_cache(&device);
    let _capped = Capped::new(&device, cap_mib, throw);
    let live: Vec<(Handle, Vec<u8>)> = [(20, 2u8), (20, 3), (16, 4)]
        .into_iter()
        .map(|(mib, seed)| {
            let bytes = pattern((mib * MIB) as usize, seed);
            (client.create(Bytes::from_bytes_vec(bytes.clone())), bytes)
        })
        .collect();
    client.flush().expect("three live tensors");

    let len = (16 * MIB) as usize;
    let pool = in_pool.then(|| MemPool::new(&device, MemPoolOptions::default()).expect("pool"));
    let failed = {
        let _inside = pool.as_ref().map(use_mem_pool);
        client.create(Bytes::from_bytes_vec(vec![7u8; len]))
    };
    let err = client
        .read_one(failed.clone())
        .expect_err("the 16 MiB request fails");
    assert!(format!("{err:?}").contains(expected), "{name}: {err:?}");
    assert_exact(&client, &live);

    // Every later use fails with the request's error and touches nothing.
    let again = client
        .read_one(failed.clone())
        .expect_err("a failed tensor has no bytes");
    assert!(format!("{again:?}").contains(expected), "{name}: {again:?}");
    let copy = copy_of(&mut client, &failed, len);
    let copied = client
        .read_one(copy)
        .expect_err("a copy of a failed tensor fails");
    assert!(
        format!("{copied:?}").contains(expected),
        "{name}: {copied:?}"
    );
    let resource = client
        .get_resource(failed.clone())
        .expect_err("a failed tensor has no device memory");
    assert!(
        format!("{resource:?}").contains(expected),
        "{name}: {resource:?}"
    );
    block_on(client.sync()).expect("every error was reported");
    assert_exact(&client, &live);

    drop(failed);
    let next = pattern(4 * MIB as usize, 9);
    let handle = client.create(Bytes::from_bytes_vec(next.clone()));
    assert_exact(&client, &[(handle, next)]);
    assert_exact(&client, &live);
    drop(live);
    drop(pool);
    backend::empty_cache(&device);
    if let Some(fake) = driver.fake() {
        fake.assert_no_violations();
    }
}

#[test]
fn an_out_of_memory_create_changes_no_live_tensor() {
    let Some(driver) = fake_or_skip() else { return };
    scenario(&driver, "out of memory", 64, false, false, "out of memory");
}

#[test]
fn a_create_rejected_by_throw_on_cudamalloc_oom_changes_no_live_tensor() {
    let Some(driver) = fake_or_skip() else { return };
    scenario(
        &driver,
        "rejected",
        60,
        true,
        false,
        "throw_on_cudamalloc_oom",
    );
}

#[test]
fn a_create_over_the_memory_fraction_changes_no_live_tensor() {
    let Some(driver) = fake_or_skip() else { return };
    scenario(&driver, "fraction", 60, false, false, "out of memory");
}

#[test]
fn a_create_in_a_private_pool_out_of_room_changes_no_live_tensor() {
    let Some(driver) = fake_or_skip() else { return };
    scenario(&driver, "pool", 64, false, true, "out of memory");
}
