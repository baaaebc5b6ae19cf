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

use cubecl_common::device::DeviceId;
use cubecl_common::device_handle::DeviceHandle;
use parking_lot::Mutex;

use super::driver::Driver;
use super::error::DriverError;
use super::registry::{self, OpenState};
use super::server::CachingServer;

/// Opens `device` for driver `D` if no server did yet, on this thread; the error is why it
/// cannot open (the same error on every later call). Cheap once the device is open: one
/// registry lookup.
pub(crate) fn ensure_open<D: Driver>(device: DeviceId) -> Result<(), DriverError> {
    match registry::open_state::<D::Memory>(device) {
        OpenState::Opened => return Ok(()),
        OpenState::Failed(err) => return Err(err),
        OpenState::NotOpened => {}
    }
    // One opening at a time: two threads that both saw the device closed must not both build
    // a server (the second would register a second allocator for the device).
    static OPENING: Mutex<()> = Mutex::new(());
    let _opening = OPENING.lock();
    match registry::open_state::<D::Memory>(device) {
        OpenState::Opened => return Ok(()),
        OpenState::Failed(err) => return Err(err),
        OpenState::NotOpened => {}
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
    Ok(())
}
