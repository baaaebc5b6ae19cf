//! How many bytes each pointer parameter's kernel may touch, from CubeCL's conventions for the
//! CUDA C++ it generates (cubecl-cpp 0.10 `shared/kernel.rs`, cubecl-core 0.10
//! `codegen/info.rs` and `codegen/metadata.rs`), so that a launch counts, for the race detector,
//! exactly the bytes of each tensor and not its whole segment nor only its first element.
//!
//! CubeCL names its buffers `buffer_<id>` and passes, by value, `const __grid_constant__ info_st
//! info` (sm_70 and later), a structure the source defines: the scalars, then `static_meta`, an
//! array of the address type whose first entries are each buffer's length in elements of its
//! own type (`buffer_len_index(id) == id`), then the logical lengths (one per buffer), then, per
//! tensor with shapes and strides, its rank, its shape offset and its stride offset. The shapes
//! and strides themselves are in `dynamic_meta`, a device pointer: `2 * sum(ranks)` entries of the
//! address type. So:
//!
//! - `buffer_<id>`: `static_meta[id]` elements of the pointed-at type;
//! - `dynamic_meta`: `2 * (static_meta[2n] + ... + static_meta[2n + e - 1])` entries, `n` the
//!   number of buffers and `e = (len(static_meta) - 2n) / 3` the number of tensors (the array is
//!   padded to 8 bytes, less than one tensor's three entries);
//! - anything else (a source that is not CubeCL's, `info_ptr` before sm_70 whose metadata lives
//!   in device memory the fake does not read at launch, a structure it cannot lay out): one
//!   element at the pointer, which checks the pointer and orders its first bytes.

use super::image::{Access, Count, Entry, Field, Param};
use super::source::{EntryDecl, ParamDecl};
use super::types::Types;

/// Where `static_meta` is: the by-value parameter holding it, its byte offset there, its
/// entries' width and how many there are.
struct StaticMeta {
    param: usize,
    offset: u64,
    width: u64,
    len: u64,
}

fn static_meta(decl: &EntryDecl, types: &Types) -> Option<StaticMeta> {
    decl.params.iter().enumerate().find_map(|(index, param)| {
        let ParamDecl::Value { name, ty } = param else {
            return None;
        };
        if name != "info" {
            return None;
        }
        let field = types.structure(ty)?.field("static_meta")?.clone();
        matches!(field.elem, 4 | 8).then_some(StaticMeta {
            param: index,
            offset: field.offset,
            width: field.elem,
            len: field.count,
        })
    })
}

/// The buffer id of a parameter named `buffer_<id>`.
fn buffer_id(name: &str) -> Option<u64> {
    name.strip_prefix("buffer_")?.parse().ok()
}

impl StaticMeta {
    fn entry(&self, index: u64) -> Option<Field> {
        (index < self.len).then_some(Field {
            param: self.param,
            offset: self.offset + index * self.width,
            width: self.width,
        })
    }
}

/// The entry point as the image records it.
pub fn entry(decl: &EntryDecl, types: &Types) -> Entry {
    let meta = static_meta(decl, types);
    let buffers = decl
        .params
        .iter()
        .filter(|p| matches!(p, ParamDecl::Pointer { name, .. } if buffer_id(name).is_some()))
        .count() as u64;
    let count_of = |name: &str| -> Count {
        let Some(meta) = &meta else {
            return Count::One;
        };
        if let Some(id) = buffer_id(name) {
            return match meta.entry(id) {
                Some(field) if id < buffers => Count::Fields {
                    factor: 1,
                    fields: vec![field],
                },
                _ => Count::One,
            };
        }
        if name == "dynamic_meta" && meta.len >= 2 * buffers {
            let tensors = (meta.len - 2 * buffers) / 3;
            let fields: Option<Vec<Field>> =
                (0..tensors).map(|t| meta.entry(2 * buffers + t)).collect();
            if let Some(fields) = fields.filter(|f| !f.is_empty()) {
                return Count::Fields { factor: 2, fields };
            }
        }
        Count::One
    };
    let params = decl
        .params
        .iter()
        .map(|param| match param {
            ParamDecl::Pointer {
                name,
                pointee,
                const_pointee,
            } => Param::Pointer {
                name: name.clone(),
                access: if *const_pointee {
                    Access::Read
                } else {
                    Access::ReadWrite
                },
                elem: types.size(pointee).unwrap_or(0),
                count: count_of(name),
            },
            ParamDecl::Value { name, ty } => Param::Value {
                name: name.clone(),
                size: types.size(ty).unwrap_or(0),
            },
        })
        .collect();
    Entry {
        name: decl.name.clone(),
        max_threads: decl.max_threads,
        params,
    }
}
