//! The fake's one global state, behind one lock: configuration, devices and contexts, memory,
//! streams and events, the violation log, call counts for fault injection.
//!
//! Every exported function takes the lock for its whole call (work that runs, runs under it), so
//! the fake is a sequentially consistent model of the device: the order its calls happen in is
//! the order the lock was taken in. A synchronisation that must wait for work no thread has
//! queued yet (an NCCL peer) waits on the condition variable, the lock released.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

use crate::codes;
use crate::config::{Config, Schedule};
use crate::memory::Memory;
use crate::nccl::Nccl;
use crate::nvrtc::Nvrtc;
use crate::nvrtc::image::Entry;
use crate::streams::{Clock, Event, Stream};

/// Handles are small integers in ranges of their own, so that a handle of one kind passed as
/// another is recognised.
pub const CONTEXT_BASE: u64 = 0xC0_0000;
pub const STREAM_BASE: u64 = 0x5000_0000;
pub const EVENT_BASE: u64 = 0x6000_0000;
pub const MODULE_BASE: u64 = 0x7000_0000;
pub const FUNCTION_BASE: u64 = 0x7800_0000;

#[derive(Debug)]
pub struct Device {
    /// Retains of the primary context; it is active while positive.
    pub retains: u32,
    /// Device streams: the context's NULL stream (legacy default stream).
    pub null_stream: u64,
}

/// A module from `cuModuleLoadData`: its device and the entry points of its image.
#[derive(Debug)]
pub struct Module {
    pub device: usize,
    pub entries: Vec<Entry>,
}

/// A function from `cuModuleGetFunction`.
#[derive(Debug)]
pub struct Function {
    pub module: u64,
    pub entry: Entry,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (48 KiB until set).
    pub max_dynamic_shared: u32,
    /// What launches of it are called in logs and race reports: `cuLaunchKernel(<name>)`,
    /// interned (one leaked string per distinct entry name).
    pub label: &'static str,
}

#[derive(Debug)]
pub struct Fake {
    pub config: Config,
    pub initialized: bool,
    pub devices: Vec<Device>,
    pub memory: Memory,
    pub streams: HashMap<u64, Stream>,
    pub events: HashMap<u64, Event>,
    /// `(a, b)`: device a's context enabled access to device b's memory.
    pub peer_enabled: HashSet<(usize, usize)>,
    pub modules: HashMap<u64, Module>,
    pub functions: HashMap<u64, Function>,
    pub next_handle: u64,
    pub calls: HashMap<String, u64>,
    pub faults: Vec<crate::config::Fault>,
    pub violations: Vec<String>,
    pub schedule: Schedule,
    pub rng: u64,
    /// What the host has seen complete (synchronisations, successful queries): work queued
    /// after is ordered after it.
    pub host_clock: Clock,
    /// Accesses of queued or running work not yet known complete to the host, for the race
    /// detector.
    pub accesses: Vec<crate::streams::TrackedAccess>,
    pub nccl: Nccl,
    pub nvrtc: Nvrtc,
}

pub struct Global {
    pub state: Mutex<Fake>,
    pub progress: Condvar,
}

pub fn global() -> &'static Global {
    static GLOBAL: OnceLock<Global> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let config = Config::from_env();
        let devices = (0..config.devices)
            .map(|d| Device {
                retains: 0,
                null_stream: STREAM_BASE + d as u64,
            })
            .collect();
        let mut fake = Fake {
            faults: config.faults.clone(),
            schedule: config.schedule,
            rng: config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            config,
            initialized: false,
            devices,
            memory: Memory::default(),
            streams: HashMap::new(),
            events: HashMap::new(),
            peer_enabled: HashSet::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            next_handle: 0x100,
            calls: HashMap::new(),
            violations: Vec::new(),
            host_clock: Clock::default(),
            accesses: Vec::new(),
            nccl: Nccl::default(),
            nvrtc: Nvrtc::default(),
        };
        for d in 0..fake.devices.len() {
            let handle = fake.devices[d].null_stream;
            fake.streams.insert(handle, Stream::new(d, true));
        }
        Global {
            state: Mutex::new(fake),
            progress: Condvar::new(),
        }
    })
}

pub fn lock() -> MutexGuard<'static, Fake> {
    global()
        .state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

