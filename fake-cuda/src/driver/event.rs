//! Events: create, record, query, synchronize and destroy.

use std::ffi::{c_uint, c_void};

use super::stream::query;
use super::{check_out, copy_stream, out};
use crate::codes::*;
use crate::state::{EVENT_BASE, Fake, call};
use crate::streams::{Clock, Event, Target, drive};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(ptr: *mut *mut c_void, _flags: c_uint) -> u32 {
    call("cuEventCreate", |fake| {
        let d = tri!(fake.context("cuEventCreate"));
        tri!(check_out(fake, "cuEventCreate", ptr));
        let handle = fake.next_handle(EVENT_BASE);
        fake.events.insert(
            handle,
            Event {
                device: d,
                alive: true,
                recorded: None,
            },
        );
        unsafe { out(ptr, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> u32 {
    call("cuEventRecord", |fake| {
        let (handle, device) = tri!(copy_stream(fake, "cuEventRecord", stream));
        let event = tri!(fake.event("cuEventRecord", event as u64));
        if fake.events[&event].device != device {
            let other = fake.events[&event].device;
            return fake.reject(
                "cuEventRecord",
                INVALID_HANDLE,
                format!("an event of device {other} recorded on a stream of device {device}"),
            );
        }
        let s = &fake.streams[&handle];
        let recorded = (handle, s.enqueued, s.clock.clone());
        fake.events.get_mut(&event).expect("checked").recorded = Some(recorded);
        SUCCESS
    })
}

fn event_target(fake: &Fake, event: u64) -> (Target, Clock) {
    match &fake.events[&event].recorded {
        Some((stream, seq, clock)) => (vec![(*stream, *seq)], clock.clone()),
        None => (Vec::new(), Clock::default()),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: *mut c_void) -> u32 {
    call("cuEventQuery", |fake| {
        let _ = tri!(fake.context("cuEventQuery"));
        let event = tri!(fake.event("cuEventQuery", event as u64));
        let (target, known) = event_target(fake, event);
        query(fake, "cuEventQuery", target, known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut c_void) -> u32 {
    call("cuEventSynchronize", |fake| {
        let _ = tri!(fake.context("cuEventSynchronize"));
        let event = tri!(fake.event("cuEventSynchronize", event as u64));
        let (target, known) = event_target(fake, event);
        drive(fake, "cuEventSynchronize", target, known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> u32 {
    call("cuEventDestroy_v2", |fake| {
        let _ = tri!(fake.context("cuEventDestroy_v2"));
        let event = tri!(fake.event("cuEventDestroy_v2", event as u64));
        fake.events.get_mut(&event).expect("checked").alive = false;
        SUCCESS
    })
}
