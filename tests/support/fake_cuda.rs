//! Running a test binary under the fake CUDA driver (`fake-cuda/`), for any test binary of this
//! crate: include this file by path, call [`start`] from a constructor that runs before
//! libtest's `main`, and begin each test with [`fake_or_skip`].
//!
//! ```ignore
//! #[path = "../support/fake_cuda.rs"]
//! mod fake_cuda;
//! #[ctor::ctor(unsafe)]
//! fn under_the_fake() {
//!     fake_cuda::start(&[("FAKE_CUDA_DEVICES", "2")]);
//! }
//! ```
//!
//! cudarc loads `libcuda.so` by name, and the dynamic loader reads `LD_LIBRARY_PATH` only when
//! a process starts, so [`start`] re-executes the test binary with a private folder first on
//! that path: `target/<profile>/fake-cuda-lib/` holding `libcuda.so`, `libcuda.so.1`,
//! `libnccl.so`, `libnccl.so.2` and `libnvrtc.so` (the first name cudarc's loader tries for
//! NVRTC), all links to the fake's `libfake_cuda.so` (one library, so CUDA, NCCL and NVRTC share
//! its state: what its NVRTC compiles, its driver loads and launches), and an empty
//! `include/cuda_fp16.h` so that the CUDA driver's header check passes (`CUDA_PATH` points
//! there; the fake NVRTC reads no header). The fake is never named `libcuda.so` in
//! `target/*/deps`, which cargo puts on every test's library path.
//!
//! Without the fake built (`cargo build -p fake-cuda`) the tests skip with one printed reason;
//! with `CI` set they fail instead. `FAKE_CUDA_LIB` names another build of the fake.
//! `BURN_CACHING_ALLOC_REAL_CUDA=1` runs the same tests on the machine's real driver instead
//! (`scripts/gpu-check.sh`): the fake's own checks (violation log, what is left allocated) are
//! then skipped, everything else is asserted as on the fake.

#![allow(dead_code)]

use std::ffi::{CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Set in the re-executed process: the folder the fake was linked into.
pub const ACTIVE: &str = "FAKE_CUDA_ACTIVE";
/// Set (to anything but empty or 0) to run on the real driver instead of the fake.
pub const REAL: &str = "BURN_CACHING_ALLOC_REAL_CUDA";

/// Why the fake is not in use, when it is not (recorded by [`start`]).
static SKIP: OnceLock<String> = OnceLock::new();

fn is_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        let v = v.trim();
        !(v.is_empty() || v == "0" || v.eq_ignore_ascii_case("false"))
    })
}

pub fn is_ci() -> bool {
    is_set("CI")
}

pub fn real_driver() -> bool {
    is_set(REAL)
}

/// The fake's library: `FAKE_CUDA_LIB`, else `libfake_cuda.so` in the profile folder this test
/// binary was built into (`target/debug/deps/<test>` -> `target/debug/`).
pub fn library() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("FAKE_CUDA_LIB") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("FAKE_CUDA_LIB={} is not a file", path.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("no current executable: {e}"))?;
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("the test binary is not in target/<profile>/deps")?;
    let lib = profile.join("libfake_cuda.so");
    if lib.is_file() {
        Ok(lib)
    } else {
        Err(format!(
            "the fake CUDA driver is not built ({} is missing); build it with `cargo build -p \
             fake-cuda` (same profile as the tests) and run again",
            lib.display()
        ))
    }
}

/// Links `name` in `dir` to `target`, replacing what is there (atomically, so that test
/// binaries starting at the same time do not trip over each other).
fn link(dir: &Path, name: &str, target: &Path) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// The private folder with the links, next to the fake's library.
fn prepare(lib: &Path) -> Result<PathBuf, String> {
    let lib = lib
        .canonicalize()
        .map_err(|e| format!("{}: {e}", lib.display()))?;
    let dir = lib
        .parent()
        .expect("a file has a folder")
        .join("fake-cuda-lib");
    let include = dir.join("include");
    std::fs::create_dir_all(&include).map_err(|e| format!("{}: {e}", include.display()))?;
    for name in [
        "libcuda.so",
        "libcuda.so.1",
        "libnccl.so",
        "libnccl.so.2",
        "libnvrtc.so",
    ] {
        link(&dir, name, &lib).map_err(|e| format!("linking {name}: {e}"))?;
    }
    let header = include.join("cuda_fp16.h");
    if !header.is_file() {
        std::fs::write(&header, "// fake-cuda: the fake NVRTC reads no header\n")
            .map_err(|e| format!("{}: {e}", header.display()))?;
    }
    Ok(dir)
}

