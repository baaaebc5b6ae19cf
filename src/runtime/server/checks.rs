//! The checks that do not depend on the device API, done once here for every backend, with one
//! rule: tensor layouts the server copies, buffer sizes a kernel can bind, copies that stay
//! inside their buffer, and launches that have nothing to run.

use cubecl_common::backtrace::BackTrace;
use cubecl_core::zspace::{Shape, Strides};
use cubecl_runtime::server::{IoError, LaunchError, ServerError};

use super::super::driver::LaunchCount;
use crate::runtime::storage::EngineResource;

/// Bytes of a dynamic cube count: three `u32`, x, y, z.
pub(super) const DYNAMIC_COUNT_BYTES: u64 = 12;

/// Whether a tensor is laid out row-major without gaps: the only layout the server copies.
pub(crate) fn is_contiguous(shape: &Shape, strides: &Strides) -> bool {
    let mut expected = 1usize;
    for (dim, stride) in shape.iter().zip(strides.iter()).rev() {
        if *dim > 1 && *stride != expected {
            return false;
        }
        expected *= *dim;
    }
    true
}

/// A copy's layout must be contiguous.
pub(super) fn contiguous(shape: &Shape, strides: &Strides) -> Result<(), IoError> {
    if is_contiguous(shape, strides) {
        Ok(())
    } else {
        Err(IoError::UnsupportedStrides {
            backtrace: BackTrace::capture(),
        })
    }
}

/// A buffer must fit the largest binding a kernel can use (`max`, when the device has one).
pub(super) fn bindable(size: u64, max: Option<u64>) -> Result<(), ServerError> {
    match max {
        Some(max) if size > max => Err(generic(format!(
            "caching allocator: a buffer of {size} bytes is larger than the largest buffer a \
             kernel can bind on this device ({max} bytes)"
        ))),
        _ => Ok(()),
    }
}

/// A write of `len` bytes must fit the `size` bytes of its destination.
pub(super) fn write_fits(len: usize, size: u64) -> Result<(), ServerError> {
    if len as u64 > size {
        return Err(generic(format!(
            "write of {len} bytes into a buffer of {size} bytes"
        )));
    }
    Ok(())
}

/// A static cube count with a zero dimension runs nothing (CUDA rejects such grids, wgpu
/// skips them): the server does not issue it.
pub(super) fn runs_nothing<H>(count: &LaunchCount<H>) -> bool {
    matches!(count, LaunchCount::Static(x, y, z) if *x == 0 || *y == 0 || *z == 0)
}

/// A dynamic cube count's buffer must hold the three `u32`s.
pub(super) fn dynamic_count<H>(resource: &EngineResource<H>) -> Result<(), ServerError> {
    if resource.size < DYNAMIC_COUNT_BYTES {
        return Err(generic(format!(
            "a dynamic cube count needs {DYNAMIC_COUNT_BYTES} bytes, its buffer has {}",
            resource.size
        )));
    }
    Ok(())
}

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

/// Tensor maps (TMA) are not supported: the server binds plain buffers only, and passing a
/// kernel its maps' buffers without the maps would shift every parameter. The device does not
/// advertise TMA, so CubeCL does not plan such kernels; one that comes anyway is refused.
pub(super) fn no_tensor_maps(count: usize) -> Result<(), ServerError> {
    if count == 0 {
        return Ok(());
    }
    Err(ServerError::Launch(LaunchError::Unknown {
        reason: format!(
            "caching allocator: a launch with {count} tensor map(s) (TMA): the caching server \
             binds plain buffers only and does not advertise TMA"
        ),
        backtrace: BackTrace::capture(),
    }))
}
