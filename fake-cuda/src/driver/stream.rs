//! Streams: create, destroy, synchronize, query and wait for an event.

use std::ffi::{c_int, c_uint, c_void};

use super::{Guard, check_out, copy_stream, out};
use crate::codes::*;
use crate::state::{STREAM_BASE, call};
use crate::streams::{Clock, Op, Stream, Target, drive};

fn stream_create(name: &'static str, ptr: *mut *mut c_void) -> u32 {
    call(name, |fake| {
        let d = tri!(fake.context(name));
        tri!(check_out(fake, name, ptr));
        let handle = fake.next_handle(STREAM_BASE);
        fake.streams.insert(handle, Stream::new(d, false));
        unsafe { out(ptr, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ptr: *mut *mut c_void, _flags: c_uint) -> u32 {
    stream_create("cuStreamCreate", ptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ptr: *mut *mut c_void,
    _flags: c_uint,
    _priority: c_int,
) -> u32 {
    stream_create("cuStreamCreateWithPriority", ptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> u32 {
    call("cuStreamDestroy_v2", |fake| {
        let d = tri!(fake.context("cuStreamDestroy_v2"));
        if (stream as u64) <= 2 {
            return fake.reject(
                "cuStreamDestroy_v2",
                INVALID_HANDLE,
                "the default stream cannot be destroyed",
            );
        }
        let handle = tri!(fake.stream("cuStreamDestroy_v2", stream as u64, d));
        // Queued work still completes (the real driver lets it).
        fake.streams.get_mut(&handle).expect("checked").alive = false;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> u32 {
    call("cuStreamSynchronize", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamSynchronize", stream));
        let seq = fake.streams[&handle].enqueued;
        let known = fake.stream_clock(handle);
        drive(fake, "cuStreamSynchronize", vec![(handle, seq)], known)
    })
}

/// A query: done now, or NOT_READY; the scheduler decides how much runs on the way, and a
/// query that answers NOT_READY makes sure the next one finds the work done (progress).
pub(super) fn query(fake: &mut Guard, _name: &'static str, target: Target, known: Clock) -> u32 {
    if !fake.satisfied(&target) {
        let schedule = fake.schedule;
        match schedule {
            crate::config::Schedule::Eager => fake.run_all_ready(),
            crate::config::Schedule::Random if fake.random().is_multiple_of(2) => {
                fake.run_all_ready()
            }
            _ => {}
        }
    }
    if fake.satisfied(&target) {
        fake.host_clock.join(&known);
        let error = fake.target_error(&target);
        return if error != 0 { error } else { SUCCESS };
    }
    // Not done: let the work needed run now without blocking, so that polling ends.
    fake.progress_without_waiting(&target);
    NOT_READY
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> u32 {
    call("cuStreamQuery", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamQuery", stream));
        let seq = fake.streams[&handle].enqueued;
        let known = fake.stream_clock(handle);
        query(fake, "cuStreamQuery", vec![(handle, seq)], known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> u32 {
    call("cuStreamWaitEvent", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamWaitEvent", stream));
        let event = tri!(fake.event("cuStreamWaitEvent", event as u64));
        if flags != 0 {
            return fake.reject(
                "cuStreamWaitEvent",
                INVALID_VALUE,
                "flags must be 0 (CU_EVENT_WAIT_DEFAULT)",
            );
        }
        let Some((other, seq, clock)) = fake.events[&event].recorded.clone() else {
            // Never recorded: nothing to wait for.
            return SUCCESS;
        };
        fake.streams
            .get_mut(&handle)
            .expect("checked")
            .clock
            .join(&clock);
        fake.enqueue(
            "cuStreamWaitEvent",
            handle,
            Op::Wait { stream: other, seq },
            Vec::new(),
        );
        SUCCESS
    })
}
