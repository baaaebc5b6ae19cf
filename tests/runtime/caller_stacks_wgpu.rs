//! The pairing of a caller's stack with its reservation (`src/runtime/server/caller_stack.rs`),
//! through CubeCL's client on `CachingWgpuRuntime`, in the cases where it could go wrong: data
//! written with the reservation (`create`), several tensors in one reservation
//! (`empty_tensors`), a reservation that fails, a `to_client` copy (whose policy call is not
//! followed by a reservation on the same server's queue), and several threads, each its own
//! CubeCL stream. Each request comes from a function of its own with a size of its own, and
//! the engine's `alloc` entry of that size must name that function.

use std::collections::HashMap;

use burn_caching_alloc::alloc::{HistoryOptions, StackResolver, TraceAction};
use burn_caching_alloc::backend;
use burn_caching_alloc::wgpu::CachingWgpuRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_ir::{ElemType, UIntKind};
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::{Handle, MemoryLayoutDescriptor};

use crate::support::lavapipe::cpu_device;

type Client = ComputeClient<CachingWgpuRuntime>;

const KIB: usize = 1024;

#[inline(never)]
fn create_with_data(client: &Client) -> Handle {
    client.create(Bytes::from_bytes_vec(vec![7u8; 41 * KIB]))
}

#[inline(never)]
fn two_tensors_in_one_reservation(client: &Client) -> Vec<Handle> {
    let descriptors = vec![
        MemoryLayoutDescriptor::contiguous([43 * 256].into(), 4),
        MemoryLayoutDescriptor::contiguous([47 * 256].into(), 4),
    ];
    client
        .empty_tensors(descriptors)
        .into_iter()
        .map(|layout| layout.memory)
        .collect()
}

#[inline(never)]
fn a_reservation_that_fails(client: &Client) -> Handle {
    // Over lavapipe's 128 MiB binding limit: refused before the engine is asked.
    client.empty(200 << 20)
}

#[inline(never)]
fn after_the_failure(client: &Client) -> Handle {
    client.empty(53 * KIB)
}

#[inline(never)]
fn copy_to_client(client: &mut Client, source: Handle) -> Handle {
    let destination = client.clone();
    client.to_client(source, &destination, ElemType::UInt(UIntKind::U8))
}

#[inline(never)]
fn after_the_copy(client: &Client) -> Handle {
    client.empty(59 * KIB)
}

#[inline(never)]
fn on_thread_a(client: Client) -> Vec<Handle> {
    (0..6).map(|i| client.empty((61 + 2 * i) * KIB)).collect()
}

#[inline(never)]
fn on_thread_b(client: Client) -> Vec<Handle> {
    (0..6).map(|i| client.empty((62 + 2 * i) * KIB)).collect()
}

#[test]
fn each_reservation_carries_the_stack_of_the_call_that_made_it() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let mut client = CachingWgpuRuntime::client(&device);
    backend::empty_cache(&device);
    backend::record_memory_history(&device, HistoryOptions::default());

    let data = create_with_data(&client);
    let pair = two_tensors_in_one_reservation(&client);
    let failed = a_reservation_that_fails(&client);
    let err = cubecl_common::future::block_on(client.sync());
    assert!(err.is_err(), "the 200 MiB reservation fails on lavapipe");
    let after_failure = after_the_failure(&client);
    let source = client.empty(97 * KIB);
    let copy = copy_to_client(&mut client, source.clone());
    let after_copy = after_the_copy(&client);
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| on_thread_a(client.clone()));
        let b = scope.spawn(|| on_thread_b(client.clone()));
        (a.join().expect("thread a"), b.join().expect("thread b"))
    });

    let snapshot = backend::memory_snapshot(&device);
    backend::record_memory_history(&device, HistoryOptions::off());
    let mut resolver = StackResolver::new();
    let mut by_size: HashMap<u64, Vec<Vec<String>>> = HashMap::new();
    for entry in snapshot
        .history
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
    {
        let frames = resolver.frames(entry.stack.as_ref().expect("stacks recorded"));
        by_size
            .entry(entry.size)
            .or_default()
            .push(frames.into_iter().map(|f| f.name).collect());
    }
    let named = |size: usize, function: &str| {
        let stacks = by_size
            .get(&(size as u64))
            .unwrap_or_else(|| panic!("no alloc of {size} B: {:?}", by_size.keys()));
        for names in stacks {
            assert!(
                names.iter().any(|n| n.ends_with(function)),
                "the {size} B reservation names {function}: {names:#?}"
            );
            assert!(
                !names.iter().any(|n| n.contains("ChannelDeviceHandle")),
                "captured on the caller's thread: {names:#?}"
            );
        }
        stacks.len()
    };

    assert_eq!(named(41 * KIB, "create_with_data"), 1);
    // One reservation for both tensors, each rounded to CubeCL's alignment.
    assert_eq!(
        named((43 + 47) * KIB, "two_tensors_in_one_reservation"),
        1,
        "one reservation of both tensors"
    );
    assert!(
        !by_size.contains_key(&(200 << 20)),
        "the refused reservation reached no engine allocation"
    );
    assert_eq!(named(53 * KIB, "after_the_failure"), 1);
    // The copy's reservation has no caller stack (the policy recognised `to_client` and
    // recorded none); the next reservation still pairs with its own.
    let copies = &by_size[&(97 * KIB as u64)];
    assert_eq!(copies.len(), 2, "the source and its copy");
    assert!(
        copies
            .iter()
            .any(|names| names.iter().any(|n| n.contains("ChannelDeviceHandle"))),
        "the copy carries the device thread's stack: {copies:#?}"
    );
    assert_eq!(named(59 * KIB, "after_the_copy"), 1);
    for i in 0..6 {
        assert_eq!(named((61 + 2 * i) * KIB, "on_thread_a"), 1);
        assert_eq!(named((62 + 2 * i) * KIB, "on_thread_b"), 1);
    }

    drop((
        data,
        pair,
        failed,
        after_failure,
        source,
        copy,
        after_copy,
        a,
        b,
    ));
    backend::empty_cache(&device);
}
