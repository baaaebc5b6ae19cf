//! CUDA kernels: CubeCL's CUDA C++ compiler (cubecl-cpp), NVRTC for the device's exact
//! architecture, and the driver's module loader. The server caches the result per kernel id.

use std::ffi::{CStr, CString};
use std::panic::{AssertUnwindSafe, catch_unwind};

use cubecl_common::backtrace::BackTrace;
use cubecl_core::CubeDim;
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppCompiler};
use cubecl_runtime::compiler::{CompilationError, CubeTask};
use cubecl_runtime::server::{ExecutionMode, LaunchError, ResourceLimitError};
use cudarc::driver::result;
use cudarc::driver::sys::{self, CUfunction_attribute};
use cudarc::nvrtc::result as nvrtc;

use super::properties::nvrtc_arch_option;
use crate::runtime::DriverError;

/// CubeCL's CUDA C++ compiler, with CUDA's own WMMA intrinsics.
pub type CudaCppCompiler = CppCompiler<CudaDialect<CudaWmmaCompiler>>;

/// A loaded kernel: its module's entry point, launch shape and shared memory.
#[derive(Debug)]
pub struct CudaKernel {
    function: sys::CUfunction,
    cube_dim: CubeDim,
    shared_memory: u32,
    name: String,
}

// SAFETY: a CUfunction is a driver handle, usable from any thread with its context current;
// the driver binds the context before every launch. The module is never unloaded while the
// context lives.
unsafe impl Send for CudaKernel {}
// SAFETY: as above; launching only reads the handle.
unsafe impl Sync for CudaKernel {}

impl CudaKernel {
    /// The entry point.
    pub fn function(&self) -> sys::CUfunction {
        self.function
    }

    /// Threads per cube (block).
    pub fn cube_dim(&self) -> CubeDim {
        self.cube_dim
    }

    /// Dynamic shared memory the kernel needs, in bytes.
    pub fn shared_memory(&self) -> u32 {
        self.shared_memory
    }

    /// The entry point's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn compilation_error(reason: String) -> LaunchError {
    CompilationError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
    .into()
}

/// Compiles `kernel` to PTX with NVRTC and loads it into the current context.
/// `include_options` are NVRTC's `--include-path=` options for CUDA's headers (see `headers`).
///
/// The device's context must be current on the calling thread.
pub fn compile(
    kernel: &dyn CubeTask<CudaCppCompiler>,
    options: &CompilationOptions,
    mode: ExecutionMode,
    arch: u32,
    max_shared_memory: usize,
    include_options: &[String],
) -> Result<CudaKernel, LaunchError> {
    let mut compiler = CudaCppCompiler::default();
    let compiled = kernel.compile(&mut compiler, options, mode, kernel.address_type())?;
    let shared_memory = compiled
        .repr
        .as_ref()
        .map(|repr| repr.shared_memory_size())
        .unwrap_or(0);
    if shared_memory > max_shared_memory {
        return Err(ResourceLimitError::SharedMemory {
            requested: shared_memory,
            max: max_shared_memory,
            backtrace: BackTrace::capture(),
        }
        .into());
    }
    let name = compiled.entrypoint_name.clone();
    let mut nvrtc_options = vec![nvrtc_arch_option(arch)];
    nvrtc_options.extend(include_options.iter().cloned());

    let ptx = catch_unwind(AssertUnwindSafe(|| {
        nvrtc_compile(&compiled.source, &nvrtc_options)
    }))
    .unwrap_or_else(|_| {
        Err(DriverError::NoDevice {
            api: "NVRTC",
            reason: "the NVRTC library (libnvrtc) could not be loaded".into(),
            hint: "install the CUDA toolkit, which ships it, and put its lib64 on LD_LIBRARY_PATH",
        })
    })
    .map_err(|reason| {
        compilation_error(format!(
            "NVRTC could not compile kernel `{name}` for sm_{arch}: {reason}\n[source]\n{}",
            compiled.source
        ))
    })?;

    let entry = CString::new(name.clone())
        .map_err(|_| compilation_error(format!("kernel name `{name}` contains a NUL byte")))?;
    let module_and_function = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ptx` is NUL-terminated PTX from NVRTC; the context is current.
        unsafe {
            let module = result::module::load_data(ptx.as_ptr() as *const _).map_err(|err| {
                DriverError::call("CUDA", "cuModuleLoadData", format!("{:?}", err.0))
            })?;
            let function = result::module::get_function(module, entry).map_err(|err| {
                DriverError::call("CUDA", "cuModuleGetFunction", format!("{:?}", err.0))
            })?;
            if shared_memory > 0 {
                result::function::set_function_attribute(
                    function,
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_memory as i32,
                )
                .map_err(|err| {
                    DriverError::call("CUDA", "cuFuncSetAttribute", format!("{:?}", err.0))
                })?;
            }
            Ok::<_, DriverError>(function)
        }
    }))
    .unwrap_or_else(|_| {
        Err(DriverError::call(
            "CUDA",
            "loading a module",
            "the CUDA driver library could not be used",
        ))
    });
    let function = module_and_function
        .map_err(|reason| compilation_error(format!("loading kernel `{name}`: {reason}")))?;

    Ok(CudaKernel {
        function,
        cube_dim: compiled.cube_dim,
        shared_memory: shared_memory as u32,
        name,
    })
}

/// CUDA C++ source to NUL-terminated PTX; `Err` carries NVRTC's log.
fn nvrtc_compile(source: &str, options: &[String]) -> Result<Vec<std::ffi::c_char>, DriverError> {
    let source = CString::new(source).map_err(|_| {
        DriverError::call(
            "NVRTC",
            "nvrtcCreateProgram",
            "the source contains a NUL byte",
        )
    })?;
    let program = nvrtc::create_program(&source, None)
        .map_err(|err| DriverError::call("NVRTC", "nvrtcCreateProgram", format!("{err:?}")))?;
    // SAFETY: `program` is live until destroyed below; the options are plain strings.
    let outcome = unsafe {
        match nvrtc::compile_program(program, options) {
            Ok(()) => nvrtc::get_ptx(program)
                .map_err(|err| DriverError::call("NVRTC", "nvrtcGetPTX", format!("{err:?}"))),
            Err(err) => {
                let log = nvrtc::get_program_log(program)
                    .ok()
                    .map(|log| {
                        let bytes: Vec<u8> = log.iter().map(|c| *c as u8).collect();
                        CStr::from_bytes_until_nul(&bytes)
                            .map(|text| text.to_string_lossy().into_owned())
                            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
                    })
                    .unwrap_or_default();
                Err(DriverError::call(
                    "NVRTC",
                    "nvrtcCompileProgram",
                    format!("{err:?}\n{log}"),
                ))
            }
        }
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { nvrtc::destroy_program(program) };
    outcome
}
