//! Issue 20 point 6, bad input: a memory fraction the device cannot enforce, or one so small
//! that no block fits under it, is a clear error from `set_memory_fraction`; in the
//! configuration (where the constructor cannot fail) it is logged, and a fraction without a
//! device total is dropped, visibly in `config()`.

use std::sync::{Mutex, Once};

use caching_alloc_engine::alloc::{AllocError, AllocatorConfig, CachingAllocator, ConfigError};
use caching_alloc_engine::device::sim::{SimCall, SimDevice};

use crate::common::*;

/// Warnings and errors logged in this process (the engine test binary has no other logger).
static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            WARNINGS.lock().unwrap().push(record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// Installs the capturing logger (once per process); [`warned`] then searches what it kept.
pub fn capture_warnings() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        log::set_logger(&Capture).expect("no other logger in the engine tests");
        log::set_max_level(log::LevelFilter::Warn);
    });
}

/// Whether a warning or an error containing `about` was logged since the logger was installed.
pub fn warned(about: &str) -> bool {
    WARNINGS.lock().unwrap().iter().any(|w| w.contains(about))
}

#[test]
fn a_fraction_the_device_cannot_measure_is_refused() {
    let (alloc, device) = allocator(1 << 30, "");
    device.fail_next(SimCall::MemoryInfo);
    match alloc.set_memory_fraction(0.5) {
        Err(ConfigError::Unsupported { key, reason }) => {
            assert_eq!(key, "per_process_memory_fraction");
            assert!(
                reason.contains("cannot report its total memory"),
                "{reason}"
            );
        }
        other => panic!("expected unsupported, got {other:?}"),
    }
    assert_eq!(alloc.config().memory_fraction, None, "nothing in force");
    // 1.0 is no limit: it needs no total.
    device.fail_next(SimCall::MemoryInfo);
    alloc.set_memory_fraction(1.0).unwrap();
    assert_eq!(
        device.armed_failures(SimCall::MemoryInfo),
        1,
        "1.0 did not ask"
    );
    // Once the device reports it, the same call succeeds.
    let (alloc, _device) = allocator(1 << 30, "");
    alloc.set_memory_fraction(0.5).unwrap();
    assert_eq!(alloc.config().memory_fraction, Some(0.5));
}

#[test]
fn a_fraction_whose_limit_holds_no_block_is_refused() {
    let (alloc, _device) = allocator(1 << 30, "per_process_memory_fraction:0.5");
    let err = alloc.set_memory_fraction(1e-9).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid value `0.000000001` for allocator config key `per_process_memory_fraction`: \
         expected a fraction that allows at least one 512-byte block of the device's \
         1073741824 bytes (it allows 1 bytes)"
    );
    assert_eq!(
        alloc.config().memory_fraction,
        Some(0.5),
        "the old one stays"
    );
    // Exactly one block's worth is allowed.
    alloc
        .set_memory_fraction(512.0 / (1u64 << 30) as f64)
        .unwrap();
}

#[test]
fn a_configured_fraction_that_cannot_be_enforced_is_dropped_with_a_warning() {
    capture_warnings();
    let device = SimDevice::new(1 << 30);
    device.fail_next(SimCall::MemoryInfo);
    let config = AllocatorConfig::parse("per_process_memory_fraction:0.25").unwrap();
    let alloc = CachingAllocator::new(device.clone(), config).unwrap();
    assert_eq!(alloc.config().memory_fraction, None);
    assert!(warned("(0.25) cannot be enforced"), "{:?}", WARNINGS.lock());
    // Without the fraction, 512 MiB fits the 1 GiB device.
    let a = alloc.malloc(512 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
}

#[test]
fn a_configured_fraction_that_holds_no_block_is_kept_with_a_warning_and_every_request_fails() {
    capture_warnings();
    let (alloc, _device) = allocator(1 << 30, "per_process_memory_fraction:0.0000000003");
    assert!(
        warned("it allows 0 bytes"),
        "{:?}",
        WARNINGS.lock().unwrap()
    );
    match alloc.malloc(1, S0) {
        Err(AllocError::OutOfMemory { limit, .. }) => assert_eq!(limit, Some(0)),
        other => panic!("expected an out-of-memory naming the limit, got {other:?}"),
    }
}
