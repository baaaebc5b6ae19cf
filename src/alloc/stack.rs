//! Allocation stacks: where in the program a request came from.
//!
//! [`Stack::capture`] walks the calling thread's stack and keeps only the return addresses
//! (no symbol lookup), so recording stays cheap; [`StackResolver`] turns them into
//! [`Frame`]s (function, file, line) when a snapshot is written, looking each address up once.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// One frame of a call stack, as PyTorch's snapshots name it (`name`, `filename`, `line`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// The function, demangled, without the symbol hash.
    pub name: String,
    /// The source file ("??" when the binary has no debug information for it).
    pub filename: String,
    /// The line in `filename` (0 when unknown).
    pub line: u32,
}

/// A call stack captured at an allocation, unresolved: return addresses, innermost first.
/// Cloning shares the addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stack(Arc<[usize]>);

impl Stack {
    /// Captures the calling thread's stack (addresses only; nothing is symbolised).
    pub fn capture() -> Self {
        let mut addresses = Vec::with_capacity(48);
        backtrace::trace(|frame| {
            addresses.push(frame.ip() as usize);
            true
        });
        Stack(addresses.into())
    }

    /// How many frames were captured (inlined functions not counted).
    pub fn depth(&self) -> usize {
        self.0.len()
    }
}

/// Whether `frame` is one of the allocator's public entry points (`malloc`, `free`, ...),
/// which sit between the caller and the capture.
fn is_allocator_frame(frame: &Frame) -> bool {
    frame
        .name
        .trim_start_matches('<')
        .starts_with("burn_caching_alloc::alloc::allocator::")
}

/// Resolves [`Stack`]s into [`Frame`]s, each address once.
#[derive(Default)]
pub struct StackResolver {
    cache: HashMap<usize, Arc<[Frame]>>,
}

impl StackResolver {
    /// A resolver with an empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The frames of `stack`, innermost first, without the frames of the capture itself.
    pub fn frames(&mut self, stack: &Stack) -> Vec<Frame> {
        let mut frames = Vec::new();
        for &address in stack.0.iter() {
            frames.extend(self.resolve(address).iter().cloned());
        }
        // Everything up to `Stack::capture` is the unwinder's, and everything up to the
        // allocator's entry point the allocator's own (inlined helpers included).
        let capture = frames
            .iter()
            .rposition(|f| f.name.contains("alloc::stack::Stack::capture"))
            .map_or(0, |i| i + 1);
        frames.drain(..capture);
        let own = frames
            .iter()
            .take(8)
            .rposition(is_allocator_frame)
            .map_or(0, |i| i + 1);
        frames.drain(..own);
        frames
    }

    fn resolve(&mut self, address: usize) -> Arc<[Frame]> {
        self.cache
            .entry(address)
            .or_insert_with(|| {
                let mut frames = Vec::new();
                backtrace::resolve(address as *mut std::ffi::c_void, |symbol| {
                    let name = symbol
                        .name()
                        .map(|n| format!("{n:#}"))
                        .unwrap_or_else(|| format!("{address:#x}"));
                    let filename = symbol
                        .filename()
                        .map(|f| f.display().to_string())
                        .unwrap_or_else(|| "??".into());
                    frames.push(Frame {
                        name,
                        filename,
                        line: symbol.lineno().unwrap_or(0),
                    });
                });
                if frames.is_empty() {
                    frames.push(Frame {
                        name: format!("{address:#x}"),
                        filename: "??".into(),
                        line: 0,
                    });
                }
                frames.into()
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn capture_here() -> Stack {
        Stack::capture()
    }

    #[test]
    fn a_resolved_stack_names_the_caller_and_not_the_capture() {
        let stack = capture_here();
        assert!(stack.depth() > 2, "depth {}", stack.depth());
        let frames = StackResolver::new().frames(&stack);
        assert!(
            !frames
                .iter()
                .any(|f| f.filename.contains("/backtrace-") || f.name.contains("Stack::capture")),
            "{frames:#?}"
        );
        assert!(
            frames
                .iter()
                .any(|f| f.name.contains("a_resolved_stack_names_the_caller")
                    && f.filename.ends_with("stack.rs")
                    && f.line > 0),
            "{frames:#?}"
        );
    }
}
