//! What a CUDA device can do, told to CubeCL (device properties) and to the CUDA C++ compiler
//! (compilation options), from the device's attributes and compute capability.
//!
//! The features are `cubecl-cuda` 0.10's (`runtime.rs`, `DeviceService::init`), so Burn and
//! cubecl-matmul plan the same kernels on `CachingCuda` as on stock `Cuda` and a comparison
//! of the two compares allocators only. One family stays off: tensor maps (TMA), which need
//! `CUtensorMap` kernel arguments the caching server does not build (the server refuses a
//! launch that carries them). Everything else needs nothing but the kernel's own code and a
//! plain `cuLaunchKernel`, which is how the driver launches.

use cubecl_common::profile::TimingMethod;
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_scaled_mma_features,
    register_wmma_features,
};
use cubecl_ir::features::{AtomicUsage, Plane, TypeUsage};
use cubecl_ir::{
    BarrierLevel, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, SemanticType, StorageType, Type, VectorSize,
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

/// The device attributes the setup is computed from.
#[derive(Debug, Clone)]
pub struct DeviceAttributes {
    /// Compute capability, major and minor.
    pub compute_capability: (u32, u32),
    /// Threads per warp.
    pub warp_size: u32,
    /// Shared memory a block may opt in to, in bytes.
    pub max_shared_memory: usize,
    /// Largest grid, per dimension.
    pub max_grid: (u32, u32, u32),
    /// Largest block, per dimension.
    pub max_block: (u32, u32, u32),
    /// Threads per block.
    pub max_threads_per_block: u32,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Total device memory, in bytes.
    pub total_memory: u64,
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
    let get = |attr| attribute(context, attr).map(|value| value as u32);
    let attributes = DeviceAttributes {
        compute_capability: (
            get(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        warp_size: get(CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
        max_shared_memory: get(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
        max_grid: (
            get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ),
        max_block: (
            get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
            get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
            get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
        ),
        max_threads_per_block: get(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        multiprocessors: get(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        total_memory,
    };
    let name = context
        .name()
        .unwrap_or_else(|_| format!("CUDA device {}", context.ordinal()));
    Ok(setup(&attributes, name, cudarc::driver::sys::CUDA_VERSION))
}

/// The properties and compiler options for a device with `attributes`, built against CUDA
/// `cuda_version` (e.g. 12080 for 12.8). No driver call: testable without a GPU.
pub fn setup(attributes: &DeviceAttributes, name: String, cuda_version: u32) -> CudaDeviceSetup {
    let (major, minor) = attributes.compute_capability;
    let arch = major * 10 + minor;
    let warp_size = attributes.warp_size;
    let cuda_arch = CudaArchitecture { version: arch };
    let wmma = CudaWmmaCompiler::supported_wmma_combinations(&cuda_arch);

    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: warp_size,
        plane_size_max: warp_size,
        max_bindings: MAX_BINDINGS,
        max_shared_memory_size: attributes.max_shared_memory,
        max_cube_count: attributes.max_grid,
        max_units_per_cube: attributes.max_threads_per_block,
        max_cube_dim: attributes.max_block,
        num_streaming_multiprocessors: Some(attributes.multiprocessors),
        num_cpu_cores: None,
        num_tensor_cores: tensor_cores_per_multiprocessor(arch),
        min_tensor_cores_dim: (!wmma.is_empty()).then_some(8),
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: (attributes.total_memory / 4).max(MEMORY_ALIGNMENT),
        alignment: MEMORY_ALIGNMENT,
    };

    let mut properties =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    let mut features = CppSupportedFeatures {
        fast_math: true,
        ..Default::default()
    };
    register_supported_types(&mut properties);
    properties.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    let f16 = || Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F16)));
    let f32 = || Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32)));
    if arch >= 60 {
        properties.register_atomic_type_usage(
            Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F64))),
            AtomicUsage::Add | AtomicUsage::LoadStore,
        );
    }
    if arch >= 70 {
        properties.register_atomic_type_usage(f16(), AtomicUsage::Add | AtomicUsage::LoadStore);
        // Vector atomics, pipelines and barriers are code in the kernel (CUDA C++ and CCCL's
        // headers): nothing to pass at launch.
        properties.register_atomic_type_usage(
            f16().with_vector_size(2),
            AtomicUsage::Add | AtomicUsage::LoadStore,
        );
        properties.register_semantic_type(SemanticType::Pipeline);
        properties.register_type_usage(OpaqueType::Barrier(BarrierLevel::Unit), TypeUsage::Buffer);
        properties.register_type_usage(OpaqueType::Barrier(BarrierLevel::Cube), TypeUsage::Buffer);
        properties.features.plane.insert(Plane::Sync);
        // Scalars and static metadata by value, as cubecl-cuda passes them: the driver reports
        // `MetadataLayout::GridConstant` and the server uploads only dynamic metadata.
        features.grid_constants = true;
    }
    if arch >= 75 {
        // ldmatrix: an instruction in the kernel.
        for elem in [FloatKind::F16, FloatKind::BF16] {
            properties
                .features
                .matmul
                .ldmatrix
                .insert(ElemType::Float(elem).into());
        }
        // The fast tanh intrinsic needs CUDA 12.8's headers, as in cubecl-cuda.
        features.fast_tanh = cuda_version >= 12080;
    }
    if arch >= 80 {
        // cp.async: an instruction in the kernel.
        properties.features.copy_async = true;
    }
    // Atomic bf16 add stays off, as in cubecl-cuda (synchronisation issues observed there).
    if arch >= 89 {
        for elem in [FloatKind::E4M3, FloatKind::E5M2] {
            properties.register_type_usage(
                ElemType::Float(elem),
                TypeUsage::Conversion | TypeUsage::Buffer,
            );
        }
    }
    if arch >= 90 {
        // Off: TMA (`Tma::Base`, the `TensorMap` semantic type). Its kernels take
        // `CUtensorMap` arguments built from the tensor's layout at launch, which the caching
        // server does not build; it refuses a launch that carries tensor maps instead.
        //
        // On: thread-block clusters (the cluster shape is compiled into the kernel with
        // `__cluster_dims__`, and cubecl-cuda launches such kernels with a plain
        // `cuLaunchKernel`, as this driver does), `elect.sync`, stmatrix, vector f32 atomics:
        // all kernel code.
        properties.features.cube_cluster = true;
        features.clusters = true;
        features.elect_sync = true;
        for elem in [FloatKind::F16, FloatKind::BF16] {
            properties
                .features
                .matmul
                .stmatrix
                .insert(ElemType::Float(elem).into());
        }
        for width in [2, 4] {
            properties.register_atomic_type_usage(
                f32().with_vector_size(width),
                AtomicUsage::LoadStore | AtomicUsage::Add,
            );
        }
    }
    // Off from sm_100: `Tma::Im2colWide` and `Tma::SwizzleAtomicity` (TMA, see above).
    if matches!(major, 10..=12) {
        // FP6/FP4 storage types: compatible within these major versions, as in cubecl-cuda.
        properties.register_type_usage(ElemType::Float(FloatKind::E2M1), TypeUsage::Conversion);
        properties.register_type_usage(
            StorageType::Packed(ElemType::Float(FloatKind::E2M1), 2),
            TypeUsage::Conversion | TypeUsage::Buffer,
        );
        for elem in [FloatKind::E2M3, FloatKind::E3M2, FloatKind::UE8M0] {
            properties.register_type_usage(
                ElemType::Float(elem),
                TypeUsage::Conversion | TypeUsage::Buffer,
            );
        }
    }
    properties.features.memory_reinterpret = true;
    properties.features.alignment = true;
    properties.features.plane.insert(Plane::Ops);
    properties
        .features
        .plane
        .insert(Plane::NonUniformControlFlow);

    register_wmma_features(wmma, &mut properties);
    register_mma_features(
        CudaWmmaCompiler::supported_mma_combinations(&cuda_arch),
        &mut properties,
    );
    // Scaled MMA (block-scaled formats): instructions in the kernel.
    register_scaled_mma_features(
        CudaWmmaCompiler::supported_scaled_mma_combinations(&cuda_arch),
        &mut properties,
    );

    let options = CompilationOptions {
        warp_size,
        supports_features: features,
    };

    CudaDeviceSetup {
        arch,
        properties,
        options,
        name,
    }
}

