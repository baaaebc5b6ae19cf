//! CUDA's device path between devices (`runtime/server/peer.rs`, `cuda/peer.rs`,
//! `cuda/nccl.rs`) under the fake driver with four fake devices, each test in a child process of
//! its own (fresh devices): `to_device` by peer copy along 0 -> 1 -> 2 -> 3, values exact and
//! the source's blocks overwritten at once by new tensors, under every scheduler mode and
//! several seeds; NCCL all-reduce (sum, mean) across two and four devices from one thread per
//! device; out of memory on the destination as the allocator's error on its stream; a member
//! that fails before its NCCL call (its destination too small) breaking the group, so that the
//! others get an error instead of waiting; a member's driver dropped while its collective waits
//! for a peer, aborting instead of hanging; NCCL's own buffers finding room once the members'
//! engines gave their cache back; the host path's pinned staging reused round after
//! round. The fake's contract log must stay empty (peer access, cross-context use, frees of memory in use).

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::{Allocation, AllocatorConfig, CachingAllocator};
use burn_caching_alloc::cuda::{CachingCudaRuntime, CudaDriver, CudaMemory, CudaStream};
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};
use burn_caching_alloc::runtime::{
    Collective, Communication, DeviceReduce, Driver as _, Resource, set_communication,
};
use caching_alloc_engine::registry::{self, DeviceKey};
use cubecl_common::device::{Device, DeviceId};
use cubecl_ir::{ElemType, FloatKind, UIntKind};
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::{CopyDescriptor, Handle, ReduceOperation, ServerError};

use crate::MIB;
use crate::child::in_child;
use crate::fake_cuda::{Driver, Fake, SCHEDULES, Schedule, fake_only, fake_or_skip};
use crate::nccl::f32s;

type Client = ComputeClient<CachingCudaRuntime>;

fn four_devices(test: &str) -> Option<Fake> {
    four_devices_with(test, &[])
}

/// As [`four_devices`], with `more` variables for the child.
fn four_devices_with(test: &str, more: &[(&str, Option<&std::ffi::OsStr>)]) -> Option<Fake> {
    let driver = fake_or_skip()?;
    let Driver::Fake(fake) = driver else {
        fake_only("four fake devices");
        return None;
    };
    let envs = [
        ("FAKE_CUDA_DEVICES", Some(std::ffi::OsStr::new("4"))),
        (
            "FAKE_CUDA_MEMORY",
            Some(std::ffi::OsStr::new("1G,1G,1G,64M")),
        ),
        ("FAKE_CUDA_VMM", Some(std::ffi::OsStr::new("1"))),
        // A member left waiting is reported (a violation) after this long, not 30 s.
        ("FAKE_CUDA_DEADLOCK_SECS", Some(std::ffi::OsStr::new("10"))),
    ];
    let envs: Vec<_> = envs.iter().chain(more).copied().collect();
    in_child(test, &envs).then_some(fake)
}

fn move_to(from: &Client, to: &Client, handle: Handle, len: usize) -> Handle {
    let mut from = from.clone();
    let desc = CopyDescriptor::new(handle.binding(), [len].into(), [1].into(), 1);
    from.to_client_tensor(desc, to, ElemType::UInt(UIntKind::U8))
}

