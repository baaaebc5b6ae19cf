//! Allocation stacks: where in the program a request came from.
//!
//! [`Stack::capture`] walks the calling thread's stack and keeps only the return addresses
//! (no symbol lookup), so recording stays cheap; [`StackResolver`] turns them into
//! [`Frame`]s (function, file, line) when a snapshot is written, looking each address up once.
//!
//! A request served on behalf of another thread (a device thread serving the caller's queued
//! call) can carry the caller's stack instead of its own: [`Stack::serving`] runs a closure in
//! which the engine's requests use the given stack rather than capturing one.

use std::cell::RefCell;
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
    /// Captures the calling thread's stack (addresses only; nothing is symbolised), from the
    /// caller of this function out: the unwinder's frames and this one's are left out here, by
    /// address, since an optimised build inlines them under names no resolver could tell apart
    /// (when the unwinder cannot say which function a frame is in, every frame is kept and the
    /// resolver skips them by name).
    #[inline(never)]
    pub fn capture() -> Self {
        let this = Stack::capture as fn() -> Stack as usize;
        let mut addresses = Vec::with_capacity(48);
        let mut callers_from = None;
        backtrace::trace(|frame| {
            if callers_from.is_none() && frame.symbol_address() as usize == this {
                callers_from = Some(addresses.len() + 1);
            }
            addresses.push(frame.ip() as usize);
            true
        });
        if let Some(start) = callers_from {
            addresses.drain(..start.min(addresses.len()));
        }
        Stack(addresses.into())
    }

    /// How many frames were captured (inlined functions not counted).
    pub fn depth(&self) -> usize {
        self.0.len()
    }

    /// The return addresses, innermost first.
    pub fn addresses(&self) -> &[usize] {
        &self.0
    }

    /// The demangled names of the functions at `address`, inlined ones first (empty when the
    /// binary has no symbols for it).
    pub fn names_at(address: usize) -> Vec<String> {
        let mut names = Vec::new();
        backtrace::resolve(address as *mut std::ffi::c_void, |symbol| {
            if let Some(name) = symbol.name() {
                names.push(format!("{name:#}"));
            }
        });
        names
    }

    /// Runs `f` with `stack` standing for the calling thread's stack: every allocation the
    /// engine serves inside `f`, on this thread, records `stack` (when stacks are recorded)
    /// instead of capturing its own. `None` changes nothing. Nested calls restore the outer
    /// stack when they return.
    pub fn serving<R>(stack: Option<Stack>, f: impl FnOnce() -> R) -> R {
        serving_with(&SERVED, stack, f)
    }

    /// The stack of the request being served on this thread ([`Stack::serving`]), or else
    /// this thread's own.
    pub(crate) fn of_request() -> Self {
        SERVED
            .with(|served| served.borrow().clone())
            .unwrap_or_else(Stack::capture)
    }
}

/// Runs `f` with `value` in the thread-local `cell` (`None` changes nothing), and puts the
/// outer value back when `f` returns or unwinds: what the engine reads as the request it
/// serves (`Stack::serving`, `Tag::serving`).
pub(crate) fn serving_with<T: 'static, R>(
    cell: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    value: Option<T>,
    f: impl FnOnce() -> R,
) -> R {
    let Some(value) = value else {
        return f();
    };
    struct Restore<T: 'static>(
        &'static std::thread::LocalKey<RefCell<Option<T>>>,
        Option<T>,
    );
    impl<T: 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            let outer = self.1.take();
            self.0.with(|served| *served.borrow_mut() = outer);
        }
    }
    let _restore = Restore(cell, cell.with(|served| served.borrow_mut().replace(value)));
    f()
}

thread_local! {
    /// The stack [`Stack::serving`] set on this thread.
    static SERVED: RefCell<Option<Stack>> = const { RefCell::new(None) };
}

/// Path prefixes of functions an integration puts between its caller and the engine (its
/// layout policy, its storage hook), added with [`Stack::skip_frames_of`].
static INTEGRATION_FRAMES: parking_lot::RwLock<Vec<&'static str>> =
    parking_lot::RwLock::new(Vec::new());

impl Stack {
    /// Marks functions whose path starts with `prefix` as entry points of an integration (like
    /// the allocator's own `malloc`): a resolved stack starts at its caller, below the last
    /// such frame. Called once per prefix; a prefix given twice is kept once.
    pub fn skip_frames_of(prefix: &'static str) {
        let mut prefixes = INTEGRATION_FRAMES.write();
        if !prefixes.contains(&prefix) {
            prefixes.push(prefix);
        }
    }
}

/// Whether `frame` is one of the allocator's public entry points (`malloc`, `free`, ...),
/// or one an integration marked with [`Stack::skip_frames_of`], which sit between the caller
/// and the capture.
fn is_allocator_frame(frame: &Frame) -> bool {
    let name = frame.name.trim_start_matches('<');
    name.starts_with("caching_alloc_engine::alloc::allocator::")
        || INTEGRATION_FRAMES
            .read()
            .iter()
            .any(|prefix| name.starts_with(prefix))
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
    fn a_served_stack_stands_for_the_thread_s_own_until_the_closure_returns() {
        let caller = capture_here();
        let inner = Stack::capture();
        let seen = Stack::serving(Some(caller.clone()), || {
            let nested = Stack::serving(Some(inner.clone()), Stack::of_request);
            (Stack::of_request(), nested)
        });
        assert_eq!(seen.0, caller);
        assert_eq!(seen.1, inner);
        // Outside, and with `None`, the thread's own stack again.
        assert_ne!(Stack::of_request(), caller);
        assert_ne!(Stack::serving(None, Stack::of_request), caller);
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
