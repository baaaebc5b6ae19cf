//! Kernels under the fake: CubeCL's CUDA C++ goes through the fake NVRTC (which reads the
//! entry points' declarations into an image of its own) and the fake driver (which loads that
//! image, checks every launch and queues it on its stream, where it changes no byte but counts,
//! for the race detector, as a read or a write of exactly each tensor's bytes). So Burn runs on
//! `CachingCuda` here, values aside (kernels compute nothing): a launch on fake device 9, Burn's
//! own training step on `Autodiff<CachingCuda>` with the statistics the wgpu tests assert, a
//! tensor made on one thread and used by a kernel on another; and, in a child process on fake
//! device 0, that a launch with a freed or out-of-bounds pointer, or racing another stream's
//! kernel, is reported (so that an empty log means something).
//!
//! On the real driver (`BURN_CACHING_ALLOC_REAL_CUDA=1`) the Burn tests run on device 0 and the
//! values are checked too.

use std::ffi::{CString, c_void};

use burn::backend::Autodiff;
use burn::backend::cuda::CudaDevice;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::alloc::BlockState;
use burn_caching_alloc::backend::{self, CachingCuda, CachingCudaUnfused};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, result};
use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys::nvrtcResult;
use parking_lot::Mutex;

use crate::detector::{fake_in_child, violations_with};
use crate::fake_cuda::{Driver, fake_or_skip};
use crate::mlp_check::{INPUTS, Mlp, lcg};

/// The Burn tests of this file share device 9 (one engine per device per process): one at a
/// time.
static DEVICE_9: Mutex<()> = Mutex::new(());

fn device(driver: &Driver) -> CudaDevice {
    CudaDevice::new(driver.ordinal(9))
}

fn launches(driver: &Driver) -> u64 {
    driver.fake().map_or(0, |fake| fake.calls("cuLaunchKernel"))
}

/// A strided operand (dynamic metadata), scalars and an addition on `CachingCudaUnfused`, each
/// its own launch, then on `CachingCuda` (fused): read back. The fake reports nothing, every
/// launch went through the fake NVRTC and `cuLaunchKernel`, and on the real driver the values
/// are right.
#[test]
fn kernels_launched_through_caching_cuda_run_with_no_violation() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_9.lock();
    let _real = driver.real_turn();
    let device = device(&driver);
    let (rows, cols) = (48, 80);
    let x = lcg(1, rows * cols);
    let before = launches(&driver);

    type U = CachingCudaUnfused;
    let a = Tensor::<U, 2>::from_data(TensorData::new(x.clone(), [rows, cols]), &device);
    let b = a.clone().transpose().mul_scalar(2.0) + Tensor::<U, 2>::ones([cols, rows], &device);
    let unfused = b.into_data().to_vec::<f32>().expect("f32");

    type F = CachingCuda;
    let c = Tensor::<F, 2>::from_data(TensorData::new(x.clone(), [rows, cols]), &device);
    let fused = ((c.clone() * 3.0).exp() - c)
        .sum_dim(1)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");

    if let Some(fake) = driver.fake() {
        fake.assert_no_violations();
        assert!(
            launches(&driver) >= before + 3,
            "kernels launched: {}",
            fake.call_counts()
        );
        assert!(fake.calls("nvrtcCompileProgram") > 0);
        assert!(fake.calls("cuModuleGetFunction") > 0);
    } else {
        for r in 0..cols {
            for c in 0..rows {
                let want = 2.0 * x[c * cols + r] + 1.0;
                assert!((unfused[r * rows + c] - want).abs() < 1e-4);
            }
        }
        for (r, got) in fused.iter().enumerate() {
            let want: f32 = x[r * cols..(r + 1) * cols]
                .iter()
                .map(|v| (3.0 * v).exp() - v)
                .sum();
            assert!(
                (got - want).abs() < 1e-2 * want.abs().max(1.0),
                "{got} != {want}"
            );
        }
    }
}

/// The sum of the allocated blocks of a snapshot.
fn allocated_in_snapshot(device: &CudaDevice) -> u64 {
    backend::memory_snapshot(device)
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.state == BlockState::ActiveAllocated)
        .map(|block| block.size)
        .sum()
}

