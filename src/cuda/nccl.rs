//! NCCL for `all_reduce`, loaded at run time by this crate: `libnccl.so.2` (the name NCCL
//! ships as, the only one runtime-only installs such as Debian's `libnccl2` or pip's
//! `nvidia-nccl-cu12` provide), then `libnccl.so`. A missing library is a value
//! ([`NcclMissing`]), never a panic; `BURN_CACHING_ALLOC_COMM` decides what follows from it.
//!
//! One communicator clique per group of devices (sorted; a device's rank is its position),
//! made by the first member to reach the group's first all-reduce with `ncclCommInitAll` (or,
//! where a library lacks it, what it does: `ncclCommInitRank` per device in one group call), so
//! no member waits for another to make them and a failure reaches every member alike. Each
//! member uses its own rank's communicator, on its calling stream. A member that finds an
//! error (`ncclCommGetAsyncError`, or a failed call) marks the group broken and aborts every
//! communicator of it that is not in use, so that a collective already waiting on the device
//! for that member ends; every member then gets the error on its stream at its next
//! all-reduce or sync, and the group is not used again. A member whose server drops aborts
//! its communicator (never `ncclCommDestroy`, which would wait for peers) and ends the group.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use caching_alloc_engine::registry::{self, DeviceKey};
use cubecl_common::device::DeviceId;
use cubecl_ir::{ElemType, FloatKind, IntKind, UIntKind};
use cubecl_runtime::server::ReduceOperation;
use parking_lot::Mutex;

/// The names tried, in order, after [`NCCL_ENV`]'s path and before pip's copies.
pub const NCCL_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// An NCCL library to load before any other: `BURN_CACHING_ALLOC_NCCL=/path/libnccl.so.2`.
pub const NCCL_ENV: &str = "BURN_CACHING_ALLOC_NCCL";

/// What the loader tries, in order: the path `explicit` names ([`NCCL_ENV`]), NCCL's own names
/// (found through the loader's search path), then the copies pip installs
/// (`nvidia-nccl-cu*`: `<prefix>/lib/python3.*/{site,dist}-packages/nvidia/nccl/lib/libnccl.so.2`)
/// under each of `prefixes` (a virtual environment, conda, `/usr/local`, `/usr`, `~/.local`),
/// which the loader never searches.
fn candidates(
    explicit: Option<std::ffi::OsString>,
    prefixes: &[std::path::PathBuf],
) -> Vec<String> {
    let mut names: Vec<String> = explicit
        .map(|path| path.to_string_lossy().into_owned())
        .into_iter()
        .collect();
    names.extend(NCCL_NAMES.iter().map(|name| name.to_string()));
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<_> = entries
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for python in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let lib = python.join(packages).join("nvidia/nccl/lib/libnccl.so.2");
                if lib.is_file() {
                    names.push(lib.to_string_lossy().into_owned());
                }
            }
        }
    }
    names
}

/// Where pip's NCCL may live: the active virtual environment or conda prefix, the system's
/// prefixes and the user's.
fn pip_prefixes() -> Vec<std::path::PathBuf> {
    let mut prefixes: Vec<std::path::PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|var| std::env::var_os(var).map(Into::into))
        .collect();
    prefixes.extend(["/usr/local", "/usr"].map(std::path::PathBuf::from));
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(std::path::PathBuf::from(home).join(".local"));
    }
    prefixes
}

/// NCCL 2.10: `ncclAvg` and `ncclBfloat16`.
const AVG_AND_BF16: c_int = 21000;
/// NCCL 2.24: the 8-bit float types.
const FLOAT8: c_int = 22400;

type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;

type RawComm = *mut c_void;

/// `ncclRedOp_t` values this crate uses.
const NCCL_SUM: c_int = 0;
const NCCL_AVG: c_int = 4;

/// Why NCCL is not here: each name tried and what loading it said.
#[derive(Debug, Clone)]
pub struct NcclMissing {
    /// `(name, error)` per name tried.
    pub tried: Vec<(&'static str, String)>,
}

impl std::fmt::Display for NcclMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL (libnccl) could not be loaded; tried ")?;
        for (i, (name, err)) in self.tried.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{name} ({err})")?;
        }
        Ok(())
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type CommInitAll = unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult;
/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type GroupCall = unsafe extern "C" fn() -> NcclResult;

