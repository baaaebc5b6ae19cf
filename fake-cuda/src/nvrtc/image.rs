//! The fake's "PTX": a small text image the fake NVRTC writes (`nvrtcGetPTX`) and only the fake
//! driver loads (`cuModuleLoadData`). It records what a launch needs to check: the target
//! architecture, and for each entry point its launch bounds and parameters, with, for each
//! pointer, how it is accessed and how many bytes from it the kernel may touch.
//!
//! ```text
//! // fake-cuda image: not PTX; written by the fake NVRTC, loaded only by the fake driver
//! .fake_image 1
//! .target sm_80
//! .entry add_kernel maxntid=256
//! .param ptr rw elem=16 count=1*4@0:4 buffer_0
//! .param ptr r elem=4 count=one buffer_1
//! .param value size=16 info
//! .end
//! ```
//!
//! `count=` says how many elements of `elem` bytes the pointer's kernel may touch: `one`, or
//! `F*P@O:W[+P@O:W...]`, `F` times the sum of the unsigned `W`-byte integers at byte `O` of
//! by-value parameter `P`, read at each launch (where CubeCL passes buffer lengths; see
//! `metadata`). Parameters are listed in declaration order, the order of `kernelParams`.

use std::fmt::Write;

/// The first line of every image.
pub const MAGIC: &str =
    "// fake-cuda image: not PTX; written by the fake NVRTC, loaded only by the fake driver";
const VERSION: &str = ".fake_image 1";

/// `sm_XY`, or `sm_XYa` (architecture-specific: that exact device only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
    pub specific: bool,
}

impl Arch {
    /// `sm_80`, `sm_90a`, `compute_75`.
    pub fn parse(text: &str) -> Option<Self> {
        let digits = text
            .strip_prefix("sm_")
            .or_else(|| text.strip_prefix("compute_"))?;
        let (digits, specific) = match digits.strip_suffix(['a', 'f']) {
            Some(digits) => (digits, true),
            None => (digits, false),
        };
        if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let value: u32 = digits.parse().ok()?;
        Some(Self {
            major: value / 10,
            minor: value % 10,
            specific,
        })
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sm_{}{}{}",
            self.major,
            self.minor,
            if self.specific { "a" } else { "" }
        )
    }
}

/// How a kernel uses a pointer parameter's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Declared pointer to const: the kernel only reads.
    Read,
    /// May read and write.
    ReadWrite,
}

/// A field of a by-value parameter read at launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub param: usize,
    pub offset: u64,
    pub width: u64,
}