/// Before `main`: re-executes this test binary with the fake first on the library path and
/// `settings` (`FAKE_CUDA_*` variables, unless already set) in its environment. Returns (so the
/// tests skip or fail) when the fake is not built, and on the real driver
/// (`BURN_CACHING_ALLOC_REAL_CUDA`).
pub fn start(settings: &[(&str, &str)]) {
    if real_driver() {
        let _ = SKIP.set(String::new());
        return;
    }
    if std::env::var_os(ACTIVE).is_some() {
        return;
    }
    let dir = match library().and_then(|lib| prepare(&lib)) {
        Ok(dir) => dir,
        Err(reason) => {
            // Once, uncaptured: libtest hides what passing tests print.
            eprintln!(
                "the CUDA tests under the fake driver skip{}: {reason}",
                if is_ci() {
                    " (CI is set: they fail)"
                } else {
                    ""
                }
            );
            let _ = SKIP.set(reason);
            return;
        }
    };
    let mut command = std::process::Command::new(std::env::current_exe().expect("checked"));
    command.args(std::env::args_os().skip(1));
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) if !old.is_empty() => {
            let mut path = dir.clone().into_os_string();
            path.push(":");
            path.push(old);
            path
        }
        _ => dir.clone().into_os_string(),
    };
    command
        .env("LD_LIBRARY_PATH", path)
        .env(ACTIVE, &dir)
        .env("CUDA_PATH", &dir);
    for (name, value) in settings {
        if std::env::var_os(name).is_none() {
            command.env(name, value);
        }
    }
    use std::os::unix::process::CommandExt;
    let err = command.exec();
    let _ = SKIP.set(format!(
        "re-executing the tests under the fake failed: {err}"
    ));
}

/// The fake's own functions (`fake_cuda_*`), from the loaded `libcuda.so`.
pub struct Fake {
    lib: libloading::Library,
}

impl Fake {
    fn open() -> Result<Self, String> {
        // SAFETY: the fake's library (the folder is first on the library path); loading it
        // again returns the copy cudarc loaded.
        let lib = unsafe { libloading::Library::new("libcuda.so") }.map_err(|e| e.to_string())?;
        // SAFETY: the symbol's type is the fake's.
        let probe = unsafe { lib.get::<extern "C" fn() -> u64>(b"fake_cuda_violation_count") };
        if probe.is_err() {
            return Err("the libcuda.so on the library path is not the fake".into());
        }
        Ok(Self { lib })
    }

    fn report(&self, kind: c_int) -> String {
        type Report = unsafe extern "C" fn(c_int, *mut c_char, usize) -> usize;
        // SAFETY: the fake's function, with a buffer of the size it asked for.
        unsafe {
            let report = self
                .lib
                .get::<Report>(b"fake_cuda_report")
                .expect("fake_cuda_report");
            let needed = report(kind, std::ptr::null_mut(), 0);
            let mut buf = vec![0u8; needed + 4096];
            let needed = report(kind, buf.as_mut_ptr() as *mut c_char, buf.len());
            buf.truncate(needed.saturating_sub(1));
            String::from_utf8_lossy(&buf).into_owned()
        }
    }

    fn lines(text: String) -> Vec<String> {
        text.lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Every contract violation so far, one line each.
    pub fn violations(&self) -> Vec<String> {
        Self::lines(self.report(0))
    }

    /// What is still allocated (device memory, mappings, ranges, pinned memory, streams, events,
    /// NCCL communicators), one line each.
    pub fn leaks(&self) -> Vec<String> {
        Self::lines(self.report(1))
    }

    /// Calls so far per function, `name count` lines.
    pub fn call_counts(&self) -> String {
        self.report(2)
    }

    pub fn clear_violations(&self) {
        // SAFETY: the fake's function.
        unsafe {
            self.lib
                .get::<extern "C" fn()>(b"fake_cuda_clear_violations")
                .expect("symbol")()
        }
    }

    /// 0 eager, 1 delayed, 2 random.
    pub fn set_schedule(&self, mode: Schedule, seed: u64) {
        // SAFETY: the fake's function.
        let code = unsafe {
            self.lib
                .get::<extern "C" fn(c_int, u64) -> c_int>(b"fake_cuda_set_schedule")
                .expect("symbol")(mode as c_int, seed)
        };
        assert_eq!(code, 0);
    }

    /// Makes the `nth` next call of `name` fail (and every later one with `sticky`), with
    /// `code` (0: out of memory for memory calls, else unknown).
    pub fn inject(&self, name: &str, nth: u64, sticky: bool, code: u32) {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: the fake's function with a NUL-terminated name.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*const c_char, u64, c_int, u32)>(b"fake_cuda_inject")
                .expect("symbol")(name.as_ptr(), nth, sticky as c_int, code)
        }
    }

