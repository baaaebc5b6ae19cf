//! The checks that do not depend on the device API, done once here for every backend, with one
//! rule: tensor layouts the server copies, buffer sizes a kernel can bind, copies that stay
//! inside their buffer, and launches that have nothing to run. Sizes from CubeCL are
//! multiplied with checked arithmetic: a shape whose size overflows is an error naming it,
//! never a wrapped size that a short copy would then pass.

use cubecl_common::backtrace::BackTrace;
use cubecl_core::zspace::{Shape, Strides};
use cubecl_runtime::server::{IoError, LaunchError, ServerError};

use super::super::driver::LaunchCount;
use crate::runtime::storage::EngineResource;

/// Bytes of a dynamic cube count: three `u32`, x, y, z.
pub(super) const DYNAMIC_COUNT_BYTES: u64 = 12;

/// Whether a tensor is laid out row-major without gaps: the only layout the server copies. A
/// shape whose element count overflows is no layout at all (false).
pub(crate) fn is_contiguous(shape: &Shape, strides: &Strides) -> bool {
    let mut expected = 1usize;
    for (dim, stride) in shape.iter().zip(strides.iter()).rev() {
        if *dim > 1 && *stride != expected {
            return false;
        }
        let Some(next) = expected.checked_mul(*dim) else {
            return false;
        };
        expected = next;
    }
    true
}

/// The bytes of a tensor of `shape` with `elem_size`-byte elements; an error naming both if
/// that overflows.
pub(super) fn tensor_bytes(shape: &Shape, elem_size: usize) -> Result<usize, ServerError> {
    shape
        .iter()
        .try_fold(elem_size, |bytes, dim| bytes.checked_mul(*dim))
        .ok_or_else(|| {
            generic(format!(
                "caching allocator: a copy of a tensor of shape {:?} with {elem_size}-byte \
                 elements: its size in bytes overflows",
                shape.iter().collect::<Vec<_>>()
            ))
        })
}

/// A copy's layout must be contiguous, and its size must not overflow.
pub(super) fn contiguous(shape: &Shape, strides: &Strides) -> Result<(), ServerError> {
    tensor_bytes(shape, 1)?;
    if is_contiguous(shape, strides) {
        Ok(())
    } else {
        Err(ServerError::Io(IoError::UnsupportedStrides {
            backtrace: BackTrace::capture(),
        }))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 20 point 6: `read` multiplied the shape unchecked; in release a wrapped size
    /// (here 2^62 x 8 x 4 bytes = 2^67, which wraps to 0) let a short read pass the bounds
    /// check and return success. Now it is an error naming the shape.
    #[test]
    fn a_tensor_size_that_overflows_is_an_error_naming_the_shape() {
        let shape: Shape = [1usize << 62, 8].into();
        let err = tensor_bytes(&shape, 4).expect_err("overflows");
        let message = err.to_string();
        assert!(message.contains(&format!("{}", 1usize << 62)), "{message}");
        assert!(message.contains("overflows"), "{message}");
        let strides: Strides = [8, 1].into();
        assert!(!is_contiguous(&shape, &strides));
        let err = contiguous(&shape, &strides).expect_err("overflows");
        assert!(err.to_string().contains("overflows"), "{err}");
    }

    #[test]
    fn tensor_sizes_that_fit_are_exact() {
        let shape: Shape = [3usize, 5, 7].into();
        assert_eq!(tensor_bytes(&shape, 4).unwrap(), 420);
        let empty: Shape = [0usize, usize::MAX].into();
        assert_eq!(tensor_bytes(&empty, 8).unwrap(), 0);
        assert!(contiguous(&shape, &[35, 7, 1].into()).is_ok());
    }
}