thread_local! {
    /// The calling thread's current context: the device whose primary context it is.
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

pub fn current_device() -> Option<usize> {
    CURRENT.with(Cell::get)
}

pub fn set_current_device(device: Option<usize>) {
    CURRENT.with(|current| current.set(device));
}

pub fn context_handle(device: usize) -> u64 {
    CONTEXT_BASE + device as u64
}

pub fn context_device(handle: u64) -> Option<usize> {
    handle.checked_sub(CONTEXT_BASE).map(|d| d as usize)
}

impl Fake {
    /// Logs a broken contract: kept for the harness and appended to `FAKE_CUDA_VIOLATIONS`.
    pub fn violation(&mut self, call: &str, what: impl AsRef<str>) {
        let line = format!("{call}: {}", what.as_ref());
        if let Some(path) = &self.config.violations_file
            && let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
        {
            let _ = writeln!(file, "{line}");
        }
        eprintln!("[fake-cuda] contract violation: {line}");
        self.violations.push(line);
    }

    /// A violation that the real driver answers with `code`.
    pub fn reject(&mut self, call: &str, code: u32, what: impl AsRef<str>) -> u32 {
        self.violation(call, format!("{} ({})", what.as_ref(), codes::name(code)));
        code
    }

    /// Counts a call of `name`; an injected fault's code when this call must fail.
    pub fn count_call(&mut self, name: &str) -> Option<u32> {
        let count = self.calls.entry(name.to_string()).or_default();
        *count += 1;
        let count = *count;
        self.faults
            .iter()
            .find(|fault| {
                fault.name == name && (count == fault.nth || (fault.sticky && count > fault.nth))
            })
            .map(|fault| fault.code)
    }

    pub fn next_handle(&mut self, base: u64) -> u64 {
        self.next_handle += 1;
        base + self.next_handle
    }

    /// The calling thread's current context, checked: a violation without one.
    pub fn context(&mut self, call: &str) -> Result<usize, u32> {
        if !self.initialized {
            return Err(self.reject(call, codes::NOT_INITIALIZED, "called before cuInit"));
        }
        match current_device() {
            None => Err(self.reject(
                call,
                codes::INVALID_CONTEXT,
                "no current context on the calling thread",
            )),
            Some(device) if self.devices.get(device).is_none_or(|d| d.retains == 0) => Err(self
                .reject(
                    call,
                    codes::CONTEXT_IS_DESTROYED,
                    format!("the current context (device {device}) was released"),
                )),
            Some(device) => Ok(device),
        }
    }

    pub fn device_index(&mut self, call: &str, device: i32) -> Result<usize, u32> {
        if device < 0 || device as usize >= self.devices.len() {
            return Err(self.reject(call, codes::INVALID_DEVICE, format!("no device {device}")));
        }
        Ok(device as usize)
    }

    /// The next pseudo-random number (xorshift64*), for the scheduler.
    pub fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// What was never freed, one line each (empty when nothing).
    pub fn leaks(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for (base, allocation) in &self.memory.allocations {
            lines.push(format!(
                "cuMemAlloc {base:#x}: {} bytes on device {}",
                allocation.size, allocation.device
            ));
        }
        for (handle, phys) in &self.memory.phys {
            if phys.created && !phys.released {
                lines.push(format!(
                    "cuMemCreate {handle:#x}: {} bytes on device {} ({} mappings)",
                    phys.data.len(),
                    phys.device,
                    phys.mappings
                ));
            }
        }
        for (base, reservation) in &self.memory.reservations {
            lines.push(format!(
                "cuMemAddressReserve {base:#x}: {} bytes, {} mappings",
                reservation.size,
                reservation.mappings.len()
            ));
        }
        for (ptr, host) in &self.memory.host {
            lines.push(format!("cuMemHostAlloc {ptr:#x}: {} bytes", host.size));
        }
        let mut streams: Vec<_> = self
            .streams
            .iter()
            .filter(|(_, s)| s.alive && !s.null)
            .collect();
        streams.sort_by_key(|(handle, _)| **handle);
        for (handle, stream) in streams {
            lines.push(format!(
                "cuStreamCreate {handle:#x} on device {}",
                stream.device
            ));
        }
        let events = self.events.values().filter(|e| e.alive).count();
        if events > 0 {
            lines.push(format!("cuEventCreate: {events} events"));
        }
        lines.extend(self.nccl.leaks());
        lines.extend(self.nvrtc.leaks());
        lines
    }

    /// Live device memory of `device`: (cuMemAlloc bytes, cuMemCreate bytes not released,
    /// reserved ranges).
    pub fn live_on(&self, device: usize) -> (u64, u64, u64) {
        let allocated = self
            .memory
            .allocations
            .values()
            .filter(|a| a.device == device)
            .map(|a| a.size)
            .sum();
        let created = self
            .memory
            .phys
            .values()
            .filter(|p| p.created && p.device == device && !p.released)
            .map(|p| p.data.len() as u64)
            .sum();
        let reserved = self.memory.reservations.len() as u64;
        (allocated, created, reserved)
    }
}

/// Runs an exported call: the lock, the call count and injected faults, and no panic crossing
/// the C boundary (a panic is logged as a fake defect and answered `CUDA_ERROR_UNKNOWN`).
pub fn call(name: &str, body: impl FnOnce(&mut MutexGuard<'static, Fake>) -> u32) -> u32 {
    call_or(name, codes::UNKNOWN, body)
}

/// [`call`] answering `on_panic` when the fake panics (a library whose result type has no
/// `CUDA_ERROR_UNKNOWN`: NVRTC).
pub fn call_or(
    name: &str,
    on_panic: u32,
    body: impl FnOnce(&mut MutexGuard<'static, Fake>) -> u32,
) -> u32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut fake = lock();
        if let Some(code) = fake.count_call(name) {
            return code;
        }
        let code = body(&mut fake);
        drop(fake);
        global().progress.notify_all();
        code
    }));
    result.unwrap_or_else(|_| {
        let mut fake = lock();
        fake.violation(name, "the fake panicked (a defect of the fake)");
        on_panic
    })
}

/// Waiting for other threads' calls with the lock released.
pub trait MutexGuardExt {
    fn wait_for_progress(&mut self, timeout: std::time::Duration);
}

impl MutexGuardExt for MutexGuard<'static, Fake> {
    fn wait_for_progress(&mut self, timeout: std::time::Duration) {
        // The guard is moved out and back: `Condvar::wait_timeout` takes it by value.
        replace_with(self, |guard| {
            global()
                .progress
                .wait_timeout(guard, timeout)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0)
        });
    }
}

fn replace_with<T>(slot: &mut T, f: impl FnOnce(T) -> T) {
    // SAFETY: `f` is `Condvar::wait_timeout`, which does not unwind (poison is handled), so
    // the slot is always written back before anyone can observe it.
    unsafe {
        let old = std::ptr::read(slot);
        let new = f(old);
        std::ptr::write(slot, new);
    }
}