/// The two ways of making a clique from one thread: `ncclCommInitAll`, or what it does,
/// `ncclCommInitRank` per device inside `ncclGroupStart`/`ncclGroupEnd` with the device's
/// context current (used when a library lacks `ncclCommInitAll`).
#[derive(Clone, Copy)]
enum CliqueInit {
    All(CommInitAll),
    Ranks {
        get_unique_id: GetUniqueId,
        init_rank: CommInitRank,
        group_start: GroupCall,
        group_end: GroupCall,
    },
}
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    *mut c_void,
) -> NcclResult;
type CommGetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type CommFree = unsafe extern "C" fn(RawComm) -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// The loaded library and the functions this crate calls.
pub struct Nccl {
    name: &'static str,
    version: c_int,
    init: CliqueInit,
    all_reduce: AllReduce,
    comm_get_async_error: CommGetAsyncError,
    comm_abort: CommFree,
    get_error_string: GetErrorString,
    /// Kept loaded for the process: the function pointers above point into it.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("name", &self.name)
            .field("version", &self.version)
            .finish()
    }
}

/// NCCL for the process, loaded at the first call.
pub fn nccl() -> Result<&'static Nccl, &'static NcclMissing> {
    static LOADED: OnceLock<Result<Nccl, NcclMissing>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // Loaded once per process: the names live as long.
            let names: Vec<&'static str> = candidates(std::env::var_os(NCCL_ENV), &pip_prefixes())
                .into_iter()
                .map(|name| &*Box::leak(name.into_boxed_str()))
                .collect();
            Nccl::load(&names)
        })
        .as_ref()
}

/// The name NCCL was loaded by and its version (`ncclGetVersion`, e.g. 22703 for 2.27.3), or
/// why it could not be loaded.
pub fn nccl_version() -> Result<(&'static str, i32), String> {
    nccl()
        .map(|lib| (lib.name, lib.version))
        .map_err(|missing| missing.to_string())
}

impl Nccl {
    fn load(names: &[&'static str]) -> Result<Self, NcclMissing> {
        let mut tried = Vec::new();
        for name in names {
            // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(name) } {
                Ok(library) => match Self::bind(name, library) {
                    Ok(nccl) => return Ok(nccl),
                    Err(err) => tried.push((*name, err)),
                },
                Err(err) => tried.push((*name, err.to_string())),
            }
        }
        Err(NcclMissing { tried })
    }

    fn bind(name: &'static str, library: libloading::Library) -> Result<Self, String> {
        // SAFETY: each symbol is looked up with the signature of NCCL's C API (nccl.h).
        unsafe {
            fn symbol<T: Copy>(library: &libloading::Library, name: &str) -> Result<T, String> {
                // SAFETY: the caller names the symbol's C type as `T`.
                unsafe { library.get::<T>(name.as_bytes()) }
                    .map(|symbol| *symbol)
                    .map_err(|err| format!("{name}: {err}"))
            }
            let get_version: GetVersion = symbol(&library, "ncclGetVersion")?;
            let mut version = 0;
            let code = get_version(&mut version);
            if code != NCCL_SUCCESS {
                return Err(format!("ncclGetVersion returned {code}"));
            }
            let init = match symbol::<CommInitAll>(&library, "ncclCommInitAll") {
                Ok(all) => CliqueInit::All(all),
                Err(missing_all) => CliqueInit::Ranks {
                    get_unique_id: symbol(&library, "ncclGetUniqueId")
                        .map_err(|err| format!("{missing_all}; {err}"))?,
                    init_rank: symbol(&library, "ncclCommInitRank")?,
                    group_start: symbol(&library, "ncclGroupStart")?,
                    group_end: symbol(&library, "ncclGroupEnd")?,
                },
            };
            Ok(Self {
                name,
                version,
                init,
                all_reduce: symbol(&library, "ncclAllReduce")?,
                comm_get_async_error: symbol(&library, "ncclCommGetAsyncError")?,
                comm_abort: symbol(&library, "ncclCommAbort")?,
                get_error_string: symbol(&library, "ncclGetErrorString")?,
                _library: library,
            })
        }
    }

