//! Which path moves tensors between devices and reduces across them: the device's own (CUDA
//! peer copies and NCCL) or host memory.
//!
//! Chosen by `BURN_CACHING_ALLOC_COMM=auto|nccl|host`, or in code with
//! [`set_communication`] (which takes precedence). Process-wide, because every member of a
//! group must take the same path. Read once per transfer, by `send` (the path travels with
//! what `send` posts, so its `recv` ends it the same way whatever the setting is by then), and
//! once per all-reduce, by the first member to reach it (the others take what it read), so a
//! change takes effect at the next transfer or all-reduce and never splits one in flight.
//!
//! - `auto` (the default): peer copies for `to_device`; NCCL for `all_reduce` when `libnccl`
//!   loads, else the host path with one warning;
//! - `nccl`: as `auto`, but an all-reduce without `libnccl` is an error on the stream;
//! - `host`: everything through host memory (what wgpu always does).

use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};

use cubecl_common::device::DeviceId;
use parking_lot::Mutex;

/// The variable that chooses the communication path.
pub const COMM_ENV: &str = "BURN_CACHING_ALLOC_COMM";

/// How devices of one API exchange tensors (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Communication {
    /// The device's own path where there is one (NCCL when it loads), else the host path.
    #[default]
    Auto,
    /// The device's own path; a collective without NCCL is an error, never the host path.
    Nccl,
    /// Host memory for every transfer and collective.
    Host,
}

impl Communication {
    /// Parses the variable's value (`auto`, `nccl` or `host`, any case, surrounding blanks
    /// ignored).
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Self::Auto),
            "nccl" => Ok(Self::Nccl),
            "host" => Ok(Self::Host),
            other => Err(format!(
                "{COMM_ENV}={other:?} is not a communication path: use auto, nccl or host"
            )),
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::Auto => 1,
            Self::Nccl => 2,
            Self::Host => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Auto),
            2 => Some(Self::Nccl),
            3 => Some(Self::Host),
            _ => None,
        }
    }
}

/// What [`set_communication`] chose; 0 when it was never called.
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// Chooses the communication path for every device of the process, over
/// `BURN_CACHING_ALLOC_COMM`. Takes effect at the next transfer or all-reduce: one already
/// under way (sent, or reached by a member) ends on the path it started on.
pub fn set_communication(path: Communication) {
    CHOSEN.store(path.code(), Ordering::Relaxed);
}

/// The path in force: the one set in code, else `BURN_CACHING_ALLOC_COMM`, else `auto`. A
/// value of the variable that is not a path is an error (the caller returns it on the stream).
pub fn communication() -> Result<Communication, String> {
    if let Some(path) = Communication::from_code(CHOSEN.load(Ordering::Relaxed)) {
        return Ok(path);
    }
    match std::env::var(COMM_ENV) {
        Ok(value) => Communication::parse(&value),
        Err(std::env::VarError::NotPresent) => Ok(Communication::Auto),
        Err(std::env::VarError::NotUnicode(value)) => Err(format!(
            "{COMM_ENV}={value:?} is not a communication path: use auto, nccl or host"
        )),
    }
}

/// The path of one all-reduce, as its first member read it, until every member took it.
struct Agreement {
    path: Result<Communication, String>,
    taken: Vec<DeviceId>,
}

/// One all-reduce: its group (sorted) and its call number in that group.
type CallKey = (Vec<DeviceId>, u64);

/// All-reduces some member reached and not every member has.
static AGREED: LazyLock<Mutex<HashMap<CallKey, Agreement>>> = LazyLock::new(Default::default);

/// The path of the `call`-th all-reduce of `group` (sorted), for member `me`: the setting as the
/// first member to reach that all-reduce read it ([`communication`]), so that every member
/// takes the same path even when the setting changes while some are already in it (a member
/// on NCCL and another on the host path would wait for each other forever). Each member asks
/// once per call; the entry goes when the last has.
pub(crate) fn agreed(group: &[DeviceId], call: u64, me: DeviceId) -> Result<Communication, String> {
    let mut agreed = AGREED.lock();
    let key = (group.to_vec(), call);
    let entry = agreed.entry(key.clone()).or_insert_with(|| Agreement {
        path: communication(),
        taken: Vec::with_capacity(group.len()),
    });
    if !entry.taken.contains(&me) {
        entry.taken.push(me);
    }
    let path = entry.path.clone();
    if entry.taken.len() >= group.len() {
        agreed.remove(&key);
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_of_an_all_reduce_takes_the_path_the_first_one_read() {
        let ids: Vec<DeviceId> = (0..3)
            .map(|index_id| DeviceId {
                type_id: 9,
                index_id,
            })
            .collect();
        // A group of its own (type 9), so that no other test's all-reduce shares its entries.
        set_communication(Communication::Nccl);
        assert_eq!(agreed(&ids, 1, ids[1]), Ok(Communication::Nccl));
        set_communication(Communication::Host);
        // The other members of call 1 take NCCL still; call 2 reads the new setting.
        assert_eq!(agreed(&ids, 1, ids[0]), Ok(Communication::Nccl));
        assert_eq!(agreed(&ids, 2, ids[0]), Ok(Communication::Host));
        assert_eq!(agreed(&ids, 1, ids[2]), Ok(Communication::Nccl));
        // Every member took call 1: gone, and a late duplicate reads afresh.
        assert!(!AGREED.lock().contains_key(&(ids.clone(), 1)));
        set_communication(Communication::Auto);
        for me in &ids[1..] {
            assert_eq!(agreed(&ids, 2, *me), Ok(Communication::Host));
        }
        assert!(!AGREED.lock().contains_key(&(ids.clone(), 2)));
    }

    #[test]
    fn the_variable_names_one_of_three_paths() {
        assert_eq!(Communication::parse("auto"), Ok(Communication::Auto));
        assert_eq!(Communication::parse(" NCCL "), Ok(Communication::Nccl));
        assert_eq!(Communication::parse("host"), Ok(Communication::Host));
        assert_eq!(Communication::parse(""), Ok(Communication::Auto));
        let err = Communication::parse("gloo").expect_err("not a path");
        assert!(
            err.contains(COMM_ENV) && err.contains("auto, nccl or host"),
            "{err}"
        );
        for path in [
            Communication::Auto,
            Communication::Nccl,
            Communication::Host,
        ] {
            assert_eq!(Communication::from_code(path.code()), Some(path));
        }
        assert_eq!(Communication::from_code(0), None);
    }
}