/// Burn's training step (forward, backward, Adam) on `B`: steps the model, returns the losses
/// and the reserved bytes after each step. Asserts, with the model live, what the wgpu tests
/// assert of the statistics: something allocated, every way of reading it agreeing (the
/// snapshot's blocks), reserved covering it.
fn train<B>(device: &B::Device, steps: usize) -> (Vec<f32>, Vec<u64>)
where
    B: AutodiffBackend<Device = CudaDevice>,
{
    let batch = 64;
    let x = lcg(1, batch * INPUTS);
    let y: Vec<f32> = x
        .chunks(INPUTS)
        .map(|row| row[0] * row[1] + row[2])
        .collect();
    let inputs = Tensor::<B, 2>::from_data(TensorData::new(x, [batch, INPUTS]), device);
    let targets = Tensor::<B, 2>::from_data(TensorData::new(y, [batch, 1]), device);
    let mut model = Mlp::<B>::new(32, device);
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::with_capacity(steps);
    let mut reserved = Vec::with_capacity(steps);
    for _ in 0..steps {
        let prediction = model.forward(inputs.clone());
        let loss = (prediction - targets.clone()).powi_scalar(2).mean();
        losses.push(loss.clone().into_data().to_vec::<f32>().expect("f32 loss")[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        reserved.push(backend::memory_stats(device).memory_reserved());
    }
    let stats = backend::memory_stats(device);
    let allocated = stats.memory_allocated();
    assert!(
        allocated > 0,
        "the model, its optimizer state and the data are live"
    );
    assert!(stats.memory_reserved() >= allocated);
    assert_eq!(allocated_in_snapshot(device), allocated);
    let snapshot = backend::memory_snapshot(device);
    assert!(
        !snapshot.segments.is_empty(),
        "a snapshot of the live segments"
    );
    assert_eq!(
        snapshot.segments.iter().map(|s| s.total_size).sum::<u64>(),
        stats.memory_reserved()
    );
    (losses, reserved)
}

/// Burn's own training step on `Autodiff<CachingCuda>` under the fake: a small MLP, forward,
/// backward and Adam, eight steps, every kernel launched and checked. No violation; reserved
/// memory stops growing after the first steps; after everything is dropped, allocated memory
/// is back where it started and `empty_cache` hands every byte back (the fake holds nothing
/// more than the engine reserves), as on wgpu (`tests/support/mlp_check.rs`).
#[test]
fn burn_trains_an_mlp_on_autodiff_caching_cuda_with_no_violation() {
    const STEPS: usize = 8;
    const WARMUP: usize = 4;
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_9.lock();
    let _real = driver.real_turn();
    let device = device(&driver);
    backend::empty_cache(&device);
    let allocated_before = backend::memory_allocated(&device);
    let launches_before = launches(&driver);
    <Autodiff<CachingCuda> as Backend>::seed(&device, 42);

    let (losses, reserved) = train::<Autodiff<CachingCuda>>(&device, STEPS);
    println!("losses {losses:?}; reserved per step {reserved:?}");
    let settled = reserved[WARMUP - 1];
    for (step, bytes) in reserved.iter().enumerate().skip(WARMUP) {
        assert_eq!(*bytes, settled, "reserved grew at step {}", step + 1);
    }

    backend::empty_cache(&device);
    let stats = backend::memory_stats(&device);
    assert_eq!(
        stats.memory_allocated(),
        allocated_before,
        "{:?}",
        stats.cubecl
    );
    assert_eq!(
        stats.memory_reserved(),
        0,
        "{}",
        backend::memory_summary(&device)
    );
    assert_eq!(stats.cached_in_cubecl(), 0);
    match driver.fake() {
        Some(fake) => {
            fake.assert_no_violations();
            assert!(
                launches(&driver) > launches_before + STEPS as u64,
                "{}",
                fake.call_counts()
            );
            let live = fake.live(9);
            assert_eq!(live.allocated + live.created, 0, "{live:?}");
        }
        None => {
            assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
            assert!(losses[STEPS - 1] < losses[0], "{losses:?}");
        }
    }
}

/// Made on one thread, used by kernels on another: each thread is its own CubeCL stream, so
/// its own CUDA stream, and the consumer's kernels must be ordered after the producer's upload
/// (the server's wait for the producer's event, `order_after`). The producer reads the tensor
/// in its own kernels meanwhile (two streams reading the same bytes need no order). Rounds of
/// sizes, unfused and fused; the race detector, which does not depend on the order work ran
/// in, reports nothing. Without that wait it reports the consumer's kernel reading bytes the
/// producer's upload writes, at the first round.
///
/// The producer keeps its handle until the consumer is done: consuming it while the consumer's
/// kernels may still read it is the race of
/// [`an_in_place_write_after_another_streams_read_waits_for_that_read`] (and, fused, burn-fusion
/// 0.21's cross-thread handle bug, tracel-ai/burn#4947).
#[test]
fn a_tensor_made_on_one_thread_is_used_by_kernels_on_another_with_no_violation() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_9.lock();
    let _real = driver.real_turn();
    let device = device(&driver);
    for (round, size) in [64usize, 4096, 70_000, 1 << 20].into_iter().enumerate() {
        let x = lcg(round as u64 + 7, size);
        let (unfused, fused) = (
            across_threads::<CachingCudaUnfused>(&device, &x),
            across_threads::<CachingCuda>(&device, &x),
        );
        if let Some(fake) = driver.fake() {
            fake.assert_no_violations();
        } else {
            for (got, v) in unfused.iter().chain(&fused).zip(x.iter().chain(&x)) {
                assert!((got - (3.0 * v + 1.0)).abs() < 1e-4, "{got} for {v}");
            }
        }
    }
}

/// `x` uploaded on this thread; another thread computes `3x + 1` from it and reads it back while
/// this one computes `2x` from it.
fn across_threads<B: Backend<Device = CudaDevice>>(device: &CudaDevice, x: &[f32]) -> Vec<f32> {
    let tensor = Tensor::<B, 1>::from_data(TensorData::new(x.to_vec(), [x.len()]), device);
    let shared = tensor.clone();
    let consumer = std::thread::spawn(move || {
        (shared * 3.0 + 1.0)
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    });
    let doubled = (tensor.clone() * 2.0).into_data();
    assert_eq!(doubled.num_elements(), x.len());
    let result = consumer.join().expect("the consumer thread");
    drop(tensor);
    result
}

/// PyTorch's `record_stream` rule with a kernel as the other stream's use: a tensor made on one
/// thread is read by a kernel on another thread, which drops its handle at once (its result has
/// another type, so nothing runs in place); the first thread's next tensor of the same size
/// must not get that memory before the kernel ran (the server holds the binding until an event
/// recorded after the kernel completed, `hold_until_done`). Every scheduler mode, 6 seeds each,
/// both pools' sizes; the race detector reports nothing (without the hold it reports the next
/// tensor's upload writing bytes the kernel reads).
#[test]
fn memory_another_threads_kernel_read_is_not_handed_to_the_next_tensor_before_the_kernel_ran() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_9.lock();
    let _real = driver.real_turn();
    let device = device(&driver);
    type U = CachingCudaUnfused;
    let modes: &[crate::fake_cuda::Schedule] = match driver.fake() {
        Some(_) => &crate::fake_cuda::SCHEDULES,
        None => &[crate::fake_cuda::Schedule::Eager],
    };
    for mode in modes {
        for seed in 0..6u64 {
            if let Some(fake) = driver.fake() {
                fake.set_schedule(*mode, seed);
            }
            // 16 KiB (small pool) or 3 MiB (large pool) of f32.
            let n = if seed % 2 == 0 { 4096 } else { 3 << 18 };
            let (a, b) = (1.0 + seed as f32, -2.0);
            let first = Tensor::<U, 1>::from_data(TensorData::new(vec![a; n], [n]), &device);
            let (issued, wait_issued) = std::sync::mpsc::channel();
            let consumer = std::thread::spawn(move || {
                let mask = first.equal_elem(a);
                issued.send(()).expect("the producer waits");
                mask.int().into_data().to_vec::<i32>().expect("i32")
            });
            wait_issued.recv().expect("the consumer issued its kernel");
            let second = Tensor::<U, 1>::from_data(TensorData::new(vec![b; n], [n]), &device);
            let mask = consumer.join().expect("the consumer thread");
            let again = second.into_data().to_vec::<f32>().expect("f32");
            match driver.fake() {
                Some(fake) => {
                    let violations = fake.violations();
                    assert!(
                        violations.is_empty(),
                        "{mode:?}, seed {seed}: {violations:#?}"
                    );
                }
                None => {
                    assert!(
                        mask.iter().all(|m| *m == 1),
                        "seed {seed}: the kernel read the next tensor"
                    );
                    assert!(again.iter().all(|v| *v == b));
                }
            }
        }
    }
}

