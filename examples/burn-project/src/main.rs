//! A Burn project whose backend is chosen by its `caching-alloc` feature.
//!
//! ```text
//! cargo run                           # Burn's stock wgpu backend
//! cargo run --features caching-alloc  # the same code on burn-caching-alloc
//! ```

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;

/// The one line that changes: the inner backend.
#[cfg(feature = "caching-alloc")]
type Inner = burn_caching_alloc::backend::CachingWgpu;
#[cfg(not(feature = "caching-alloc"))]
type Inner = burn::backend::Wgpu;

/// Everything else in the project is written against this alias.
pub type Backend = Autodiff<Inner>;

fn main() {
    let device = WgpuDevice::default();
    let layer: Linear<Backend> = LinearConfig::new(784, 10).init(&device);
    let images = Tensor::<Backend, 2>::random([64, 784], Distribution::Default, &device);
    let loss = layer.forward(images).powf_scalar(2.0).mean();
    let grads = loss.backward();
    let weight_grad = layer.weight.grad(&grads).map(|g| g.dims());
    println!(
        "loss {}, weight gradient {weight_grad:?}",
        loss.into_scalar()
    );

    // Only the caching backend has allocator statistics.
    #[cfg(feature = "caching-alloc")]
    {
        let stats = burn_caching_alloc::backend::memory_stats(&device);
        println!(
            "reserved {} B, peak reserved {} B, device allocations {}",
            stats.memory_reserved(),
            stats.max_memory_reserved(),
            stats.engine.num_device_alloc
        );
    }
}