/// Tensor cores per streaming multiprocessor, for the architectures where it is known.
fn tensor_cores_per_multiprocessor(arch: u32) -> Option<u32> {
    match arch {
        70 | 75 => Some(8),
        80 | 86 | 87 | 89 | 90 | 91 | 92 | 100 => Some(4),
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

    fn device(major: u32, minor: u32) -> DeviceAttributes {
        DeviceAttributes {
            compute_capability: (major, minor),
            warp_size: 32,
            max_shared_memory: 227 << 10,
            max_grid: (i32::MAX as u32, 65535, 65535),
            max_block: (1024, 1024, 64),
            max_threads_per_block: 1024,
            multiprocessors: 132,
            total_memory: 141 << 30,
        }
    }

    fn storage(elem: FloatKind) -> StorageType {
        StorageType::Scalar(ElemType::Float(elem))
    }

    #[test]
    fn hopper_gets_cubecl_cudas_features_except_tensor_maps() {
        // cubecl-cuda 0.10, `DeviceService for CudaServer::init`, for sm_90.
        let setup = setup(&device(9, 0), "H200".into(), 12080);
        let p = &setup.properties;
        let f = &setup.options.supports_features;
        assert_eq!(setup.arch, 90);
        assert!(f.grid_constants && f.clusters && f.elect_sync && f.fast_tanh && f.fast_math);
        assert!(p.features.copy_async);
        assert!(p.features.cube_cluster);
        assert!(!p.features.matmul.ldmatrix.is_empty());
        assert!(!p.features.matmul.stmatrix.is_empty());
        assert!(p.features.types.semantic.contains(&SemanticType::Pipeline));
        for level in [BarrierLevel::Unit, BarrierLevel::Cube] {
            assert!(p.supports_type(StorageType::Opaque(OpaqueType::Barrier(level))));
        }
        for elem in [FloatKind::E4M3, FloatKind::E5M2] {
            assert!(p.type_usage(storage(elem)).contains(TypeUsage::Buffer));
        }
        let f32x4 =
            Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(4);
        assert!(p.atomic_type_usage(f32x4).contains(AtomicUsage::Add));
        assert!(!p.features.matmul.mma.is_empty());
        // Off: TMA needs tensor-map arguments the server does not build.
        assert!(p.features.tma.is_empty());
        assert!(!p.features.types.semantic.contains(&SemanticType::TensorMap));
    }

    #[test]
    fn blackwell_adds_fp4_types_and_still_no_tensor_maps() {
        let setup = setup(&device(10, 0), "B200".into(), 12080);
        let p = &setup.properties;
        assert!(
            p.type_usage(StorageType::Packed(ElemType::Float(FloatKind::E2M1), 2))
                .contains(TypeUsage::Buffer)
        );
        assert!(
            p.type_usage(storage(FloatKind::UE8M0))
                .contains(TypeUsage::Buffer)
        );
        assert!(p.features.tma.is_empty());
    }

    #[test]
    fn older_devices_get_only_what_they_have() {
        // Pascal: no grid constants (metadata goes in a device buffer), no barriers.
        let pascal = setup(&device(6, 1), "P100".into(), 12080);
        assert!(!pascal.options.supports_features.grid_constants);
        assert!(!pascal.properties.features.copy_async);
        assert!(
            !pascal
                .properties
                .features
                .types
                .semantic
                .contains(&SemanticType::Pipeline)
        );
        // Turing: ldmatrix, but no cp.async, and fast tanh only with CUDA 12.8's headers.
        let turing = setup(&device(7, 5), "T4".into(), 12040);
        assert!(turing.options.supports_features.grid_constants);
        assert!(!turing.properties.features.matmul.ldmatrix.is_empty());
        assert!(!turing.properties.features.copy_async);
        assert!(!turing.options.supports_features.fast_tanh);
        assert!(!turing.options.supports_features.clusters);
    }

    #[test]
    fn nvrtc_targets_the_exact_architecture() {
        assert_eq!(nvrtc_arch_option(86), "--gpu-architecture=sm_86");
        assert_eq!(nvrtc_arch_option(90), "--gpu-architecture=sm_90a");
    }
}
