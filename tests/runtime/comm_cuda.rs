//! CUDA's device path between devices on a real GPU (ignored without one, run by
//! `scripts/gpu-check.sh`): the NCCL probe, a one-rank NCCL all-reduce equal to the host
//! path's bytes, the staging block of a `to_device` never reused before its copy completed
//! with two threads at it, and the micro-benchmark (256 MiB `to_device` and `all_reduce`, the
//! device path against the host path, in one process, interleaved) whose lines gpu-check puts
//! in its summary. What needs two GPUs (two NCCL ranks, peer access between devices) is here
//! too, and skips with its reason on one.
//!
//! The communication path is process-wide (`set_communication`): every test here holds the
//! CUDA device's turn (`cuda_turn`), as every other CUDA test of this binary does, and leaves
//! the path on `auto`.

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{bf16, f16};
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::{CachingCudaRuntime, NCCL_NAMES, nccl_version};
use burn_caching_alloc::runtime::{Communication, set_communication};
use cubecl_common::device::Device;
use cubecl_ir::{ElemType, FloatKind, IntKind, UIntKind};
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::{CopyDescriptor, ReduceOperation};

use crate::burn_mlp_cuda::cuda_turn;

type Client = ComputeClient<CachingCudaRuntime>;

/// Puts the path back to `auto` when a test ends, even by a panic.
struct PathGuard;

impl Drop for PathGuard {
    fn drop(&mut self) {
        set_communication(Communication::Auto);
    }
}

fn on(path: Communication) -> PathGuard {
    set_communication(path);
    PathGuard
}

fn all_reduce_bytes(
    client: &mut Client,
    data: &[u8],
    dtype: ElemType,
    op: ReduceOperation,
) -> Vec<u8> {
    let buffer = client.create_from_slice(data);
    let ids = vec![CudaDevice::default().to_id()];
    client.all_reduce(buffer.clone(), buffer.clone(), dtype, ids, op);
    client.sync_collective();
    client.read_one(buffer).expect("read").to_vec()
}

fn to_device_bytes(client: &mut Client, data: &[u8]) -> Vec<u8> {
    let source = client.create_from_slice(data);
    let desc = CopyDescriptor::new(source.binding(), [data.len()].into(), [1].into(), 1);
    let same = client.clone();
    let moved = client.to_client_tensor(desc, &same, ElemType::UInt(UIntKind::U8));
    client.read_one(moved).expect("read").to_vec()
}

