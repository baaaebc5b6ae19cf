//! Two caching wgpu devices in one process (lavapipe in CI): `WgpuDevice::Cpu` (CubeCL id
//! `3:0`) and `WgpuDevice::DefaultDevice` (`4:0`) are two CubeCL devices, two servers and two
//! engines even when both open the same adapter. Tensors move between them with
//! `Tensor::to_device` (CubeCL's `to_client_tensor`: `comm_init`, `send`, `recv`,
//! `sync_collective` on our servers), on the unfused and the fused backend.

use std::sync::MutexGuard;

use crate::MIB;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;

/// The shared CPU device (under the binary's lock: other tests use it) and a second device.
pub(crate) fn two_devices() -> Option<(WgpuDevice, WgpuDevice, MutexGuard<'static, ()>)> {
    let (cpu, turn) = cpu_device()?;
    Some((cpu, WgpuDevice::DefaultDevice, turn))
}

/// Caps a device for one test and gives it back whole when the test ends, passed or failed.
struct Uncap<'a>(&'a WgpuDevice);

impl Drop for Uncap<'_> {
    fn drop(&mut self) {
        let _ = backend::set_per_process_memory_fraction(self.0, 1.0);
    }
}

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32) * 0.25 - 100.0).collect()
}

/// A tensor goes A -> B -> A with its exact values and dtype, on backend `B`.
fn round_trip<B: Backend<Device = WgpuDevice>>(a: &WgpuDevice, b: &WgpuDevice) {
    let data = values(3000);
    let on_a = Tensor::<B, 2>::from_data(TensorData::new(data.clone(), [30, 100]), a);
    let on_b = on_a.clone().to_device(b);
    assert_eq!(&on_b.device(), b);
    // Work on B with the moved tensor, then bring the result home.
    let doubled = on_b.clone() * 2.0;
    let home = doubled.to_device(a);
    let expected: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    assert_eq!(home.into_data().to_vec::<f32>().unwrap(), expected);
    assert_eq!(on_b.into_data().to_vec::<f32>().unwrap(), data);
    // Ints too, and a tensor that is not a whole buffer (a slice of a larger one).
    let ints = Tensor::<B, 1, Int>::arange(0..1000, a).narrow(0, 100, 100);
    let moved = ints.to_device(b);
    assert_eq!(
        moved.into_data().to_vec::<i32>().unwrap(),
        (100..200).collect::<Vec<i32>>()
    );
    // Fusion drops tensors when its queue drains: leave both devices settled.
    B::sync(a).expect("sync");
    B::sync(b).expect("sync");
}

#[test]
fn tensors_move_both_ways_with_exact_values_unfused_and_fused() {
    let Some((a, b, _turn)) = two_devices() else {
        return;
    };
    round_trip::<CachingWgpuUnfused>(&a, &b);
    round_trip::<CachingWgpuUnfused>(&b, &a);
    round_trip::<CachingWgpu>(&a, &b);
    round_trip::<CachingWgpu>(&b, &a);
    backend::empty_cache(&a);
    backend::empty_cache(&b);
}

#[test]
fn the_destination_allocates_the_moved_tensor_and_empty_cache_stays_on_its_device() {
    type B = CachingWgpuUnfused;
    let Some((a, b, _turn)) = two_devices() else {
        return;
    };
    backend::empty_cache(&a);
    backend::empty_cache(&b);
    let a_before = backend::memory_stats(&a);
    let b_before = backend::memory_stats(&b);

    // 4 MiB on A, moved to B.
    let n = (4 * MIB / 4) as usize;
    let on_a = Tensor::<B, 1>::ones([n], &a);
    let on_b = on_a.clone().to_device(&b);
    let a_live = backend::memory_stats(&a);
    let b_live = backend::memory_stats(&b);
    println!(
        "after to_device of 4 MiB: A allocated {} reserved {}, B allocated {} reserved {}",
        a_live.memory_allocated(),
        a_live.memory_reserved(),
        b_live.memory_allocated(),
        b_live.memory_reserved()
    );
    // B's allocator holds exactly the moved tensor: one 4 MiB block in a new large-pool
    // segment (a request of 1-10 MiB on an empty large pool gets a segment of its size rounded
    // up to 2 MiB, `segment_sizing:grow`; PyTorch's rule would make it 20 MiB).
    assert_eq!(
        b_live.memory_allocated() - b_before.memory_allocated(),
        4 * MIB
    );
    assert_eq!(
        b_live.memory_reserved() - b_before.memory_reserved(),
        4 * MIB
    );
    assert_eq!(b_live.engine.segment.large_pool.current, 1);
    // A holds its own tensor and nothing for the transfer.
    assert_eq!(
        a_live.memory_allocated() - a_before.memory_allocated(),
        4 * MIB
    );

    // Dropping A's tensor and emptying A's cache frees A, and leaves B alone.
    drop(on_a);
    backend::empty_cache(&a);
    assert_eq!(
        backend::memory_stats(&a).memory_reserved(),
        a_before.memory_reserved()
    );
    let b_after = backend::memory_stats(&b);
    assert_eq!(b_after.memory_reserved(), b_live.memory_reserved());
    assert_eq!(b_after.memory_allocated(), b_live.memory_allocated());
    assert_eq!(
        b_after.engine.num_device_free,
        b_live.engine.num_device_free
    );
    assert!(
        on_b.clone()
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|v| *v == 1.0)
    );
    drop(on_b);
    backend::empty_cache(&b);
    assert_eq!(
        backend::memory_stats(&b).memory_reserved(),
        b_before.memory_reserved()
    );
}

