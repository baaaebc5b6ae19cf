//! The host path's element-wise reduction (`all_reduce` through host memory): the members'
//! host copies combined into the first member's copy, in place, split into chunks reduced on
//! scoped threads when the buffer is large.
//!
//! In place because the host path already holds one host copy per member: the first member's
//! copy (in device order) becomes the result, so a round allocates nothing more. Each element
//! is accumulated in device order, floats in `f64` and integers in `i128`, then divided by the
//! member count for `Mean` and converted back: the same value on every member and whatever the
//! chunking, since an element is never split between threads. NCCL on a GPU sums in the
//! element type in ring order instead, so its floats may differ in the last bits.
//!
//! Chunks are at least [`MIN_CHUNK_BYTES`] long and there are at most as many as the machine
//! has cores: a gradient of a few KiB is reduced on the calling thread without spawning.

use std::num::NonZeroUsize;
use std::sync::LazyLock;

use burn::tensor::{bf16, f16};
use cubecl_common::backtrace::BackTrace;
use cubecl_ir::{ElemType, FloatKind, IntKind, UIntKind};
use cubecl_runtime::server::{ReduceOperation, ServerError};

/// The smallest part of a buffer given to a thread of its own.
pub(super) const MIN_CHUNK_BYTES: usize = 1 << 20;

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

/// How an element type is read, accumulated and written back.
trait Element: Copy {
    const SIZE: usize;
    type Acc: Copy;
    fn read(bytes: &[u8]) -> Self;
    fn write(self, bytes: &mut [u8]);
    fn widen(self) -> Self::Acc;
    fn add(acc: Self::Acc, value: Self) -> Self::Acc;
    /// `acc` (divided by `n` when `mean`) back in the element type.
    fn narrow(acc: Self::Acc, mean: bool, n: usize) -> Self;
}

macro_rules! float_element {
    ($t:ty, $to:expr, $from:expr) => {
        impl Element for $t {
            const SIZE: usize = size_of::<$t>();
            type Acc = f64;
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_ne_bytes(bytes.try_into().expect("an element's bytes"))
            }
            fn write(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_ne_bytes());
            }
            fn widen(self) -> f64 {
                $to(self)
            }
            fn add(acc: f64, value: Self) -> f64 {
                acc + $to(value)
            }
            fn narrow(acc: f64, mean: bool, n: usize) -> Self {
                $from(if mean { acc / n as f64 } else { acc })
            }
        }
    };
}

float_element!(f64, |v: f64| v, |v: f64| v);
float_element!(f32, f64::from, |v: f64| v as f32);
float_element!(f16, |v: f16| v.to_f64(), f16::from_f64);
float_element!(bf16, |v: bf16| v.to_f64(), bf16::from_f64);

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const SIZE: usize = size_of::<$t>();
            type Acc = i128;
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_ne_bytes(bytes.try_into().expect("an element's bytes"))
            }
            fn write(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_ne_bytes());
            }
            fn widen(self) -> i128 {
                self as i128
            }
            fn add(acc: i128, value: Self) -> i128 {
                acc + value as i128
            }
            fn narrow(acc: i128, mean: bool, n: usize) -> Self {
                (if mean { acc / n as i128 } else { acc }) as $t
            }
        }
    )*};
}

int_element!(i8, i16, i32, i64, u8, u16, u32, u64);

/// Reduces `others` into `acc` element by element; `acc` and every `others[i]` are the same
/// part (same offset, same length) of each member's buffer.
fn reduce_part<E: Element>(acc: &mut [u8], others: &[&[u8]], mean: bool, n: usize) {
    for (index, out) in acc.chunks_exact_mut(E::SIZE).enumerate() {
        let at = index * E::SIZE..(index + 1) * E::SIZE;
        let mut sum = E::read(out).widen();
        for other in others {
            sum = E::add(sum, E::read(&other[at.clone()]));
        }
        E::narrow(sum, mean, n).write(out);
    }
}

