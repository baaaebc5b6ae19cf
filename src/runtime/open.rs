//! Opening a device on the caller's thread, so that the reason a device cannot open reaches
//! the caller.
//!
//! CubeCL opens a device lazily, on the device's own thread (`DeviceService::init`), through a
//! call that cannot fail: a server that cannot open (a configuration that does not parse,
//! expandable segments on a device without virtual memory, a device index past the last
//! device) could only panic there, and the caller saw a closed channel (`RecvError`) with the
//! reason on stderr. Every way into a caching device (`Runtime::client`, which Burn calls for
//! each operation, and the `backend` API) goes through [`ensure_open`] first: the first call
//! builds the server on the calling thread and hands it to CubeCL's device thread
//! (`DeviceHandle::insert`); a failure is kept, and every later call returns the same error.

use std::any::TypeId;
use std::cell::RefCell;
use std::collections::HashSet;

use cubecl_common::device::DeviceId;
use cubecl_common::device_handle::DeviceHandle;
use parking_lot::Mutex;

use super::driver::Driver;
use super::error::DriverError;
use super::registry::{self, OpenState};
use super::server::CachingServer;

/// Opens `device` for driver `D` if no server did yet, on this thread; the error is why it
/// cannot open (the same error on every later call). Once the device is open, each thread pays
/// one registry lookup and then only a look in its own set: Burn reaches here on every
/// operation (`Runtime::client`).
pub(crate) fn ensure_open<D: Driver>(device: DeviceId) -> Result<(), DriverError> {
    std::thread_local! {
        /// The devices this thread saw open (a device never closes once open).
        static SEEN_OPEN: RefCell<HashSet<(TypeId, DeviceId)>> = RefCell::new(HashSet::new());
    }
    let key = (TypeId::of::<D::Memory>(), device);
    if SEEN_OPEN.with_borrow(|seen| seen.contains(&key)) {
        return Ok(());
    }
    open::<D>(device)?;
    SEEN_OPEN.with_borrow_mut(|seen| seen.insert(key));
    Ok(())
}

/// [`ensure_open`] without the thread's own set.
fn open<D: Driver>(device: DeviceId) -> Result<(), DriverError> {
    let known = || match registry::open_state::<D::Memory>(device) {
        OpenState::Opened => Some(Ok(())),
        OpenState::Failed(err) => Some(Err(err)),
        OpenState::NotOpened => None,
    };
    if let Some(known) = known() {
        return known;
    }
    // One opening at a time: a thread that finds the device not ready waits here until the
    // thread opening it has handed its server to CubeCL (`Opened` is recorded only then), so
    // that no thread reaches CubeCL's device thread first and has it open a second server.
    static OPENING: Mutex<()> = Mutex::new(());
    let _opening = OPENING.lock();
    if let Some(known) = known() {
        return known;
    }
    let server = match CachingServer::<D>::open(device) {
        Ok(server) => server,
        Err(err) => {
            registry::record_failure::<D::Memory>(device, err.clone());
            return Err(err);
        }
    };
    if let Err(err) = DeviceHandle::insert(device, server) {
        // CubeCL's device thread already holds a server for the device (it was opened without
        // this function, by `DeviceHandle::new`): the one just built is dropped, and that one
        // serves.
        log::warn!("caching allocator: {device} was already open on its device thread: {err:?}");
    }
    registry::mark_serving::<D::Memory>(device);
    Ok(())
}