#[test]
#[ignore = "needs a CUDA device"]
fn nccl_probe_names_the_library_and_its_version() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    match nccl_version() {
        Ok((name, version)) => {
            println!("| nccl | loaded {name} | version {version} |");
            assert!(NCCL_NAMES.contains(&name), "{name}");
            assert!(
                version >= 20000,
                "NCCL 2 reports major*10000+..., got {version}"
            );
        }
        Err(reason) => {
            println!("| nccl | not loaded | {reason} |");
            for name in NCCL_NAMES {
                assert!(reason.contains(name), "{reason}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_one_rank_nccl_all_reduce_equals_the_host_paths_bytes() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    if let Err(reason) = nccl_version() {
        eprintln!("skipping: {reason}");
        return;
    }
    let device = CudaDevice::default();
    let mut client: Client = CachingCudaRuntime::client(&device);
    let n = 4099;
    let cases: Vec<(ElemType, Vec<u8>)> = vec![
        (
            ElemType::Float(FloatKind::F32),
            (0..n)
                .flat_map(|i| (i as f32 * 0.37 - 11.0).to_ne_bytes())
                .collect(),
        ),
        (
            ElemType::Float(FloatKind::F16),
            (0..n)
                .flat_map(|i| f16::from_f32(i as f32 * 0.25 - 3.0).to_ne_bytes())
                .collect(),
        ),
        (
            ElemType::Float(FloatKind::BF16),
            (0..n)
                .flat_map(|i| bf16::from_f32(i as f32 * 0.5 - 7.0).to_ne_bytes())
                .collect(),
        ),
        (
            ElemType::Int(IntKind::I32),
            (0..n)
                .flat_map(|i: i32| (i * 37 - 5000).to_ne_bytes())
                .collect(),
        ),
        (
            ElemType::UInt(UIntKind::U8),
            (0..n).map(|i| (i * 13 % 256) as u8).collect(),
        ),
    ];
    for (dtype, data) in &cases {
        for mean in [false, true] {
            let op = || match mean {
                true => ReduceOperation::Mean,
                false => ReduceOperation::Sum,
            };
            let nccl = {
                let _path = on(Communication::Nccl);
                all_reduce_bytes(&mut client, data, *dtype, op())
            };
            let host = {
                let _path = on(Communication::Host);
                all_reduce_bytes(&mut client, data, *dtype, op())
            };
            assert_eq!(
                nccl, host,
                "{dtype:?} mean={mean}: NCCL and the host path differ"
            );
            // One rank: the sum and the mean are the values themselves.
            assert_eq!(&nccl, data, "{dtype:?} mean={mean}");
        }
    }
    backend::empty_cache(&device);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_staging_block_is_never_reused_before_its_copy_with_two_threads_racing() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    let device = CudaDevice::default();
    let _path = on(Communication::Auto);
    std::thread::scope(|scope| {
        for thread in 0..2u8 {
            let device = device.clone();
            scope.spawn(move || {
                // Each thread is a stream of its own on the device.
                let mut client: Client = CachingCudaRuntime::client(&device);
                for round in 0..50u8 {
                    let pattern = vec![thread.wrapping_mul(100).wrapping_add(round); 4 << 20];
                    let moved = {
                        let source = client.create_from_slice(&pattern);
                        let desc = CopyDescriptor::new(
                            source.binding(),
                            [pattern.len()].into(),
                            [1].into(),
                            1,
                        );
                        let same = client.clone();
                        client.to_client_tensor(desc, &same, ElemType::UInt(UIntKind::U8))
                    };
                    // Same-size tensors right away: were the staging block (or the dropped
                    // source) handed out before the copy read it, these bytes would land in
                    // the copy.
                    let clobber: Vec<_> = (0..3)
                        .map(|_| client.create_from_slice(&vec![0xEE; 4 << 20]))
                        .collect();
                    let got = client.read_one(moved).expect("read");
                    assert!(
                        got.iter().all(|b| *b == pattern[0]),
                        "thread {thread} round {round}: the copy was overwritten"
                    );
                    drop(clobber);
                }
            });
        }
    });
    backend::empty_cache(&device);
}

#[test]
#[ignore = "needs a CUDA device"]
fn micro_benchmark_256_mib_device_path_against_host_path() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    let device = CudaDevice::default();
    let mut client: Client = CachingCudaRuntime::client(&device);
    let len = 256 << 20;
    let data: Vec<u8> = (0..len / 4)
        .flat_map(|i| (i as f32).to_ne_bytes())
        .collect();
    let f32_type = ElemType::Float(FloatKind::F32);
    let nccl = nccl_version().is_ok();
    let gb = len as f64 / 1e9;
    // (operation, path) -> best of the rounds, in seconds; interleaved, after a warm-up round.
    let mut best: Vec<(&str, &str, f64)> = Vec::new();
    let time = |name: &str, path: Communication, client: &mut Client| {
        let _path = on(path);
        let buffer = client.create_from_slice(&data);
        cubecl_common::future::block_on(client.sync()).expect("sync");
        let start = Instant::now();
        if name == "to_device" {
            let desc = CopyDescriptor::new(buffer.binding(), [len].into(), [1].into(), 1);
            let same = client.clone();
            let moved = client.to_client_tensor(desc, &same, f32_type);
            cubecl_common::future::block_on(client.sync()).expect("sync");
            let seconds = start.elapsed().as_secs_f64();
            drop(moved);
            seconds
        } else {
            let ids = vec![CudaDevice::default().to_id()];
            client.all_reduce(
                buffer.clone(),
                buffer.clone(),
                f32_type,
                ids,
                ReduceOperation::Sum,
            );
            client.sync_collective();
            cubecl_common::future::block_on(client.sync()).expect("sync");
            start.elapsed().as_secs_f64()
        }
    };
    let mut runs: Vec<(&'static str, Communication, &'static str)> = vec![
        ("to_device", Communication::Auto, "peer copy"),
        ("to_device", Communication::Host, "host"),
        ("all_reduce", Communication::Host, "host"),
    ];
    if nccl {
        runs.push(("all_reduce", Communication::Nccl, "nccl"));
    }
    for round in 0..4 {
        for (name, path, label) in &runs {
            let seconds = time(name, *path, &mut client);
            if round == 0 {
                continue;
            }
            match best.iter_mut().find(|(n, l, _)| n == name && l == label) {
                Some(entry) => entry.2 = entry.2.min(seconds),
                None => best.push((name, label, seconds)),
            }
        }
    }
    println!("| comm-bench | operation | path | ms (best of 3) | GB/s |");
    for (name, label, seconds) in &best {
        println!(
            "| comm-bench | {name} 256 MiB | {label} | {:.2} | {:.1} |",
            seconds * 1e3,
            gb / seconds
        );
    }
    if !nccl {
        println!("| comm-bench | all_reduce 256 MiB | nccl | not loaded | - |");
    }
    // The same bytes either way.
    let check = &data[..1 << 20];
    let by_device = to_device_bytes(&mut client, check);
    let by_host = {
        let _path = on(Communication::Host);
        to_device_bytes(&mut client, check)
    };
    assert_eq!(by_device, by_host);
    assert_eq!(by_device, check);
    backend::empty_cache(&device);
}

#[test]
#[ignore = "needs a CUDA device"]
fn two_devices_reduce_by_nccl_and_copy_by_peer_access() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    let count = cudarc_device_count();
    if count < 2 {
        eprintln!("skipping: needs two CUDA devices, this machine has {count}");
        return;
    }
    let (d0, d1) = (CudaDevice::new(0), CudaDevice::new(1));
    let mut c0: Client = CachingCudaRuntime::client(&d0);
    let c1: Client = CachingCudaRuntime::client(&d1);
    // to_device 0 -> 1 by peer copy, exact.
    let data: Vec<u8> = (0..(8 << 20)).map(|i| (i % 253) as u8).collect();
    let source = c0.create_from_slice(&data);
    let desc = CopyDescriptor::new(source.binding(), [data.len()].into(), [1].into(), 1);
    let moved = c0.to_client_tensor(desc, &c1, ElemType::UInt(UIntKind::U8));
    assert_eq!(c1.read_one(moved).expect("read").to_vec(), data);
    // all_reduce of two ranks, each on its own thread (NCCL waits for every rank).
    if let Err(reason) = nccl_version() {
        eprintln!("all_reduce of two ranks skipped: {reason}");
        return;
    }
    let ids = vec![d0.to_id(), d1.to_id()];
    let values = |rank: f32| -> Vec<u8> {
        (0..1024)
            .flat_map(|i| (i as f32 + rank * 1000.0).to_ne_bytes())
            .collect()
    };
    let results: Vec<Vec<u8>> = std::thread::scope(|scope| {
        [(c0.clone(), 0.0f32), (c1.clone(), 1.0)]
            .into_iter()
            .map(|(mut client, rank)| {
                let ids = ids.clone();
                let data = values(rank);
                scope.spawn(move || all_reduce_bytes_group(&mut client, &data, ids))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|handle| handle.join().expect("rank"))
            .collect()
    });
    let expected: Vec<u8> = (0..1024)
        .flat_map(|i| (2.0 * i as f32 + 1000.0).to_ne_bytes())
        .collect();
    assert_eq!(results[0], expected);
    assert_eq!(results[1], expected);
}

fn all_reduce_bytes_group(
    client: &mut Client,
    data: &[u8],
    ids: Vec<cubecl_common::device::DeviceId>,
) -> Vec<u8> {
    let buffer = client.create_from_slice(data);
    client.all_reduce(
        buffer.clone(),
        buffer.clone(),
        ElemType::Float(FloatKind::F32),
        ids,
        ReduceOperation::Sum,
    );
    client.sync_collective();
    client.read_one(buffer).expect("read").to_vec()
}

/// CUDA devices on this machine (0 when the count cannot be read).
fn cudarc_device_count() -> i32 {
    burn_caching_alloc::cuda::device_count().unwrap_or(0)
}