    pub fn clear_faults(&self) {
        // SAFETY: the fake's function.
        unsafe {
            self.lib
                .get::<extern "C" fn()>(b"fake_cuda_clear_faults")
                .expect("symbol")()
        }
    }

    /// Calls of `name` so far.
    pub fn calls(&self, name: &str) -> u64 {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: the fake's function with a NUL-terminated name.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*const c_char) -> u64>(b"fake_cuda_call_count")
                .expect("symbol")(name.as_ptr())
        }
    }

    /// What device `device` holds: cuMemAlloc bytes, cuMemCreate bytes not released, reserved
    /// ranges (all devices), physical bytes in use.
    pub fn live(&self, device: usize) -> Live {
        let mut out = [0u64; 4];
        // SAFETY: the fake's function writes four values.
        unsafe {
            self.lib
                .get::<unsafe extern "C" fn(c_int, *mut u64)>(b"fake_cuda_live")
                .expect("symbol")(device as c_int, out.as_mut_ptr())
        };
        Live {
            allocated: out[0],
            created: out[1],
            reserved_ranges: out[2],
            physical: out[3],
        }
    }

    /// Items queued and not yet run, on every stream.
    pub fn pending(&self) -> u64 {
        // SAFETY: the fake's function.
        unsafe {
            self.lib
                .get::<extern "C" fn() -> u64>(b"fake_cuda_pending")
                .expect("symbol")()
        }
    }

    /// Panics with the log when a contract was broken.
    pub fn assert_no_violations(&self) {
        let violations = self.violations();
        assert!(
            violations.is_empty(),
            "the fake CUDA driver logged {} contract violations:\n{}",
            violations.len(),
            violations.join("\n")
        );
    }
}

/// Device memory the fake still holds for one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Live {
    pub allocated: u64,
    pub created: u64,
    pub reserved_ranges: u64,
    pub physical: u64,
}

/// The fake's scheduler modes (`FAKE_CUDA_SCHEDULE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    Eager = 0,
    Delayed = 1,
    Random = 2,
}

pub const SCHEDULES: [Schedule; 3] = [Schedule::Eager, Schedule::Delayed, Schedule::Random];

/// Where a test runs.
pub enum Driver {
    /// The fake, with its checks.
    Fake(Fake),
    /// The real driver (`BURN_CACHING_ALLOC_REAL_CUDA`): no fake checks.
    Real,
}

impl Driver {
    pub fn fake(&self) -> Option<&Fake> {
        match self {
            Driver::Fake(fake) => Some(fake),
            Driver::Real => None,
        }
    }

    /// The device ordinal for the fake's device `fake_device`: itself on the fake, 0 on the
    /// real driver (a GPU machine has one device).
    pub fn ordinal(&self, fake_device: usize) -> usize {
        match self {
            Driver::Fake(_) => fake_device,
            Driver::Real => 0,
        }
    }

    /// On the real driver, where every test shares device 0: a process-wide turn, so that no
    /// test's statistics see another's tensors. `None` on the fake (each file its own device).
    pub fn real_turn(&self) -> Option<parking_lot::MutexGuard<'static, ()>> {
        static TURN: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
        matches!(self, Driver::Real).then(|| TURN.lock())
    }
}

/// Says that a test checks the fake itself and has nothing to run on the real driver (worded
/// so that `scripts/gpu-check.sh` does not take it for a test that found no device).
pub fn fake_only(what: &str) {
    println!("fake driver only, nothing to run on a real device: {what}");
}

/// The driver to test against, or `None` after printing why the test skips. Panics instead of
/// skipping when `CI` is set.
pub fn fake_or_skip() -> Option<Driver> {
    if real_driver() {
        return match burn_caching_alloc::cuda::cuda_available() {
            Ok(()) => Some(Driver::Real),
            Err(reason) => {
                assert!(!is_ci(), "{REAL} is set but CUDA is not usable: {reason}");
                println!("skipping: {REAL} is set but CUDA is not usable: {reason}");
                None
            }
        };
    }
    let reason = match std::env::var_os(ACTIVE) {
        Some(_) => match Fake::open() {
            Ok(fake) => return Some(Driver::Fake(fake)),
            Err(reason) => reason,
        },
        None => SKIP
            .get()
            .cloned()
            .unwrap_or_else(|| "fake_cuda::start was not called before main".into()),
    };
    assert!(
        !is_ci(),
        "CI is set and the CUDA tests cannot run under the fake driver: {reason}"
    );
    println!("skipping (the fake CUDA driver is not in use): {reason}");
    None
}