#[test]
fn peer_copies_along_four_devices_are_exact_and_never_read_reused_blocks_under_every_schedule() {
    let Some(fake) = four_devices(
        "comm::peer_copies_along_four_devices_are_exact_and_never_read_reused_blocks_under_every_schedule",
    ) else {
        return;
    };
    set_communication(Communication::Auto);
    let clients: Vec<Client> = (0..3)
        .map(|i| CachingCudaRuntime::client(&CudaDevice::new(i)))
        .collect();
    for schedule in SCHEDULES {
        for seed in 0..4 {
            fake.set_schedule(schedule, seed);
            for (round, len) in [4096usize, 300 << 10, 3 << 20].into_iter().enumerate() {
                let value = (seed as u8).wrapping_mul(31).wrapping_add(round as u8 + 1);
                let source = clients[0].create_from_slice(&vec![value; len]);
                let on_1 = move_to(&clients[0], &clients[1], source, len);
                // The source is dropped: new tensors of its size take its blocks at once.
                let clobber: Vec<Handle> = (0..2)
                    .map(|_| clients[0].create_from_slice(&vec![0xEE; len]))
                    .collect();
                let on_2 = move_to(&clients[1], &clients[2], on_1.clone(), len);
                let clobber_1 = clients[1].create_from_slice(&vec![0xDD; len]);
                for (client, handle) in [(&clients[1], on_1), (&clients[2], on_2)] {
                    let got = client.read_one(handle).expect("read").to_vec();
                    assert!(
                        got.iter().all(|b| *b == value),
                        "{schedule:?} seed {seed} len {len}: a copy read a reused block"
                    );
                }
                drop((clobber, clobber_1));
            }
        }
    }
    fake.assert_no_violations();
}