/// How many elements from a pointer the kernel may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Count {
    /// Not known from the source: one element at the pointer.
    One,
    /// `factor` times the sum of `fields`.
    Fields { factor: u64, fields: Vec<Field> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    Pointer {
        name: String,
        access: Access,
        /// Bytes per element (0: unknown, counted as 1).
        elem: u64,
        count: Count,
    },
    Value {
        name: String,
        /// Bytes (0: unknown).
        size: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub max_threads: Option<u32>,
    pub params: Vec<Param>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub target: Option<Arch>,
    pub entries: Vec<Entry>,
}

impl Image {
    /// The image as text (no NUL).
    pub fn write(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{MAGIC}");
        let _ = writeln!(out, "{VERSION}");
        if let Some(target) = self.target {
            let _ = writeln!(out, ".target {target}");
        }
        for entry in &self.entries {
            let _ = write!(out, ".entry {}", entry.name);
            if let Some(n) = entry.max_threads {
                let _ = write!(out, " maxntid={n}");
            }
            out.push('\n');
            for param in &entry.params {
                match param {
                    Param::Pointer {
                        name,
                        access,
                        elem,
                        count,
                    } => {
                        let access = match access {
                            Access::Read => "r",
                            Access::ReadWrite => "rw",
                        };
                        let count = match count {
                            Count::One => "one".to_string(),
                            Count::Fields { factor, fields } => {
                                let terms: Vec<String> = fields
                                    .iter()
                                    .map(|f| format!("{}@{}:{}", f.param, f.offset, f.width))
                                    .collect();
                                format!("{factor}*{}", terms.join("+"))
                            }
                        };
                        let _ =
                            writeln!(out, ".param ptr {access} elem={elem} count={count} {name}");
                    }
                    Param::Value { name, size } => {
                        let _ = writeln!(out, ".param value size={size} {name}");
                    }
                }
            }
        }
        let _ = writeln!(out, ".end");
        out
    }

    /// Reads an image; `Err` says why it is not one.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err("not an image of the fake NVRTC (real PTX, a cubin or a fatbinary cannot run on the fake)".into());
        }
        if lines.next() != Some(VERSION) {
            return Err("an image of another version of the fake NVRTC".into());
        }
        let mut image = Image {
            target: None,
            entries: Vec::new(),
        };
        let mut ended = false;
        for (n, line) in lines.enumerate() {
            let bad = |what: &str| format!("line {}: {what}: `{line}`", n + 3);
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                [] => {}
                [".target", arch] => {
                    image.target = Some(Arch::parse(arch).ok_or_else(|| bad("bad target"))?);
                }
                [".entry", name, rest @ ..] => {
                    let mut max_threads = None;
                    for word in rest {
                        let n = word
                            .strip_prefix("maxntid=")
                            .and_then(|n| n.parse().ok())
                            .ok_or_else(|| bad("bad entry attribute"))?;
                        max_threads = Some(n);
                    }
                    image.entries.push(Entry {
                        name: name.to_string(),
                        max_threads,
                        params: Vec::new(),
                    });
                }
                [".param", "ptr", access, elem, count, name] => {
                    let entry = image
                        .entries
                        .last_mut()
                        .ok_or_else(|| bad("a parameter outside an entry"))?;
                    let access = match *access {
                        "r" => Access::Read,
                        "rw" => Access::ReadWrite,
                        _ => return Err(bad("bad access")),
                    };
                    let elem = elem
                        .strip_prefix("elem=")
                        .and_then(|e| e.parse().ok())
                        .ok_or_else(|| bad("bad element size"))?;
                    let count = count
                        .strip_prefix("count=")
                        .and_then(parse_count)
                        .ok_or_else(|| bad("bad count"))?;
                    entry.params.push(Param::Pointer {
                        name: name.to_string(),
                        access,
                        elem,
                        count,
                    });
                }
                [".param", "value", size, name] => {
                    let entry = image
                        .entries
                        .last_mut()
                        .ok_or_else(|| bad("a parameter outside an entry"))?;
                    let size = size
                        .strip_prefix("size=")
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| bad("bad size"))?;
                    entry.params.push(Param::Value {
                        name: name.to_string(),
                        size,
                    });
                }
                [".end"] => {
                    ended = true;
                    break;
                }
                _ => return Err(bad("unknown directive")),
            }
        }
        if !ended {
            return Err("truncated (no .end)".into());
        }
        // Fields must name by-value parameters of their own entry.
        for entry in &image.entries {
            for param in &entry.params {
                if let Param::Pointer {
                    count: Count::Fields { fields, .. },
                    name,
                    ..
                } = param
                {
                    for field in fields {
                        let ok = matches!(
                            entry.params.get(field.param),
                            Some(Param::Value { size, .. })
                                if *size == 0 || field.offset + field.width <= *size
                        ) && matches!(field.width, 1 | 2 | 4 | 8);
                        if !ok {
                            return Err(format!(
                                "entry `{}`: the count of `{name}` reads outside a by-value parameter",
                                entry.name
                            ));
                        }
                    }
                }
            }
        }
        Ok(image)
    }
}

fn parse_count(text: &str) -> Option<Count> {
    if text == "one" {
        return Some(Count::One);
    }
    let (factor, terms) = text.split_once('*')?;
    let fields = terms
        .split('+')
        .map(|term| {
            let (param, rest) = term.split_once('@')?;
            let (offset, width) = rest.split_once(':')?;
            Some(Field {
                param: param.parse().ok()?,
                offset: offset.parse().ok()?,
                width: width.parse().ok()?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Count::Fields {
        factor: factor.parse().ok()?,
        fields,
    })
}