/// `reduce_part` over the whole buffer, split into chunks on up to `threads` scoped threads.
fn reduce_chunked<E: Element>(acc: &mut [u8], others: &[&[u8]], mean: bool, threads: usize) {
    let n = others.len() + 1;
    let chunks = threads.min(acc.len() / MIN_CHUNK_BYTES).max(1);
    if chunks == 1 {
        reduce_part::<E>(acc, others, mean, n);
        return;
    }
    let chunk = acc.len().div_ceil(chunks).next_multiple_of(E::SIZE);
    std::thread::scope(|scope| {
        for (index, part) in acc.chunks_mut(chunk).enumerate() {
            let start = index * chunk;
            let parts: Vec<&[u8]> = others
                .iter()
                .map(|other| &other[start..start + part.len()])
                .collect();
            scope.spawn(move || reduce_part::<E>(part, &parts, mean, n));
        }
    });
}

/// The threads a large reduction may use: the cores this process may run on, asked once
/// (the answer reads the scheduler's affinity and cgroup limits, too slow for every call).
pub(super) fn default_threads() -> usize {
    static THREADS: LazyLock<usize> =
        LazyLock::new(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get));
    *THREADS
}

/// Combines `others` into `acc` by `op`, element-wise as `dtype`: `acc` is the first member's
/// host copy and becomes the result; `others` are the other members' copies in device order.
/// Every check runs before `acc` is touched: buffers of different sizes, a size that is not a
/// whole number of elements and an element type without a sum are errors.
pub(super) fn reduce_in_place(
    dtype: ElemType,
    op: &ReduceOperation,
    acc: &mut [u8],
    others: &[&[u8]],
    threads: usize,
) -> Result<(), ServerError> {
    let len = acc.len();
    if let Some(other) = others.iter().find(|other| other.len() != len) {
        return Err(generic(format!(
            "caching allocator: all_reduce of buffers of different sizes ({len} and {} bytes)",
            other.len()
        )));
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(generic(format!(
            "caching allocator: all_reduce of {len} bytes is not a whole number of {dtype:?}"
        )));
    }
    let mean = matches!(op, ReduceOperation::Mean);
    let run = match dtype {
        ElemType::Float(FloatKind::F64) => reduce_chunked::<f64>,
        ElemType::Float(FloatKind::F32 | FloatKind::Flex32 | FloatKind::TF32) => {
            reduce_chunked::<f32>
        }
        ElemType::Float(FloatKind::F16) => reduce_chunked::<f16>,
        ElemType::Float(FloatKind::BF16) => reduce_chunked::<bf16>,
        ElemType::Int(IntKind::I8) => reduce_chunked::<i8>,
        ElemType::Int(IntKind::I16) => reduce_chunked::<i16>,
        ElemType::Int(IntKind::I32) => reduce_chunked::<i32>,
        ElemType::Int(IntKind::I64) => reduce_chunked::<i64>,
        ElemType::UInt(UIntKind::U8) => reduce_chunked::<u8>,
        ElemType::UInt(UIntKind::U16) => reduce_chunked::<u16>,
        ElemType::UInt(UIntKind::U32) => reduce_chunked::<u32>,
        ElemType::UInt(UIntKind::U64) => reduce_chunked::<u64>,
        other => {
            return Err(generic(format!(
                "caching allocator: all_reduce of {other:?} elements is not supported"
            )));
        }
    };
    // One member: its values are the sum and the mean already.
    if !others.is_empty() {
        run(acc, others, mean, threads);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: ElemType = ElemType::Float(FloatKind::F32);

    fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
        values.into_iter().flat_map(f32::to_ne_bytes).collect()
    }

    fn f32_values(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(f32::read).collect()
    }

    /// The reference: each element summed in `f64` in member order, one element at a time.
    fn reference(inputs: &[Vec<f32>], mean: bool) -> Vec<f32> {
        (0..inputs[0].len())
            .map(|i| {
                let sum: f64 = inputs.iter().map(|input| f64::from(input[i])).sum();
                (if mean { sum / inputs.len() as f64 } else { sum }) as f32
            })
            .collect()
    }

    fn inputs(members: usize, elements: usize) -> Vec<Vec<f32>> {
        (0..members)
            .map(|m| {
                (0..elements)
                    .map(|i| ((i * 7 + m * 13) % 1000) as f32 * 0.37 - 150.0 + m as f32 * 1e-3)
                    .collect()
            })
            .collect()
    }

    fn run(values: &[Vec<f32>], op: ReduceOperation, threads: usize) -> Vec<f32> {
        let bytes: Vec<Vec<u8>> = values
            .iter()
            .map(|v| f32_bytes(v.iter().copied()))
            .collect();
        let mut acc = bytes[0].clone();
        let others: Vec<&[u8]> = bytes[1..].iter().map(Vec::as_slice).collect();
        reduce_in_place(F32, &op, &mut acc, &others, threads).expect("reduce");
        f32_values(&acc)
    }

    #[test]
    fn chunked_reduction_on_several_threads_equals_the_element_by_element_reference() {
        // 3 MiB + 3 elements: four chunks at 4 threads, the last one short.
        let elements = (3 * MIN_CHUNK_BYTES) / 4 + 3;
        let values = inputs(3, elements);
        for threads in [1, 2, 4, 16] {
            let sum = run(&values, ReduceOperation::Sum, threads);
            assert_eq!(sum, reference(&values, false), "sum, {threads} threads");
            let mean = run(&values, ReduceOperation::Mean, threads);
            assert_eq!(mean, reference(&values, true), "mean, {threads} threads");
        }
    }

    #[test]
    fn integers_and_half_floats_reduce_in_a_wider_type_and_wrap_only_at_the_end() {
        let a: Vec<u8> = [250u8, 3, 7].to_vec();
        let b: Vec<u8> = [10u8, 4, 1].to_vec();
        let mut acc = a.clone();
        reduce_in_place(
            ElemType::UInt(UIntKind::U8),
            &ReduceOperation::Mean,
            &mut acc,
            &[&b],
            4,
        )
        .expect("u8 mean");
        // (250 + 10) / 2 = 130 without wrapping at 255 on the way.
        assert_eq!(acc, vec![130, 3, 4]);

        let halves = |values: &[f32]| -> Vec<u8> {
            values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_ne_bytes())
                .collect()
        };
        let mut acc = halves(&[1.5, -2.0, 60000.0]);
        reduce_in_place(
            ElemType::Float(FloatKind::F16),
            &ReduceOperation::Mean,
            &mut acc,
            &[&halves(&[0.5, 4.0, 60000.0])],
            1,
        )
        .expect("f16 mean");
        // 60000 + 60000 overflows f16 (max 65504) but not the f64 accumulator.
        assert_eq!(acc, halves(&[1.0, 1.0, 60000.0]));
    }

    #[test]
    fn bad_buffers_are_errors_and_leave_the_accumulator_untouched() {
        let first = f32_bytes([1.0, 2.0]);
        let mut acc = first.clone();
        let short = f32_bytes([1.0]);
        let err = reduce_in_place(F32, &ReduceOperation::Sum, &mut acc, &[&short], 2)
            .expect_err("different sizes");
        assert!(err.to_string().contains("different sizes"), "{err}");
        let err = reduce_in_place(F32, &ReduceOperation::Sum, &mut acc[..7], &[&first[..7]], 2)
            .expect_err("partial element");
        assert!(err.to_string().contains("whole number"), "{err}");
        let err = reduce_in_place(ElemType::Bool, &ReduceOperation::Sum, &mut acc, &[], 2)
            .expect_err("bool");
        assert!(err.to_string().contains("not supported"), "{err}");
        assert_eq!(acc, first);
    }
}