fn all_reduce_on(devices: &[usize], mean: bool) -> Vec<Vec<f32>> {
    let ids: Vec<_> = devices
        .iter()
        .map(|d| CudaDevice::new(*d).to_id())
        .collect();
    std::thread::scope(|scope| {
        devices
            .iter()
            .map(|device| {
                let ids = ids.clone();
                let op = match mean {
                    true => ReduceOperation::Mean,
                    false => ReduceOperation::Sum,
                };
                let device = *device;
                scope.spawn(move || {
                    let mut client: Client = CachingCudaRuntime::client(&CudaDevice::new(device));
                    let values: Vec<u8> = (0..1000)
                        .flat_map(|i| (i as f32 + device as f32 * 1000.0).to_ne_bytes())
                        .collect();
                    let buffer = client.create_from_slice(&values);
                    client.all_reduce(
                        buffer.clone(),
                        buffer.clone(),
                        ElemType::Float(FloatKind::F32),
                        ids,
                        op,
                    );
                    client.sync_collective();
                    let bytes = client.read_one(buffer).expect("read").to_vec();
                    bytes
                        .chunks(4)
                        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                        .collect::<Vec<f32>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|thread| thread.join().expect("a rank"))
            .collect()
    })
}

#[test]
fn nccl_all_reduce_across_two_and_four_devices_is_exact() {
    let Some(fake) = four_devices("comm::nccl_all_reduce_across_two_and_four_devices_is_exact")
    else {
        return;
    };
    set_communication(Communication::Nccl);
    for devices in [&[0usize, 1][..], &[0, 1, 2, 3][..]] {
        let n = devices.len() as f32;
        let base: f32 = devices.iter().map(|d| *d as f32 * 1000.0).sum();
        for mean in [false, true] {
            for result in all_reduce_on(devices, mean) {
                for (i, got) in result.iter().enumerate() {
                    let sum = n * i as f32 + base;
                    let want = if mean { sum / n } else { sum };
                    assert_eq!(*got, want, "{devices:?} element {i}");
                }
            }
        }
    }
    // NCCL ran them: the fake counted the calls.
    assert!(fake.calls("ncclAllReduce") >= 12);
    set_communication(Communication::Auto);
    fake.assert_no_violations();
}

#[test]
fn out_of_memory_on_the_destination_is_the_allocators_error_on_its_stream() {
    let Some(fake) = four_devices(
        "comm::out_of_memory_on_the_destination_is_the_allocators_error_on_its_stream",
    ) else {
        return;
    };
    set_communication(Communication::Auto);
    let source: Client = CachingCudaRuntime::client(&CudaDevice::new(0));
    let small: Client = CachingCudaRuntime::client(&CudaDevice::new(3));
    let len = 128 << 20;
    let data = source.create_from_slice(&vec![1u8; len]);
    let moved = move_to(&source, &small, data, len);
    let err = small
        .read_one(moved)
        .expect_err("64 MiB cannot hold 128 MiB");
    let message = err.to_string();
    assert!(message.contains("caching allocator"), "{message}");
    // The source's staging block goes back: nothing copies from it.
    let again = source.create_from_slice(&vec![2u8; 4096]);
    let moved = move_to(&source, &small, again, 4096);
    assert_eq!(
        small.read_one(moved).expect("read").to_vec(),
        vec![2u8; 4096]
    );
    fake.assert_no_violations();
}

/// One member of a 2- and then a 4-device group fails before its NCCL call (its destination
/// holds fewer bytes than its source: the server refuses it before NCCL sees it). Without
/// more, the others' `ncclAllReduce` would wait on their streams for it forever (the fake
/// reports that as a deadlock after `FAKE_CUDA_DEADLOCK_SECS`, a violation). The failing
/// member breaks the group (`Driver::abandon_all_reduce`): its communicators are aborted, which
/// cancels the collectives already queued, and every member gets an error at its next sync;
/// the group's next all-reduce fails at once on every member.
#[test]
fn a_member_that_fails_before_its_nccl_call_breaks_the_group_instead_of_hanging_the_others() {
    let Some(fake) = four_devices(
        "comm::a_member_that_fails_before_its_nccl_call_breaks_the_group_instead_of_hanging_the_others",
    ) else {
        return;
    };
    set_communication(Communication::Nccl);
    for devices in [&[0usize, 1][..], &[0, 1, 2, 3][..]] {
        let ids: Vec<_> = devices
            .iter()
            .map(|d| CudaDevice::new(*d).to_id())
            .collect();
        let errors: Vec<(usize, String, String)> = std::thread::scope(|scope| {
            let threads: Vec<_> = devices
                .iter()
                .map(|&device| {
                    let ids = ids.clone();
                    scope.spawn(move || {
                        let mut client: Client =
                            CachingCudaRuntime::client(&CudaDevice::new(device));
                        let reduce = |client: &mut Client, small: bool| {
                            let src = client.create_from_slice(&[1u8; 4000]);
                            let dst = match small {
                                true => client.create_from_slice(&[0u8; 400]),
                                false => src.clone(),
                            };
                            client.all_reduce(
                                src,
                                dst,
                                ElemType::Float(FloatKind::F32),
                                ids.clone(),
                                ReduceOperation::Sum,
                            );
                            client.sync_collective();
                            match cubecl_common::future::block_on(client.sync()) {
                                Ok(()) => "no error".to_string(),
                                Err(err) => err.to_string(),
                            }
                        };
                        // The first member's destination is too small; the next time,
                        // nobody's.
                        let first = reduce(&mut client, device == devices[0]);
                        let again = reduce(&mut client, false);
                        (device, first, again)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a member"))
                .collect()
        });
        for (device, first, again) in errors {
            if device == devices[0] {
                assert!(first.contains("into a buffer of 400 bytes"), "{first}");
            } else {
                assert!(first.contains("NCCL"), "device {device}: {first}");
                assert!(
                    first.contains("before its all-reduce"),
                    "device {device}: {first}"
                );
            }
            assert!(again.contains("NCCL"), "device {device}: {again}");
        }
    }
    set_communication(Communication::Auto);
    fake.assert_no_violations();
}

/// `cuMemHostAlloc` calls of `device`'s pinned pool so far.
fn pinned_allocations(device: usize) -> u64 {
    burn_caching_alloc::backend::memory_stats(&CudaDevice::new(device))
        .host
        .expect("CUDA has a pinned host pool")
        .num_host_alloc()
}

/// The host path on CUDA (`BURN_CACHING_ALLOC_COMM=host`) stages every read and write through
/// the device's pooled pinned buffers (`cuda/staging.rs`): after the first all-reduce and the
/// first `to_device` of a size, the same again allocates no pinned memory on either device
/// (each round's reads and writes take the buffers the last round gave back), and the values
/// stay exact.
///
/// Pinned to the fake's eager schedule: a buffer goes back to the pool only once its copy's
/// event completed, and the all-reduce's copies run on its members' own streams, which the
/// round's `sync` on this thread's stream does not wait for. Under the delayed and random
/// schedules such a copy may still be queued when the next round asks for a buffer, and a new
/// one is then correct (seeds 2, 5, 6, 10 and 11 did that), not a reuse gap.
#[test]
fn the_host_path_reuses_its_pinned_staging_buffers_round_after_round() {
    let Some(fake) =
        four_devices("comm::the_host_path_reuses_its_pinned_staging_buffers_round_after_round")
    else {
        return;
    };
    fake.set_schedule(Schedule::Eager, 0);
    set_communication(Communication::Host);
    let len = 4 << 20;
    let mut after_first = None;
    for round in 0..4 {
        let sums = all_reduce_on(&[0, 1], false);
        for result in &sums {
            for (i, got) in result.iter().enumerate() {
                assert_eq!(*got, 2.0 * i as f32 + 1000.0, "round {round} element {i}");
            }
        }
        let clients: Vec<Client> = (0..2)
            .map(|i| CachingCudaRuntime::client(&CudaDevice::new(i)))
            .collect();
        let data = vec![round as u8 + 1; len];
        let moved = move_to(
            &clients[0],
            &clients[1],
            clients[0].create_from_slice(&data),
            len,
        );
        assert_eq!(clients[1].read_one(moved).expect("read").to_vec(), data);
        for client in &clients {
            cubecl_common::future::block_on(client.sync()).expect("sync");
        }
        let allocations = (pinned_allocations(0), pinned_allocations(1));
        match after_first {
            None => {
                assert!(allocations.0 > 0 && allocations.1 > 0, "{allocations:?}");
                after_first = Some(allocations);
            }
            Some(first) => assert_eq!(allocations, first, "round {round}: new pinned memory"),
        }
    }
    set_communication(Communication::Auto);
    fake.assert_no_violations();
}

/// `set_communication` between two members' calls of one all-reduce: the second takes the
/// path the first read (NCCL here), not the new setting (the host path, where it would wait
/// for a first member that is on NCCL, forever). The next all-reduce takes the new setting.
/// (The other order, host first, cannot be staged from one thread: the first member's host
/// part blocks its device thread until the second arrives; `comm_path`'s unit test covers the
/// agreement both ways.)
#[test]
fn members_of_one_all_reduce_take_the_path_the_first_read_when_the_setting_changes_between() {
    let Some(fake) = four_devices(
        "comm::members_of_one_all_reduce_take_the_path_the_first_read_when_the_setting_changes_between",
    ) else {
        return;
    };
    let mut clients: Vec<Client> = (0..2)
        .map(|i| CachingCudaRuntime::client(&CudaDevice::new(i)))
        .collect();
    let ids: Vec<_> = (0..2).map(|d| CudaDevice::new(d).to_id()).collect();
    let f32s =
        |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_ne_bytes()).collect() };
    let buffers: Vec<Handle> = clients
        .iter()
        .enumerate()
        .map(|(i, client)| client.create_from_slice(&f32s(&[1.0 + i as f32, 10.0])))
        .collect();
    let mut reduce = |member: usize| {
        let client = &mut clients[member];
        client.all_reduce(
            buffers[member].clone(),
            buffers[member].clone(),
            ElemType::Float(FloatKind::F32),
            ids.clone(),
            ReduceOperation::Sum,
        );
        client.sync_collective();
        // A call the device thread answers: this member's part has run by then (NCCL only
        // queues it).
        client.memory_usage().expect("usage");
    };
    set_communication(Communication::Nccl);
    reduce(0);
    set_communication(Communication::Host);
    reduce(1);
    assert_eq!(fake.calls("ncclAllReduce"), 2, "both members on NCCL");
    for (member, buffer) in buffers.iter().enumerate() {
        let got = clients[member]
            .read_one(buffer.clone())
            .expect("read")
            .to_vec();
        assert_eq!(got, f32s(&[3.0, 20.0]));
    }
    // The next one reads the new setting: the host path, from a thread per member.
    for result in all_reduce_on(&[0, 1], false) {
        for (i, got) in result.iter().enumerate() {
            assert_eq!(*got, 2.0 * i as f32 + 1000.0);
        }
    }
    assert_eq!(
        fake.calls("ncclAllReduce"),
        2,
        "no NCCL call on the host path"
    );
    set_communication(Communication::Auto);
    fake.assert_no_violations();
}

/// A device's driver dropped while its part of an all-reduce waits for a member that has not
/// called (its server going away, e.g. its thread's last client dropped): `ncclCommDestroy`
/// would wait for that collective, which waits for the member, forever (the fake reports such
/// a destroy as a violation). The drop aborts the communicator instead, which cancels the
/// collective, and ends the group, so the member that calls later gets the break as an error
/// that says how to go on, instead of waiting for a device that is gone.
#[test]
fn a_driver_dropped_while_its_all_reduce_waits_for_a_peer_aborts_and_ends_the_group() {
    let Some(fake) = four_devices(
        "comm::a_driver_dropped_while_its_all_reduce_waits_for_a_peer_aborts_and_ends_the_group",
    ) else {
        return;
    };
    let group = fake_pair(0, 1);
    // Member `rank`'s driver, its engine, and its part of an all-reduce of 8 bytes issued.
    let member = |rank: usize| {
        let mut driver = CudaDriver::open(group[rank]).expect("driver");
        let alloc =
            CachingAllocator::new(driver.memory(), AllocatorConfig::default()).expect("allocator");
        let block = alloc.malloc(8, DeviceStream(0)).expect("8 bytes");
        let mut stream = driver.create_stream(DeviceStream(0));
        // SAFETY: a live block of 8 bytes, kept allocated until the collective has ended (the
        // caller drops the driver, which ends it, before the block).
        let issued =
            unsafe { issue_sum(&mut driver, &mut stream, &eight_bytes(&block), &group, rank) };
        (driver, stream, alloc, block, issued)
    };

    let (driver, _stream, alloc, block, issued) = member(0);
    assert!(matches!(issued, Ok(DeviceReduce::Issued)), "{issued:?}");
    // Member 1 has not called: member 0's collective waits on its stream. Dropping the driver
    // returns, having cancelled it; then the block goes.
    drop(driver);
    alloc.free(block).expect("free");
    drop(alloc);
    assert_eq!(fake.calls("ncclCommDestroy"), 0);
    assert_eq!(
        fake.calls("ncclCommAbort"),
        2,
        "both members' communicators"
    );

    let (driver, _stream, alloc, block, issued) = member(1);
    let err = issued
        .expect_err("the group ended with member 0")
        .to_string();
    assert!(err.contains("member 0 was dropped"), "{err}");
    assert!(err.contains("Communication::Host"), "{err}");
    drop(driver);
    alloc.free(block).expect("free");
    fake.assert_no_violations();
}

/// NCCL allocates its own buffers with the driver when a group's communicators are made (tens
/// to hundreds of MiB per GPU), beside the engines: on a device whose memory an engine holds as
/// cache that fails (the fake: `FAKE_NCCL_COMM_BYTES`, `ncclUnhandledCudaError` without room).
/// Making them then empties the members' engine caches and tries once more, as the engine's own
/// out-of-memory path does before it fails. Device 3 has 64 MiB; its engine caches 40 MiB and
/// holds a 2 MiB segment for the all-reduce's buffer; NCCL needs 32 MiB there.
#[test]
fn making_a_groups_communicators_empties_the_members_caches_when_nccl_finds_no_room() {
    let Some(fake) = four_devices_with(
        "comm::making_a_groups_communicators_empties_the_members_caches_when_nccl_finds_no_room",
        &[("FAKE_NCCL_COMM_BYTES", Some(std::ffi::OsStr::new("32M")))],
    ) else {
        return;
    };
    let group = fake_pair(2, 3);
    let mut drivers = group.map(|id| CudaDriver::open(id).expect("driver"));
    let engines = drivers.each_mut().map(|driver| {
        std::sync::Arc::new(
            CachingAllocator::<CudaMemory>::new(driver.memory(), AllocatorConfig::default())
                .expect("allocator"),
        )
    });
    // Registered as the CUDA servers register theirs: how NCCL's path finds them.
    for (id, engine) in group.iter().zip(&engines) {
        registry::register(DeviceKey::new("cuda", u32::from(id.index_id)), engine);
    }
    let cached = engines[1]
        .malloc(40 * MIB, DeviceStream(0))
        .expect("40 MiB");
    engines[1].free(cached).expect("free");
    let blocks = engines
        .each_ref()
        .map(|engine| engine.malloc(8, DeviceStream(0)).expect("8 bytes"));
    let resources = blocks.each_ref().map(eight_bytes);
    let mut streams = drivers
        .each_mut()
        .map(|driver| driver.create_stream(DeviceStream(0)));
    let inputs = [f32s(&[1.0, 2.0]), f32s(&[10.0, 20.0])];
    for rank in 0..2 {
        // SAFETY: live blocks of 8 bytes, allocated until the end of the test, after the
        // collective and the reads.
        let issued = unsafe {
            drivers[rank]
                .write(&mut streams[rank], &resources[rank], &inputs[rank])
                .expect("write");
            issue_sum(
                &mut drivers[rank],
                &mut streams[rank],
                &resources[rank],
                &group,
                rank,
            )
        };
        assert!(matches!(issued, Ok(DeviceReduce::Issued)), "{issued:?}");
    }
    for rank in 0..2 {
        // SAFETY: as above.
        let back = cubecl_common::future::block_on(unsafe {
            drivers[rank].read(&mut streams[rank], vec![(resources[rank].clone(), 8)])
        })
        .expect("read");
        assert_eq!(back[0].to_vec(), f32s(&[11.0, 22.0]), "rank {rank}");
    }
    assert_eq!(
        fake.calls("ncclCommInitAll"),
        2,
        "made again after the cache went"
    );
    assert_eq!(
        engines[1].memory_reserved(),
        2 * MIB,
        "device 3's cached 40 MiB went back; the buffer's segment stayed"
    );
    drop(drivers);
    for (engine, block) in engines.iter().zip(blocks) {
        engine.free(block).expect("free");
    }
    fake.assert_no_violations();
}

/// Fake devices `a` and `b`, a group of two.
fn fake_pair(a: u16, b: u16) -> [DeviceId; 2] {
    [a, b].map(|index_id| DeviceId {
        type_id: 0,
        index_id,
    })
}

/// Where the driver finds `block`'s first 8 bytes (two f32).
fn eight_bytes(block: &Allocation<<CudaMemory as DeviceMemory>::Handle>) -> Resource<CudaDriver> {
    Resource::<CudaDriver> {
        segment: *block.segment(),
        offset: block.offset(),
        size: 8,
    }
}

/// Issues rank `rank`'s part of an NCCL sum of the two f32 in `resource`, in place, over
/// `group`, on `stream`.
///
/// # Safety
/// `resource` is a live block of at least 8 bytes, allocated until the collective has ended.
unsafe fn issue_sum(
    driver: &mut CudaDriver,
    stream: &mut CudaStream,
    resource: &Resource<CudaDriver>,
    group: &[DeviceId],
    rank: usize,
) -> Result<DeviceReduce, ServerError> {
    // SAFETY: the caller's.
    unsafe {
        driver.all_reduce(
            stream,
            Collective {
                src: resource,
                dst: resource,
                len: 8,
                dtype: ElemType::Float(FloatKind::F32),
                op: &ReduceOperation::Sum,
                group,
                rank,
                path: &Ok(Communication::Nccl),
            },
        )
    }
}
