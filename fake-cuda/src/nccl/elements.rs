//! NCCL's data types: element sizes, conversions (fp8 included) and the element-wise reduction.

use std::ffi::c_int;

/// Bytes per element, or `None` for an unknown type.
pub(super) fn elem_size(dtype: c_int) -> Option<usize> {
    match dtype {
        0 | 1 | 10 | 11 => Some(1),
        2 | 3 => Some(4),
        4 | 5 => Some(8),
        6 | 9 => Some(2),
        7 => Some(4),
        8 => Some(8),
        _ => None,
    }
}

fn is_float(dtype: c_int) -> bool {
    matches!(dtype, 6..=11)
}

// --- element conversions ---------------------------------------------------------------------

fn fp8_e4m3_to_f64(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let man = (b & 0x7) as f64;
    if exp == 0xF && (b & 0x7) == 0x7 {
        return f64::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
    }
}

fn f64_to_fp8_e4m3(v: f64) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    // Nearest representable (saturating at +-448), ties to even mantissa.
    let mut best = 0u8;
    let mut best_err = f64::INFINITY;
    for b in 0u8..=255 {
        let x = fp8_e4m3_to_f64(b);
        if x.is_nan() {
            continue;
        }
        let err = (x - v).abs();
        if err < best_err
            || (err == best_err && b & 1 == 0 && (x.is_sign_negative() == v.is_sign_negative()))
        {
            best = b;
            best_err = err;
        }
    }
    best
}

fn load(bytes: &[u8], dtype: c_int, i: usize) -> Num {
    let size = elem_size(dtype).expect("checked");
    let b = &bytes[i * size..(i + 1) * size];
    match dtype {
        0 => Num::I(b[0] as i8 as i128),
        1 => Num::I(b[0] as i128),
        2 => Num::I(i32::from_ne_bytes(b.try_into().unwrap()) as i128),
        3 => Num::I(u32::from_ne_bytes(b.try_into().unwrap()) as i128),
        4 => Num::I(i64::from_ne_bytes(b.try_into().unwrap()) as i128),
        5 => Num::I(u64::from_ne_bytes(b.try_into().unwrap()) as i128),
        6 => Num::F(half::f16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        7 => Num::F(f32::from_ne_bytes(b.try_into().unwrap()) as f64),
        8 => Num::F(f64::from_ne_bytes(b.try_into().unwrap())),
        9 => Num::F(half::bf16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        10 => Num::F(fp8_e4m3_to_f64(b[0])),
        _ => Num::F(half::f16::from_bits((b[0] as u16) << 8).to_f64()),
    }
}

fn store(out: &mut [u8], dtype: c_int, i: usize, value: Num) {
    let size = elem_size(dtype).expect("checked");
    let o = &mut out[i * size..(i + 1) * size];
    let (int, float) = match value {
        Num::I(v) => (v, v as f64),
        Num::F(v) => (v as i128, v),
    };
    match dtype {
        0 => o.copy_from_slice(&(int as i8).to_ne_bytes()),
        1 => o.copy_from_slice(&(int as u8).to_ne_bytes()),
        2 => o.copy_from_slice(&(int as i32).to_ne_bytes()),
        3 => o.copy_from_slice(&(int as u32).to_ne_bytes()),
        4 => o.copy_from_slice(&(int as i64).to_ne_bytes()),
        5 => o.copy_from_slice(&(int as u64).to_ne_bytes()),
        6 => o.copy_from_slice(&half::f16::from_f64(float).to_ne_bytes()),
        7 => o.copy_from_slice(&(float as f32).to_ne_bytes()),
        8 => o.copy_from_slice(&float.to_ne_bytes()),
        9 => o.copy_from_slice(&half::bf16::from_f64(float).to_ne_bytes()),
        10 => o[0] = f64_to_fp8_e4m3(float),
        _ => {
            // e5m2 is the high byte of an f16: round the f16 to nearest even on that byte.
            let bits = half::f16::from_f64(float).to_bits();
            let rounded = if (bits & 0x7C00) == 0x7C00 {
                bits
            } else {
                let low = bits & 0xFF;
                let up = low > 0x80 || (low == 0x80 && (bits >> 8) & 1 == 1);
                if up { bits.wrapping_add(0x100) } else { bits }
            };
            o[0] = (rounded >> 8) as u8;
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Num {
    I(i128),
    F(f64),
}

/// Reduces rank inputs element-wise with `redop` (0 sum, 1 prod, 2 max, 3 min, 4 avg).
pub(super) fn reduce(inputs: &[Vec<u8>], dtype: c_int, redop: c_int, count: usize) -> Vec<u8> {
    let size = elem_size(dtype).expect("checked");
    let mut out = vec![0u8; count * size];
    let n = inputs.len();
    for i in 0..count {
        let values: Vec<Num> = inputs.iter().map(|input| load(input, dtype, i)).collect();
        let value = if is_float(dtype) {
            let xs = values.iter().map(|v| match v {
                Num::F(x) => *x,
                Num::I(x) => *x as f64,
            });
            Num::F(match redop {
                0 => xs.sum(),
                1 => xs.product(),
                2 => xs.fold(f64::NEG_INFINITY, f64::max),
                3 => xs.fold(f64::INFINITY, f64::min),
                _ => xs.sum::<f64>() / n as f64,
            })
        } else {
            let xs = values.iter().map(|v| match v {
                Num::I(x) => *x,
                Num::F(x) => *x as i128,
            });
            Num::I(match redop {
                0 => xs.fold(0i128, |a, b| a.wrapping_add(b)),
                1 => xs.fold(1i128, |a, b| a.wrapping_mul(b)),
                2 => xs.max().unwrap_or(0),
                3 => xs.min().unwrap_or(0),
                _ => xs.sum::<i128>() / n as i128,
            })
        };
        store(&mut out, dtype, i, value);
    }
    out
}