    fn error(&self, call: &str, code: NcclResult) -> String {
        // SAFETY: NCCL returns a static string for any code.
        let text = unsafe { (self.get_error_string)(code) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a NUL-terminated static string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        format!("NCCL: {call} failed: {text} (code {code})")
    }

    fn check(&self, call: &str, code: NcclResult) -> Result<(), String> {
        match code {
            NCCL_SUCCESS => Ok(()),
            code => Err(self.error(call, code)),
        }
    }

    /// Makes one communicator per device of `ordinals` into `comms`, from this thread.
    fn make_clique(
        &self,
        comms: &mut [RawComm],
        ordinals: &[c_int],
        bind: &dyn Fn(usize) -> Result<(), String>,
    ) -> Result<(), String> {
        match self.init {
            CliqueInit::All(init_all) => {
                // SAFETY: one slot per device; `ordinals` are this process's devices.
                let code = unsafe {
                    init_all(comms.as_mut_ptr(), comms.len() as c_int, ordinals.as_ptr())
                };
                self.check("ncclCommInitAll", code)
            }
            CliqueInit::Ranks {
                get_unique_id,
                init_rank,
                group_start,
                group_end,
            } => {
                let mut id = UniqueId([0; 128]);
                // SAFETY: `id` is valid for the write.
                self.check("ncclGetUniqueId", unsafe { get_unique_id(&mut id) })?;
                // SAFETY: no arguments.
                self.check("ncclGroupStart", unsafe { group_start() })?;
                let mut made = Ok(());
                for (rank, ordinal) in ordinals.iter().enumerate() {
                    made = bind(*ordinal as usize).and_then(|()| {
                        // SAFETY: the rank's slot; the device's context is current.
                        let code = unsafe {
                            init_rank(&mut comms[rank], comms.len() as c_int, id, rank as c_int)
                        };
                        self.check("ncclCommInitRank", code)
                    });
                    if made.is_err() {
                        break;
                    }
                }
                // SAFETY: closes the group opened above.
                let ended = self.check("ncclGroupEnd", unsafe { group_end() });
                made.and(ended)
            }
        }
    }

    /// NCCL's data type for `dtype`, with its element size; `None` for types NCCL has not (the
    /// host path reduces them). TF32 and Flex32 are stored as f32.
    pub fn data_type(&self, dtype: ElemType) -> Option<(c_int, usize)> {
        Some(match dtype {
            ElemType::Int(IntKind::I8) => (0, 1),
            ElemType::UInt(UIntKind::U8) => (1, 1),
            ElemType::Int(IntKind::I32) => (2, 4),
            ElemType::UInt(UIntKind::U32) => (3, 4),
            ElemType::Int(IntKind::I64) => (4, 8),
            ElemType::UInt(UIntKind::U64) => (5, 8),
            ElemType::Float(FloatKind::F16) => (6, 2),
            ElemType::Float(FloatKind::F32 | FloatKind::TF32 | FloatKind::Flex32) => (7, 4),
            ElemType::Float(FloatKind::F64) => (8, 8),
            ElemType::Float(FloatKind::BF16) if self.version >= AVG_AND_BF16 => (9, 2),
            ElemType::Float(FloatKind::E4M3) if self.version >= FLOAT8 => (10, 1),
            ElemType::Float(FloatKind::E5M2) if self.version >= FLOAT8 => (11, 1),
            _ => return None,
        })
    }

    /// NCCL's operation for `op`; `None` for a mean before NCCL 2.10 (no `ncclAvg`: the host
    /// path reduces it).
    pub fn operation(&self, op: &ReduceOperation) -> Option<c_int> {
        match op {
            ReduceOperation::Sum => Some(NCCL_SUM),
            ReduceOperation::Mean if self.version >= AVG_AND_BF16 => Some(NCCL_AVG),
            ReduceOperation::Mean => None,
        }
    }
}

/// A communicator handle; used by one thread at a time (behind its group's lock per rank).
struct Comm(RawComm);

// SAFETY: an NCCL communicator may be used from any thread, one at a time (the mutex).
unsafe impl Send for Comm {}

/// The communicators of one group, by rank, and whether the group broke.
pub struct Group {
    nccl: &'static Nccl,
    comms: Vec<Mutex<Option<Comm>>>,
    broken: Mutex<Option<String>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("ranks", &self.comms.len())
            .field("broken", &*self.broken.lock())
            .finish()
    }
}

/// Every group of the process, made at its first all-reduce.
static GROUPS: LazyLock<Mutex<HashMap<Vec<DeviceId>, Arc<Group>>>> =
    LazyLock::new(Default::default);

/// One all-reduce as NCCL takes it.
pub struct Reduce {
    pub src: u64,
    pub dst: u64,
    pub count: usize,
    pub data_type: c_int,
    pub op: c_int,
    pub stream: *mut c_void,
}

