//! Which path moves tensors between devices and reduces across them: the device's own (CUDA
//! peer copies and NCCL) or host memory.
//!
//! Chosen by `BURN_CACHING_ALLOC_COMM=auto|nccl|host`, or in code with
//! [`set_communication`] (which takes precedence). Process-wide, because every member of a
//! group must take the same path. Read by `send` at each transfer (the path travels with what
//! `send` posts, so its `recv` ends it the same way whatever the setting is by then) and by
//! each member at each collective: change it only between steps, never while an all-reduce is
//! in flight (members that read different paths wait for each other on different paths).
//!
//! - `auto` (the default): peer copies for `to_device`; NCCL for `all_reduce` when `libnccl`
//!   loads, else the host path with one warning;
//! - `nccl`: as `auto`, but an all-reduce without `libnccl` is an error on the stream;
//! - `host`: everything through host memory (what wgpu always does).

use std::sync::atomic::{AtomicU8, Ordering};

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
/// `BURN_CACHING_ALLOC_COMM`. Takes effect at the next transfer (a transfer already sent ends on
/// the path it was sent on) or collective: call it between steps, when no all-reduce is in
/// flight.
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

#[cfg(test)]
mod tests {
    use super::*;

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
