//! Functions the test harness calls (through `dlsym`), not part of CUDA: the violation log,
//! what is still allocated, the scheduler, fault injection. All prefixed `fake_cuda_`.

use std::ffi::{CStr, c_char, c_int};

use crate::config::{Fault, Schedule, default_fault_code};
use crate::state::lock;

/// Copies `text` and a NUL into `buf` (of `len` bytes) if it fits; returns the bytes needed.
unsafe fn write_text(text: &str, buf: *mut c_char, len: usize) -> usize {
    let needed = text.len() + 1;
    if !buf.is_null() && len >= needed {
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, text.len());
            buf.add(text.len()).write(0);
        }
    }
    needed
}

/// A report as text: 0 the violations, 1 what is still allocated (leaks), 2 call counts; one
/// line each. Returns the bytes needed (with the NUL); writes only when `len` is enough.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_report(kind: c_int, buf: *mut c_char, len: usize) -> usize {
    let fake = lock();
    let text = match kind {
        0 => fake.violations.join("\n"),
        1 => fake.leaks().join("\n"),
        _ => {
            let mut calls: Vec<_> = fake
                .calls
                .iter()
                .map(|(name, n)| format!("{name} {n}"))
                .collect();
            calls.sort();
            calls.join("\n")
        }
    };
    unsafe { write_text(&text, buf, len) }
}

#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_violation_count() -> u64 {
    lock().violations.len() as u64
}

#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_clear_violations() {
    lock().violations.clear();
}

/// 0 eager, 1 delayed, 2 random; with the seed. Returns 0, or -1 for an unknown mode.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_schedule(mode: c_int, seed: u64) -> c_int {
    let Some(schedule) = Schedule::from_code(mode) else {
        return -1;
    };
    let mut fake = lock();
    fake.schedule = schedule;
    fake.rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    0
}

/// Makes the `nth` next call of `name` (counted from now) fail with `code` (0: the default for
/// the function), and every call after it when `sticky`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_inject(name: *const c_char, nth: u64, sticky: c_int, code: u32) {
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let mut fake = lock();
    let done = fake.calls.get(&name).copied().unwrap_or(0);
    let code = if code == 0 {
        default_fault_code(&name)
    } else {
        code
    };
    fake.faults.push(Fault {
        name,
        nth: done + nth,
        sticky: sticky != 0,
        code,
    });
}

#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_clear_faults() {
    lock().faults.clear();
}

/// Calls of `name` so far.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_call_count(name: *const c_char) -> u64 {
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    lock().calls.get(name.as_ref()).copied().unwrap_or(0)
}

/// What device `device` still has: `out[0]` cuMemAlloc bytes, `out[1]` cuMemCreate bytes not
/// released, `out[2]` reserved ranges (of every device), `out[3]` physical bytes in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_live(device: c_int, out: *mut u64) {
    let fake = lock();
    let (allocated, created, reserved) = fake.live_on(device as usize);
    let used = fake.memory.used(device as usize);
    if !out.is_null() {
        unsafe {
            out.write(allocated);
            out.add(1).write(created);
            out.add(2).write(reserved);
            out.add(3).write(used);
        }
    }
}

/// Items queued and not yet run, on every stream.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_pending() -> u64 {
    lock().streams.values().map(|s| s.queue.len() as u64).sum()
}

/// Writes the report of what was never freed at exit, where `FAKE_CUDA_LEAKS` says.
extern "C" fn report_at_exit() {
    let Ok(fake) = crate::state::global().state.try_lock() else {
        return;
    };
    let Some(target) = fake.config.leaks.clone() else {
        return;
    };
    let leaks = fake.leaks();
    let text = if leaks.is_empty() {
        "fake-cuda: nothing left allocated at exit\n".to_string()
    } else {
        format!("fake-cuda: left allocated at exit:\n{}\n", leaks.join("\n"))
    };
    if target == "stderr" {
        eprint!("{text}");
    } else {
        let _ = std::fs::write(target, text);
    }
}

#[used]
#[unsafe(link_section = ".fini_array")]
static REPORT_AT_EXIT: extern "C" fn() = report_at_exit;