#[test]
fn a_transfer_to_a_device_out_of_memory_returns_the_allocators_error() {
    type B = CachingWgpuUnfused;
    let Some((a, b, _turn)) = two_devices() else {
        return;
    };
    backend::empty_cache(&b);
    let total = backend::memory_stats(&b).device.total;
    let _uncap = Uncap(&b);
    // B becomes a 16 MiB device; 32 MiB are sent to it.
    backend::set_per_process_memory_fraction(&b, (16 * MIB) as f64 / total as f64)
        .expect("valid fraction");
    let ooms_before = backend::memory_stats(&b).engine.num_ooms;
    let big = Tensor::<B, 1>::ones([(32 * MIB / 4) as usize], &a);
    let moved = big.clone().to_device(&b);
    let err = moved
        .try_into_data()
        .expect_err("32 MiB cannot fit in 16 MiB");
    let message = format!("{err:?}");
    println!("error reaching Burn: {message}");
    assert!(message.contains("out of memory"), "{message}");
    // At least one: the server's out-of-memory path tries the stream, then again after
    // reclaiming other streams' slices, and the engine counts each failed reservation.
    assert!(backend::memory_stats(&b).engine.num_ooms > ooms_before);

    // Neither device is stuck: the source still reads, and a tensor that fits moves.
    assert_eq!(
        big.narrow(0, 0, 2).into_data().to_vec::<f32>().unwrap(),
        [1.0, 1.0]
    );
    let small = Tensor::<B, 1>::from_data(TensorData::new(vec![1.5f32, -2.5], [2]), &a);
    assert_eq!(
        small.to_device(&b).into_data().to_vec::<f32>().unwrap(),
        [1.5, -2.5]
    );
    backend::set_per_process_memory_fraction(&b, 1.0).expect("valid fraction");
    backend::empty_cache(&a);
    backend::empty_cache(&b);
}

/// `DistributedBackend::all_reduce` (what burn-train's DDP syncs gradients with) of one
/// tensor on `device`, called on its own thread as DDP's workers do.
#[cfg(feature = "distributed")]
fn all_reduce_on<B>(
    device: &WgpuDevice,
    values: Vec<f32>,
    op: burn::tensor::backend::distributed::ReduceOperation,
    ids: Vec<burn::tensor::backend::DeviceId>,
) -> Vec<f32>
where
    B: burn::tensor::backend::distributed::DistributedBackend<Device = WgpuDevice>,
{
    use burn::tensor::TensorPrimitive;
    let n = values.len();
    let tensor = Tensor::<B, 1>::from_data(TensorData::new(values, [n]), device);
    let reduced = B::all_reduce(tensor.into_primitive().tensor(), op, ids).resolve();
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(reduced))
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

#[cfg(feature = "distributed")]
fn all_reduce_both<B>(a: &WgpuDevice, b: &WgpuDevice)
where
    B: burn::tensor::backend::distributed::DistributedBackend<Device = WgpuDevice>,
{
    use burn::tensor::backend::DeviceOps;
    use burn::tensor::backend::distributed::ReduceOperation;
    let ids = vec![a.id(), b.id()];
    for (op, expected) in [
        (ReduceOperation::Sum, [4.0f32, 6.0, 2.0]),
        (ReduceOperation::Mean, [2.0f32, 3.0, 1.0]),
    ] {
        let (on_a, on_b) = std::thread::scope(|scope| {
            let ids_a = ids.clone();
            let ids_b = ids.clone();
            let first = scope.spawn(move || all_reduce_on::<B>(a, vec![1.0, 2.0, 3.0], op, ids_a));
            let second =
                scope.spawn(move || all_reduce_on::<B>(b, vec![3.0, 4.0, -1.0], op, ids_b));
            (first.join().unwrap(), second.join().unwrap())
        });
        assert_eq!(on_a, expected, "{op:?} on A");
        assert_eq!(on_b, expected, "{op:?} on B");
    }
}

#[cfg(feature = "distributed")]
#[test]
fn burns_all_reduce_sums_and_averages_across_two_devices_unfused_and_fused() {
    let Some((a, b, _turn)) = two_devices() else {
        return;
    };
    all_reduce_both::<CachingWgpuUnfused>(&a, &b);
    all_reduce_both::<CachingWgpu>(&a, &b);
    backend::empty_cache(&a);
    backend::empty_cache(&b);
}