impl Group {
    /// The group of `devices` (sorted), its communicators made now by this call if no member
    /// made them before. A failure to make them breaks the group for every member.
    /// `bind(ordinal)` makes that device's primary context current on the calling thread.
    pub fn join(
        nccl: &'static Nccl,
        devices: &[DeviceId],
        bind: &dyn Fn(usize) -> Result<(), String>,
    ) -> Arc<Group> {
        let mut groups = GROUPS.lock();
        if let Some(group) = groups.get(devices) {
            return group.clone();
        }
        let ordinals: Vec<c_int> = devices.iter().map(|id| c_int::from(id.index_id)).collect();
        let mut raw: Vec<RawComm> = vec![std::ptr::null_mut(); devices.len()];
        let mut made = nccl.make_clique(&mut raw, &ordinals, bind);
        if made.is_err() && release_cached(&ordinals) > 0 {
            // NCCL allocates its buffers with the driver, beside the members' engines: with
            // their cached segments given back, once more.
            raw.fill(std::ptr::null_mut());
            made = nccl.make_clique(&mut raw, &ordinals, bind);
        }
        let broken = made
            .err()
            .map(|err| format!("{err} for devices {ordinals:?}"));
        let comms = raw
            .into_iter()
            .map(|comm| Mutex::new((broken.is_none() && !comm.is_null()).then_some(Comm(comm))))
            .collect();
        let group = Arc::new(Group {
            nccl,
            comms,
            broken: Mutex::new(broken),
        });
        groups.insert(devices.to_vec(), group.clone());
        group
    }

    /// Breaks the group of `devices` (sorted) for `reason`: a member failed before its
    /// all-reduce, and the others must not wait for it. If no member made the group's
    /// communicators yet, the group is recorded broken without any, so that no member makes
    /// them; else every communicator not in use is aborted, which ends a collective already
    /// queued on another member's stream.
    pub fn abandon(nccl: &'static Nccl, devices: &[DeviceId], reason: &str) {
        let group = GROUPS
            .lock()
            .entry(devices.to_vec())
            .or_insert_with(|| {
                Arc::new(Group {
                    nccl,
                    comms: devices.iter().map(|_| Mutex::new(None)).collect(),
                    broken: Mutex::new(None),
                })
            })
            .clone();
        group.break_with(format!("a member failed before its all-reduce: {reason}"));
    }

    /// Why the group broke, if it did.
    pub fn broken(&self) -> Option<String> {
        self.broken.lock().clone()
    }

    /// Issues the all-reduce on rank `rank`'s communicator, after polling its asynchronous
    /// error. Any error breaks the group (see the module docs) and is returned.
    pub fn all_reduce(&self, rank: usize, reduce: &Reduce) -> Result<(), String> {
        if let Some(reason) = self.broken() {
            return Err(broken(&reason));
        }
        let issued = {
            let guard = self.comms[rank].lock();
            let Some(comm) = guard.as_ref() else {
                return Err(broken("this device's communicator was aborted"));
            };
            self.async_error(comm).and_then(|()| {
                // SAFETY: device pointers of live blocks of `count` elements each (the server
                // checked the sizes); a live communicator; the caller's live stream.
                let code = unsafe {
                    (self.nccl.all_reduce)(
                        reduce.src as *const c_void,
                        reduce.dst as *mut c_void,
                        reduce.count,
                        reduce.data_type,
                        reduce.op,
                        comm.0,
                        reduce.stream,
                    )
                };
                self.nccl.check("ncclAllReduce", code)
            })
        };
        issued.inspect_err(|err| self.break_with(err.clone()))?;
        // Broken while this call held the communicator (`break_with` could not take it): the
        // collective just queued would wait for a member that will not call. Abort it here.
        self.abort_if_broken(rank)
    }

    /// The group's break, as this member's error, without calling NCCL: what a wait that
    /// ended asks (a collective cancelled by an abort ends like one that ran).
    pub fn check(&self) -> Result<(), String> {
        match self.broken() {
            Some(reason) => Err(broken(&reason)),
            None => Ok(()),
        }
    }

    /// If the group broke: aborts rank `rank`'s communicator if it is still here (in use when
    /// the group broke) and returns the break as an error.
    fn abort_if_broken(&self, rank: usize) -> Result<(), String> {
        let Some(reason) = self.broken() else {
            return Ok(());
        };
        if let Some(comm) = self.comms[rank].lock().take() {
            // SAFETY: a live communicator, taken out so nothing uses it again.
            unsafe { (self.nccl.comm_abort)(comm.0) };
        }
        Err(broken(&reason))
    }

    /// Rank `rank`'s asynchronous error, if it has one: breaks the group then.
    pub fn poll(&self, rank: usize) -> Result<(), String> {
        self.abort_if_broken(rank)?;
        let polled = match self.comms[rank].lock().as_ref() {
            Some(comm) => self.async_error(comm),
            None => Ok(()),
        };
        polled.inspect_err(|err| self.break_with(err.clone()))
    }

