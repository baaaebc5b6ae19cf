//! The fake NVRTC, in the same library as the fake driver (linked as `libnvrtc.so`, the first
//! name cudarc tries), so that what it compiles the fake driver can load and launch.
//!
//! `nvrtcCompileProgram` does not compile: it reads the CUDA C++ source's declarations (the
//! `extern "C" __global__` entry points, their launch bounds and parameters, and the types that
//! size them) and writes an image of the fake's own format (`image`) in place of PTX, which
//! `cuModuleLoadData` parses and `cuLaunchKernel` checks launches against. A source without an
//! entry point, or with a declaration the reader cannot follow, fails to compile
//! (`NVRTC_ERROR_COMPILATION`) with a log, as NVRTC does. Headers are not read (`#include` lines
//! are skipped), so the toolkit's headers need not exist.
//!
//! By part: `programs` (the exported program functions: create, compile, PTX, log, destroy),
//! `info` (version and error strings), `source` (reading the declarations), `types` (sizes and
//! layouts of the types parameters name), `metadata` (CubeCL's buffer lengths: how many bytes
//! from each pointer a kernel may touch) and `image` (the image format).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::sync::MutexGuard;

use crate::state::Fake;

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(value) => value,
            Err(code) => return code,
        }
    };
}

pub mod image;
mod info;
mod metadata;
mod programs;
mod source;
mod types;

/// `nvrtcResult` values (every CUDA version's enum has these).
pub const NVRTC_SUCCESS: u32 = 0;
pub const NVRTC_ERROR_INVALID_INPUT: u32 = 3;
pub const NVRTC_ERROR_INVALID_PROGRAM: u32 = 4;
pub const NVRTC_ERROR_INVALID_OPTION: u32 = 5;
pub const NVRTC_ERROR_COMPILATION: u32 = 6;
pub const NVRTC_ERROR_INTERNAL_ERROR: u32 = 11;

/// Handles of programs start here (an `nvrtcProgram` is an opaque pointer).
const PROGRAM_BASE: u64 = 0x7C00_0000;

/// A program from `nvrtcCreateProgram`.
#[derive(Debug)]
pub struct Program {
    pub name: String,
    pub source: String,
    /// The image, once a compilation succeeded.
    pub image: Option<String>,
    /// The last compilation's log.
    pub log: String,
}

/// The fake NVRTC's state, inside the fake's one state (one lock).
#[derive(Debug, Default)]
pub struct Nvrtc {
    pub programs: HashMap<u64, Program>,
    next: u64,
}

impl Nvrtc {
    fn create(&mut self, program: Program) -> u64 {
        self.next += 1;
        let handle = PROGRAM_BASE + self.next;
        self.programs.insert(handle, program);
        handle
    }

    /// Programs never destroyed, one line.
    pub fn leaks(&self) -> Vec<String> {
        if self.programs.is_empty() {
            return Vec::new();
        }
        let mut names: Vec<&str> = self.programs.values().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        vec![format!(
            "nvrtcCreateProgram: {} programs never destroyed ({})",
            names.len(),
            names.join(", ")
        )]
    }
}

/// A broken NVRTC contract: logged, answered with `code`.
fn nvrtc_reject(fake: &mut Fake, name: &str, code: u32, what: impl AsRef<str>) -> u32 {
    fake.violation(name, format!("{} (nvrtcResult {code})", what.as_ref()));
    code
}

/// Runs an exported NVRTC function under the fake's lock (counted, faults injectable); a result
/// outside the codes every CUDA version's `nvrtcResult` has (an injected fault's, a panic) is
/// answered `NVRTC_ERROR_INTERNAL_ERROR`, since cudarc reads the result as a Rust enum.
fn nvrtc_call(name: &str, body: impl FnOnce(&mut MutexGuard<'static, Fake>) -> u32) -> u32 {
    let code = crate::state::call_or(name, NVRTC_ERROR_INTERNAL_ERROR, body);
    if code > NVRTC_ERROR_INTERNAL_ERROR {
        NVRTC_ERROR_INTERNAL_ERROR
    } else {
        code
    }
}
