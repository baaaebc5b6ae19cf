//! The scenario this project grew from, step by step: a 1.6 GB buffer is allocated, freed,
//! the cache is emptied, a small buffer is allocated, and the big one again. After each step
//! it prints what `memory_allocated` and `memory_reserved` say and why they moved.
//!
//! `cargo run --example seed_walkthrough` runs it on the simulated device (an 80 GB device
//! that exists only in memory); `--device cuda` runs it on the first CUDA GPU.

use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator, MemoryStats};
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Device {
    /// A simulated 80 GB device: runs anywhere.
    Sim,
    /// The first CUDA device (needs the `cuda` feature and an NVIDIA driver).
    Cuda,
}

#[derive(Parser)]
#[command(about = "The seed scenario: how allocated and reserved memory move")]
struct Args {
    #[arg(long, value_enum, default_value = "sim")]
    device: Device,
}

const F32: u64 = 4;

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn report(step: &str, stats: &MemoryStats, why: &str) {
    println!(
        "{step:<34} allocated {:>9.1} MB   reserved {:>9.1} MB",
        mb(stats.memory_allocated()),
        mb(stats.memory_reserved())
    );
    println!("    why: {why}");
}

fn walkthrough<D: DeviceMemory>(device: D) -> Result<(), Box<dyn std::error::Error>> {
    let alloc = CachingAllocator::new(device, AllocatorConfig::default())?;
    let stream = DeviceStream::default();
    let big = 20_000 * 20_000 * F32;
    let small = 500 * 500 * F32;

    report("start", &alloc.stats(), "nothing allocated, nothing cached");

    let a = alloc.malloc(big, stream)?;
    report(
        "allocate 20000x20000 f32",
        &alloc.stats(),
        "a request over 10 MiB gets a segment of its own, rounded up to 2 MiB",
    );

    alloc.free(a)?;
    report(
        "free it",
        &alloc.stats(),
        "allocated falls at once; the segment stays cached in the large pool for reuse",
    );

    alloc.empty_cache()?;
    report(
        "empty_cache()",
        &alloc.stats(),
        "the cached segment had no live block, so it went back to the device",
    );

    let b = alloc.malloc(small, stream)?;
    report(
        "allocate 500x500 f32",
        &alloc.stats(),
        "1 MB is at most 1 MiB: the small pool serves it from a new 2 MiB segment",
    );

    let c = alloc.malloc(big, stream)?;
    report(
        "allocate 20000x20000 f32 again",
        &alloc.stats(),
        "nothing cached fits, so a new 1.6 GB segment is allocated beside the small one",
    );

    alloc.free(b)?;
    alloc.free(c)?;
    println!("\n{}", alloc.summary());
    Ok(())
}

fn main() {
    let args = Args::parse();
    let result = match args.device {
        Device::Sim => walkthrough(SimDevice::new(80_000_000_000)),
        Device::Cuda => run_cuda(),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
fn run_cuda() -> Result<(), Box<dyn std::error::Error>> {
    use burn_caching_alloc::cuda::{CudaMemory, cuda_available};
    let device = cuda_available()
        .map_err(|e| e.to_string())
        .and_then(|()| CudaMemory::new(0).map_err(|e| e.to_string()));
    match device {
        Ok(device) => walkthrough(device),
        Err(why) => {
            eprintln!("no CUDA device found ({why}); run with `--device sim` instead");
            std::process::exit(2);
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn run_cuda() -> Result<(), Box<dyn std::error::Error>> {
    eprintln!(
        "built without the `cuda` feature; run with `--device sim` or rebuild with `--features cuda`"
    );
    std::process::exit(2);
}
