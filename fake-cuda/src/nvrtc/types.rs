//! Sizes and alignments of the C++ types a kernel's parameters name: C's and CUDA's built-in
//! types, CUDA's vector types (`float4`, `__half2`), and what the source itself defines
//! (`typedef`s, plain `struct`s laid out by C's rules), for the x86-64/CUDA data model (LP64:
//! `long` is 8 bytes on the device as on the host).
//!
//! A type the fake cannot size is `None`: a pointer to it counts as one byte, and a structure
//! holding it is not laid out (see `metadata`).

use std::collections::HashMap;

/// Size and alignment in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub size: u64,
    pub align: u64,
}

impl Layout {
    const fn scalar(size: u64) -> Self {
        Self { size, align: size }
    }
}

/// One field of a structure, laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    /// The element type's size (the field is `count` of them).
    pub elem: u64,
    pub count: u64,
    pub offset: u64,
}

/// A structure the source defines, laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Struct {
    pub layout: Layout,
    pub fields: Vec<Field>,
}

impl Struct {
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }
}

/// The types known while a source is read: the built-in ones, then its definitions in order.
#[derive(Debug, Default)]
pub struct Types {
    aliases: HashMap<String, Layout>,
    structs: HashMap<String, Struct>,
}

/// C's and CUDA's scalar types, by spelling (qualifiers and `signed`/`unsigned` normalised by
/// [`normalise`]).
fn builtin(name: &str) -> Option<Layout> {
    let size = match name {
        "bool" | "char" | "signed char" | "unsigned char" | "int8_t" | "uint8_t" => 1,
        "short" | "unsigned short" | "int16_t" | "uint16_t" => 2,
        "int" | "unsigned int" | "float" | "int32_t" | "uint32_t" => 4,
        "long" | "unsigned long" | "long long" | "unsigned long long" | "double" | "int64_t"
        | "uint64_t" | "size_t" | "ptrdiff_t" | "intptr_t" | "uintptr_t" => 8,
        // cuda_fp16.h, cuda_bf16.h
        "__half" | "half" | "__nv_bfloat16" => 2,
        "__half2" | "half2" | "__nv_bfloat162" => 4,
        // cuda_fp8.h, cuda_fp6.h, cuda_fp4.h storage types
        "__nv_fp8_storage_t"
        | "__nv_fp8_e4m3"
        | "__nv_fp8_e5m2"
        | "__nv_fp8_e8m0"
        | "__nv_fp6_storage_t"
        | "__nv_fp6_e2m3"
        | "__nv_fp6_e3m2"
        | "__nv_fp4_storage_t"
        | "__nv_fp4_e2m1"
        | "__nv_fp4x2_storage_t"
        | "__nv_fp4x2_e2m1" => 1,
        "__nv_fp8x2_storage_t" | "__nv_fp8x2_e4m3" | "__nv_fp8x2_e5m2" | "__nv_fp6x2_storage_t" => {
            2
        }
        "__nv_fp8x4_storage_t" | "__nv_fp8x4_e4m3" | "__nv_fp8x4_e5m2" => 4,
        // cuda.h: a tensor map is 128 bytes aligned to 64.
        "CUtensorMap" => {
            return Some(Layout {
                size: 128,
                align: 64,
            });
        }
        _ => return vector(name),
    };
    Some(Layout::scalar(size))
}

/// CUDA's vector types (`vector_types.h`): `float4`, `uint2`, `longlong3`, ...
fn vector(name: &str) -> Option<Layout> {
    let lanes = name.chars().last()?.to_digit(10)? as u64;
    if !(1..=4).contains(&lanes) {
        return None;
    }
    let base = match &name[..name.len() - 1] {
        "char" | "uchar" => 1,
        "short" | "ushort" => 2,
        "int" | "uint" | "float" => 4,
        "long" | "ulong" | "longlong" | "ulonglong" | "double" => 8,
        _ => return None,
    };
    // Two and four lanes are aligned to their whole size (up to 16 bytes), one and three to the
    // element's; 64-bit four-lane vectors are 16-byte aligned (CUDA 12's `*4_16a`).
    let align = match lanes {
        2 | 4 => (base * lanes).min(16),
        _ => base,
    };
    Some(Layout {
        size: (base * lanes).next_multiple_of(align),
        align,
    })
}

/// A type's spelling without qualifiers, words separated by one space: `const unsigned int`
/// -> `unsigned int`; `signed int` -> `int`; `unsigned` -> `unsigned int`.
pub fn normalise(words: &[&str]) -> String {
    const QUALIFIERS: [&str; 8] = [
        "const",
        "volatile",
        "__restrict__",
        "__restrict",
        "restrict",
        "__grid_constant__",
        "struct",
        "typename",
    ];
    let words: Vec<&str> = words
        .iter()
        .copied()
        .filter(|w| !QUALIFIERS.contains(w))
        .collect();
    let text = words.join(" ");
    match text.as_str() {
        "unsigned" => "unsigned int".into(),
        "signed" | "signed int" => "int".into(),
        "long int" | "signed long" | "signed long int" => "long".into(),
        "unsigned long int" => "unsigned long".into(),
        "long long int" | "signed long long" => "long long".into(),
        "unsigned long long int" => "unsigned long long".into(),
        "short int" | "signed short" => "short".into(),
        "unsigned short int" => "unsigned short".into(),
        _ => text,
    }
}

impl Types {
    /// The layout of the type spelled `name` (normalised), if the fake can size it.
    pub fn layout(&self, name: &str) -> Option<Layout> {
        if let Some(s) = self.structs.get(name) {
            return Some(s.layout);
        }
        if let Some(layout) = self.aliases.get(name) {
            return Some(*layout);
        }
        builtin(name)
    }

    pub fn size(&self, name: &str) -> Option<u64> {
        self.layout(name).map(|l| l.size)
    }

    pub fn structure(&self, name: &str) -> Option<&Struct> {
        self.structs.get(name)
    }

    /// `typedef <target> <name>;`: known when the target is.
    pub fn typedef(&mut self, name: &str, target: &str) {
        if let Some(layout) = self.layout(target) {
            self.aliases.insert(name.to_string(), layout);
        }
    }

    /// `struct [__align__(align)] name { fields };`, each field `(type, name, count)`: laid
    /// out by C's rules (each field at a multiple of its alignment, the size a multiple of the
    /// structure's). Not registered when a field's type is unknown.
    pub fn define_struct(
        &mut self,
        name: &str,
        align: Option<u64>,
        fields: &[(String, String, u64)],
    ) {
        let mut offset = 0u64;
        let mut max_align = align.unwrap_or(1).max(1);
        let mut laid = Vec::with_capacity(fields.len());
        for (ty, field, count) in fields {
            let Some(layout) = self.layout(ty) else {
                return;
            };
            offset = offset.next_multiple_of(layout.align.max(1));
            laid.push(Field {
                name: field.clone(),
                elem: layout.size,
                count: *count,
                offset,
            });
            offset += layout.size * count;
            max_align = max_align.max(layout.align);
        }
        self.structs.insert(
            name.to_string(),
            Struct {
                layout: Layout {
                    size: offset.next_multiple_of(max_align),
                    align: max_align,
                },
                fields: laid,
            },
        );
    }
}