    fn async_error(&self, comm: &Comm) -> Result<(), String> {
        let mut state = NCCL_SUCCESS;
        // SAFETY: a live communicator; `state` is valid for the write.
        let code = unsafe { (self.nccl.comm_get_async_error)(comm.0, &mut state) };
        self.nccl.check("ncclCommGetAsyncError", code)?;
        match state {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            state => Err(self.nccl.error("an earlier collective", state)),
        }
    }

    /// Marks the group broken and aborts every communicator not in use within a moment (one
    /// in use is aborted by its member when it sees the mark).
    fn break_with(&self, reason: String) {
        log::error!("caching allocator: NCCL group broken, every member stops using it: {reason}");
        self.mark_broken(reason);
    }

    /// As [`Group::break_with`], without the error log (a member leaving on purpose).
    fn mark_broken(&self, reason: String) {
        self.broken.lock().get_or_insert(reason);
        for slot in &self.comms {
            if let Some(mut guard) = slot.try_lock_for(Duration::from_millis(100))
                && let Some(comm) = guard.take()
            {
                // SAFETY: a live communicator, taken out so nothing uses it again.
                unsafe { (self.nccl.comm_abort)(comm.0) };
            }
        }
    }

    /// Rank `rank`'s server is dropping: its communicator is aborted, never destroyed, and the
    /// group breaks. `ncclCommDestroy` waits for the rank's queued collectives, which wait for
    /// every member: a member that never calls would hang the drop. A group without this
    /// member can run no collective again, so the others get the break as an error instead of
    /// waiting for it (their communicators are aborted too).
    pub fn release(&self, rank: usize) {
        if self.broken().is_none() {
            log::debug!("caching allocator: NCCL group member {rank} dropped, the group ends");
        }
        self.mark_broken(format!("the server of member {rank} was dropped"));
        if let Some(comm) = self.comms[rank].lock().take() {
            // SAFETY: a live communicator, taken out so nothing uses it again.
            let code = unsafe { (self.nccl.comm_abort)(comm.0) };
            if let Err(err) = self.nccl.check("ncclCommAbort", code) {
                log::warn!("caching allocator: {err}");
            }
        }
    }
}

/// Empties the cache of every member's engine (the CUDA servers register theirs by ordinal),
/// so that NCCL's own buffers find room; the bytes given back to the driver.
fn release_cached(ordinals: &[c_int]) -> u64 {
    let name = <super::CudaDriver as crate::runtime::Driver>::NAME;
    ordinals
        .iter()
        .filter_map(|&ordinal| {
            let key = DeviceKey::new(name, u32::try_from(ordinal).ok()?);
            registry::engine(key)?.empty_cache().ok()
        })
        .sum()
}

fn broken(reason: &str) -> String {
    format!(
        "NCCL: this device's group can no longer be used ({reason}); every member of it gets \
         this error, and all-reduces over these devices fail through NCCL for the rest of the \
         process. To go on, reduce through host memory (`set_communication(Communication::Host)` \
         or {}=host), or restart the process to use NCCL again",
        crate::runtime::COMM_ENV
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_value_naming_every_name_tried() {
        let missing = Nccl::load(&["libnccl-does-not-exist.so.2", "libnccl-nor-this.so"])
            .expect_err("no such library");
        let text = missing.to_string();
        assert_eq!(missing.tried.len(), 2);
        assert!(text.contains("libnccl-does-not-exist.so.2"), "{text}");
        assert!(text.contains("libnccl-nor-this.so"), "{text}");
        // The real names, in NCCL's order: the SONAME first.
        assert_eq!(NCCL_NAMES, ["libnccl.so.2", "libnccl.so"]);
    }

    /// `BURN_CACHING_ALLOC_NCCL` comes first, NCCL's names next, then pip's copies under each
    /// prefix (`nvidia-nccl-cu*`, which the loader never finds on its own).
    #[test]
    fn an_explicit_path_then_nccls_names_then_pips_copies_are_tried() {
        let root = std::env::temp_dir().join(format!("nccl-candidates-{}", std::process::id()));
        let lib = root.join("lib/python3.11/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).expect("dirs");
        std::fs::write(lib.join("libnccl.so.2"), b"").expect("file");
        let names = candidates(
            Some("/opt/nccl/libnccl.so.2".into()),
            std::slice::from_ref(&root),
        );
        assert_eq!(
            names,
            [
                "/opt/nccl/libnccl.so.2".to_string(),
                "libnccl.so.2".to_string(),
                "libnccl.so".to_string(),
                lib.join("libnccl.so.2").to_string_lossy().into_owned(),
            ]
        );
        assert_eq!(candidates(None, &[]), NCCL_NAMES.map(String::from));
        let _ = std::fs::remove_dir_all(&root);
    }
}