/// Found by the race detector once kernels ran on the fake: a stream that writes one of its own
/// tensors in place (Burn does when the handle is unique, CubeCL's `can_mut`) must be ordered
/// after another stream's kernel that read the tensor and may not have run. Holding the binding
/// until that stream's event completed (`hold_until_done`) keeps the memory from being reused,
/// but an in-place write needs no new memory; stock CubeCL has the same gap. The server makes
/// the owner's work on the buffer wait on the device for an event on the reader's stream
/// (`order_after_uses`). Here the consumer issues `3x` (reading `x`) and drops its handle
/// without waiting; the producer's `x * 2` then runs in place on its own stream. Whether the
/// consumer's read was seen complete before the write is issued depends on timing, so the
/// rounds go through 20 seeds of the random schedule: without the wait the detector reports
/// the race at some of them (seed 1 among them).
#[test]
fn an_in_place_write_after_another_streams_read_waits_for_that_read() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_9.lock();
    let _real = driver.real_turn();
    let device = device(&driver);
    type U = CachingCudaUnfused;
    for seed in 0..20u64 {
        if let Some(fake) = driver.fake() {
            fake.set_schedule(crate::fake_cuda::Schedule::Random, seed);
        }
        let x = lcg(seed, 4096);
        let tensor = Tensor::<U, 1>::from_data(TensorData::new(x.clone(), [x.len()]), &device);
        let shared = tensor.clone();
        let (issued, wait_issued) = std::sync::mpsc::channel();
        let consumer = std::thread::spawn(move || {
            let tripled = shared * 3.0;
            issued.send(()).expect("the producer waits");
            tripled.into_data().to_vec::<f32>().expect("f32")
        });
        wait_issued.recv().expect("the consumer issued its kernel");
        let doubled = (tensor * 2.0).into_data().to_vec::<f32>().expect("f32");
        let tripled = consumer.join().expect("the consumer thread");
        match driver.fake() {
            Some(fake) => {
                let violations = fake.violations();
                assert!(violations.is_empty(), "seed {seed}: {violations:#?}");
            }
            None => {
                for ((d, t), v) in doubled.iter().zip(&tripled).zip(&x) {
                    assert!((d - 2.0 * v).abs() < 1e-5 && (t - 3.0 * v).abs() < 1e-5);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fake itself: launches it must refuse or report.

/// A kernel as cubecl-cpp writes one (sm_70 on: buffers, then the info structure by value, its
/// `static_meta` starting with each buffer's length in elements).
const KERNEL: &str = r#"
#include <cuda_fp16.h>
typedef unsigned int uint32;
struct __align__(16) float_4 { float i_0; float i_1; float i_2; float i_3; };
struct info_st {
    float scalars_float[2];uint32 static_meta[4];
};

extern "C" __global__ void __launch_bounds__(256) scale_kernel (
    float_4* buffer_0, const float* __restrict__ buffer_1, const __grid_constant__ info_st info
) {
    // a comment with __global__ in it
    buffer_0[threadIdx.x].i_0 = buffer_1[threadIdx.x] * info.scalars_float[0];
}
"#;

/// `source` through the fake NVRTC: the image, or the result and the log.
fn compile(source: &str) -> Result<Vec<std::ffi::c_char>, (nvrtcResult, String)> {
    let source = CString::new(source).expect("no NUL");
    let program = nvrtc::create_program(&source, None).expect("nvrtcCreateProgram");
    // SAFETY: a live program, destroyed once after its last use.
    unsafe {
        let compiled = nvrtc::compile_program(program, &["--gpu-architecture=sm_80"]);
        let out = match compiled {
            Ok(()) => Ok(nvrtc::get_ptx(program).expect("nvrtcGetPTX")),
            Err(err) => {
                let log = nvrtc::get_program_log(program).expect("nvrtcGetProgramLog");
                let log: Vec<u8> = log.iter().map(|c| *c as u8).collect();
                Err((err.0, String::from_utf8_lossy(&log).into_owned()))
            }
        };
        nvrtc::destroy_program(program).expect("nvrtcDestroyProgram");
        out
    }
}

/// The info structure of [`KERNEL`]: two scalars, then the two buffers' lengths (in float_4 and
/// float elements), then their logical lengths.
#[repr(C)]
struct Info {
    scalars: [f32; 2],
    static_meta: [u32; 4],
}

/// Launches [`KERNEL`] with `buffer_0` of `len0` float_4 at `out` and `buffer_1` of `len1`
/// floats at `input`.
///
/// # Safety
/// The context is current and `function` is [`KERNEL`]'s entry point.
unsafe fn launch(
    function: sys::CUfunction,
    stream: sys::CUstream,
    out: u64,
    len0: u32,
    input: u64,
    len1: u32,
    block: u32,
) -> Result<(), CUresult> {
    let (mut out, mut input) = (out, input);
    let mut info = Info {
        scalars: [2.0, 0.0],
        static_meta: [len0, len1, len0, len1],
    };
    let mut params = [
        &mut out as *mut u64 as *mut c_void,
        &mut input as *mut u64 as *mut c_void,
        &mut info as *mut Info as *mut c_void,
    ];
    unsafe { result::launch_kernel(function, (1, 1, 1), (block, 1, 1), 0, stream, &mut params) }
        .map_err(|e| e.0)
}

#[test]
fn a_source_without_an_entry_point_does_not_compile_and_a_foreign_image_does_not_load() {
    let Some(fake) = fake_in_child(
        "kernels::a_source_without_an_entry_point_does_not_compile_and_a_foreign_image_does_not_load",
    ) else {
        return;
    };
    let _context = CudaContext::new(0).expect("device 0");
    let (code, log) =
        compile("__device__ float twice(float x) { return 2 * x; }").expect_err("no entry point");
    assert_eq!(code, nvrtcResult::NVRTC_ERROR_COMPILATION);
    assert!(log.contains("no entry point"), "{log}");
    // A `__global__` without C linkage has a mangled name: not an entry point by its own.
    let (code, _) = compile("__global__ void k(float* x) { }").expect_err("mangled");
    assert_eq!(code, nvrtcResult::NVRTC_ERROR_COMPILATION);
    fake.assert_no_violations();

    let image = compile(KERNEL).expect("compiles");
    let text: String = image
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8 as char)
        .collect();
    // Each buffer's length comes from the info structure: byte 8 and 12 of parameter 2.
    assert!(
        text.contains(".param ptr rw elem=16 count=1*2@8:4 buffer_0"),
        "{text}"
    );
    assert!(
        text.contains(".param ptr r elem=4 count=1*2@12:4 buffer_1"),
        "{text}"
    );
    assert!(text.contains(".param value size=24 info"), "{text}");
    // SAFETY: a NUL-terminated image, the context current.
    unsafe {
        let module = result::module::load_data(image.as_ptr() as *const c_void).expect("loads");
        let missing = result::module::get_function(module, CString::new("other").expect("name"));
        assert_eq!(
            missing.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_NOT_FOUND)
        );
        result::module::get_function(module, CString::new("scale_kernel").expect("name"))
            .expect("the entry point");
        let ptx = c".version 8.0\n.target sm_80\n.visible .entry k()\n{\nret;\n}\n";
        let foreign = result::module::load_data(ptx.as_ptr() as *const c_void);
        assert_eq!(
            foreign.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_INVALID_IMAGE)
        );
    }
    assert_eq!(violations_with(&fake, "no entry point `other`"), 1);
    assert_eq!(violations_with(&fake, "not an image of the fake NVRTC"), 1);
}

#[test]
fn launches_with_a_freed_or_out_of_bounds_pointer_or_racing_another_stream_are_reported() {
    let Some(fake) = fake_in_child(
        "kernels::launches_with_a_freed_or_out_of_bounds_pointer_or_racing_another_stream_are_reported",
    ) else {
        return;
    };
    fake.set_schedule(crate::fake_cuda::Schedule::Delayed, 1);
    let _context = CudaContext::new(0).expect("device 0");
    let image = compile(KERNEL).expect("compiles");
    let stream =
        || result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream");
    let (a, b) = (stream(), stream());
    // SAFETY: the context is current; every pointer below is the test's own.
    unsafe {
        let module = result::module::load_data(image.as_ptr() as *const c_void).expect("loads");
        let f = result::module::get_function(module, CString::new("scale_kernel").expect("name"))
            .expect("entry");
        // One allocation of 8 KiB holding two tensors of 4 KiB, as the allocator places them.
        let segment = result::malloc_sync(8192).expect("cuMemAlloc");
        let (first, second) = (segment, segment + 4096);
        // In bounds, neighbours on two streams: no race (each launch covers its own tensors).
        launch(f, a, first, 256, first + 2048, 512, 256).expect("launch on a");
        launch(f, b, second, 128, second + 2048, 512, 128).expect("launch on b");
        fake.assert_no_violations();

        // Stream b writes the first tensor while a's kernel may still write it: a race.
        launch(f, b, first, 16, second, 16, 16).expect("launch on b");
        assert_eq!(
            violations_with(&fake, "race: cuLaunchKernel(scale_kernel) on stream"),
            1
        );
        fake.clear_violations();
        result::ctx::synchronize().expect("sync");

        // buffer_0 of 300 float_4 from `second`: 4800 bytes of the 4096 left in the allocation.
        launch(f, a, second, 300, first, 16, 64).expect("the launch itself is accepted");
        assert_eq!(
            violations_with(&fake, "overrun the allocation"),
            1,
            "{:?}",
            fake.violations()
        );
        let sticky = result::stream::synchronize(a);
        assert_eq!(
            sticky.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)
        );
        fake.clear_violations();

        // A freed allocation.
        let freed = result::malloc_sync(4096).expect("cuMemAlloc");
        result::free_sync(freed).expect("free");
        launch(f, b, first, 16, freed, 16, 64).expect("the launch itself is accepted");
        assert_eq!(
            violations_with(&fake, "not device memory"),
            1,
            "{:?}",
            fake.violations()
        );
        fake.clear_violations();

        // The shape: an empty grid, over the block limit, over the launch bounds.
        let c = stream();
        let mut out = first;
        let mut input = second;
        let mut info = Info {
            scalars: [0.0; 2],
            static_meta: [1, 1, 1, 1],
        };
        let mut params = [
            &mut out as *mut u64 as *mut c_void,
            &mut input as *mut u64 as *mut c_void,
            &mut info as *mut Info as *mut c_void,
        ];
        let empty = result::launch_kernel(f, (0, 1, 1), (32, 1, 1), 0, c, &mut params);
        assert_eq!(
            empty.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        let wide = result::launch_kernel(f, (1, 1, 1), (2048, 1, 1), 0, c, &mut params);
        assert_eq!(
            wide.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        let bounds = result::launch_kernel(f, (1, 1, 1), (512, 1, 1), 0, c, &mut params);
        assert_eq!(
            bounds.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
        );
        let shared = result::launch_kernel(f, (1, 1, 1), (32, 1, 1), 64 << 10, c, &mut params);
        assert_eq!(
            shared.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(fake.violations().len(), 4, "{:?}", fake.violations());
        fake.clear_violations();
        result::stream::synchronize(c).expect("nothing was queued on c");
        result::stream::synchronize(b).ok();
        result::free_sync(segment).expect("free");
    }
}
