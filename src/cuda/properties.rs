//! What a CUDA device can do, told to CubeCL (device properties) and to the CUDA C++ compiler
//! (compilation options), from the device's attributes and compute capability.
//!
//! The caching server binds plain buffers only, so features that need other kinds of kernel
//! arguments are left off on purpose: tensor maps (TMA), thread-block clusters, and metadata
//! passed as grid constants. CubeCL and Burn then pick kernels that do not use them.

use cubecl_common::profile::TimingMethod;
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};
use cubecl_ir::features::{AtomicUsage, Plane, TypeUsage};
use cubecl_ir::{
    DeviceProperties, ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties, StorageType,
    Type, VectorSize,
};
use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUdevice_attribute;

use crate::runtime::DriverError;

/// Bindings a kernel may take (same bound as cubecl-cuda).
pub const MAX_BINDINGS: u32 = cubecl_cuda::CUDA_MAX_BINDINGS;

/// Offsets of slices handed to kernels are multiples of this (what `cuMemAllocPitch` aligns
/// rows to; the engine's blocks are 512-byte multiples too).
pub const MEMORY_ALIGNMENT: u64 = 512;

/// A device's compute capability and what follows from it.
#[derive(Debug)]
pub struct CudaDeviceSetup {
    /// Compute capability as `major * 10 + minor` (e.g. 90 for an H100/H200).
    pub arch: u32,
    /// Properties CubeCL and Burn plan kernels with.
    pub properties: DeviceProperties,
    /// Options of the CUDA C++ compiler.
    pub options: CompilationOptions,
    /// Device name as the driver reports it.
    pub name: String,
}

fn attribute(context: &CudaContext, attr: CUdevice_attribute) -> Result<i32, DriverError> {
    context.attribute(attr).map_err(|err| {
        DriverError::call(
            "CUDA",
            "cuDeviceGetAttribute",
            format!("{attr:?}: {:?}", err.0),
        )
    })
}

/// Reads the attributes of the device of `context` (which must be current on this thread).
pub fn probe(context: &CudaContext, total_memory: u64) -> Result<CudaDeviceSetup, DriverError> {
    use CUdevice_attribute::*;
    let major = attribute(context, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(context, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let arch = (major * 10 + minor) as u32;
    let warp_size = attribute(context, CU_DEVICE_ATTRIBUTE_WARP_SIZE)? as u32;
    let name = context
        .name()
        .unwrap_or_else(|_| format!("CUDA device {}", context.ordinal()));

    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: warp_size,
        plane_size_max: warp_size,
        max_bindings: MAX_BINDINGS,
        max_shared_memory_size: attribute(
            context,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize,
        max_cube_count: (
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)? as u32,
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)? as u32,
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)? as u32,
        ),
        max_units_per_cube: attribute(context, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
        max_cube_dim: (
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)? as u32,
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)? as u32,
            attribute(context, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)? as u32,
        ),
        num_streaming_multiprocessors: Some(attribute(
            context,
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32),
        num_cpu_cores: None,
        num_tensor_cores: tensor_cores_per_multiprocessor(arch),
        min_tensor_cores_dim: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: (total_memory / 4).max(MEMORY_ALIGNMENT),
        alignment: MEMORY_ALIGNMENT,
    };

    let mut properties =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    register_supported_types(&mut properties);
    properties.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    if arch >= 60 {
        properties.register_atomic_type_usage(
            Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F64))),
            AtomicUsage::Add | AtomicUsage::LoadStore,
        );
    }
    if arch >= 70 {
        properties.register_atomic_type_usage(
            Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F16))),
            AtomicUsage::Add | AtomicUsage::LoadStore,
        );
        properties.features.plane.insert(Plane::Sync);
    }
    properties.features.memory_reinterpret = true;
    properties.features.alignment = true;
    properties.features.plane.insert(Plane::Ops);
    properties
        .features
        .plane
        .insert(Plane::NonUniformControlFlow);

    let cuda_arch = CudaArchitecture { version: arch };
    let wmma = CudaWmmaCompiler::supported_wmma_combinations(&cuda_arch);
    if !wmma.is_empty() {
        properties.hardware.min_tensor_cores_dim = Some(8);
    }
    register_wmma_features(wmma, &mut properties);
    register_mma_features(
        CudaWmmaCompiler::supported_mma_combinations(&cuda_arch),
        &mut properties,
    );

    let options = CompilationOptions {
        warp_size,
        supports_features: CppSupportedFeatures {
            // Metadata goes in a buffer, bound after the kernel's buffers.
            grid_constants: false,
            clusters: false,
            fast_math: true,
            fast_tanh: false,
            elect_sync: false,
        },
    };

    Ok(CudaDeviceSetup {
        arch,
        properties,
        options,
        name,
    })
}

/// Tensor cores per streaming multiprocessor, for the architectures where it is known.
fn tensor_cores_per_multiprocessor(arch: u32) -> Option<u32> {
    match arch {
        70 | 75 => Some(8),
        80 | 86 | 87 | 89 | 90 | 100 => Some(4),
        _ => None,
    }
}

/// The `--gpu-architecture` NVRTC option for `arch`: the architecture-specific variant
/// (`sm_90a`) from Hopper on, so code may use every instruction of the exact device.
pub fn nvrtc_arch_option(arch: u32) -> String {
    if arch >= 90 {
        format!("--gpu-architecture=sm_{arch}a")
    } else {
        format!("--gpu-architecture=sm_{arch}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_targets_the_exact_architecture() {
        assert_eq!(nvrtc_arch_option(86), "--gpu-architecture=sm_86");
        assert_eq!(nvrtc_arch_option(90), "--gpu-architecture=sm_90a");
    }
}
