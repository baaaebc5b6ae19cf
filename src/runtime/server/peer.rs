//! Communication on the device, where the driver has it: `to_device` by a device-to-device
//! copy ([`Driver::export`] / [`Driver::import`], CUDA's peer copies) and `all_reduce` by the
//! driver's collective ([`Driver::all_reduce`], NCCL). `comm` calls in here first and keeps its
//! host path for what the driver does not take.
//!
//! A transfer, as CubeCL's `to_client_tensor` queues it (`send` on the source's thread, `recv`
//! on the destination's):
//! - `send` orders its stream after the source's producer, reserves a staging block of the
//!   transfer's size through the source's caching allocator (it is in that device's
//!   statistics; out of memory there is the allocator's error, returned on the destination's
//!   stream), has the driver copy the source into it on the stream and record an event after
//!   that copy, and posts the staging block with the event. It never waits for its peer or the
//!   device. The staging copy is what lets later work on the source's stream write the source
//!   in place (CubeCL's bindings do not keep Burn from mutating a tensor whose handle it holds
//!   alone) without racing the peer's read; it costs one copy at the device's own bandwidth.
//! - `recv` takes the posting (waiting until the `send` has run, not for the device), reserves
//!   the destination through the destination's allocator, and has the driver make its stream
//!   wait for the source's event, copy, and record a completion event, which it shares with
//!   the source's server.
//! - The source's server holds the staging block until that completion event has completed
//!   (PyTorch's `record_stream` rule across devices, see `ordering`), also through
//!   `empty_cache` and the out-of-memory path. A `recv` that fails before its copy (out of
//!   memory on the destination) releases it at once.
//!
//! An all-reduce on the device orders the stream after the producers of its source and
//! destination, and holds those of other streams until an event after the collective; the
//! collective itself is the driver's, on the calling stream.

use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::device::DeviceId;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::ElemType;
use cubecl_runtime::server::{Binding, CopyDescriptor, Handle, ReduceOperation, ServerError};
use parking_lot::Mutex;

use super::super::comm_path::Communication;
use super::super::driver::{Collective, DeviceReduce, Driver};
use super::CachingServer;
use super::checks;
use super::ordering::{PeerCopy, PeerCopyState, note_rewrites};
use super::post::{OFFICE, Posting, Route};

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

/// What the host path of an all-reduce has left to do after the device path.
pub(super) enum OnDevice {
    /// Nothing: issued on the device, or failed there with the error on the stream (every
    /// other member gets an error too).
    Done,
    /// The whole all-reduce.
    Host,
    /// This member failed before its part: the error is its contribution to the round.
    HostFailed(ServerError),
}

/// What `send` posts for the device path: the staging block as the peer copies it, and the
/// state both servers share.
pub(super) struct Parcel<D: Driver> {
    buffer: D::PeerBuffer,
    copy: PeerCopyState<D::Event>,
}

impl<D: Driver> CachingServer<D> {
    /// Whether a transfer of `len` bytes goes device to device. Asked by `send` only: the
    /// posting carries the answer to `recv` (`post`).
    pub(super) fn peer_path(&self, len: u64) -> bool {
        len > 0 && self.driver.peer_copies()
    }

    /// `send` by a device copy (see the module docs). Never fails: an error is posted for the
    /// peer, whose `recv` returns it on its stream.
    pub(super) fn send_to_peer(
        &mut self,
        desc: CopyDescriptor,
        stream_id: StreamId,
        dst: DeviceId,
    ) {
        let route = Route {
            src: self.device,
            dst,
            stream: stream_id.value,
        };
        let parcel = self.export(desc, stream_id);
        OFFICE.post::<D>(route, Posting::Device(parcel));
    }

    fn export(
        &mut self,
        desc: CopyDescriptor,
        stream_id: StreamId,
    ) -> Result<Parcel<D>, ServerError> {
        checks::contiguous(&desc.shape, &desc.strides)?;
        let len = checks::tensor_bytes(&desc.shape, desc.elem_size)?;
        let (src, used, foreign) = self.resolve_use(desc.handle, stream_id)?;
        if len as u64 > src.size {
            return Err(generic(format!(
                "caching allocator: sending {len} bytes from a buffer of {} bytes",
                src.size
            )));
        }
        self.order_after(stream_id, &[used])?;
        let staging = Handle::new(stream_id, len as u64);
        self.reserve_bound(staging.memory.clone(), len as u64, stream_id)?;
        let staging_resource = self.resolve(staging.clone().binding())?;
        self.advance(stream_id);
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: `src` and `staging_resource` were resolved from live handles (the source's
        // binding, and the staging block reserved above, which the posting holds until the
        // peer's copy completed); `len` fits both (checked above, and the staging's size).
        let exported = unsafe { driver.export(driver_stream, &src, &staging_resource, len) };
        // Another stream's source is held until the staging copy is done.
        self.hold_until_done(stream_id, foreign.into_iter().collect())?;
        let buffer = exported?;
        let copy = Arc::new(Mutex::new(PeerCopy::Pending));
        self.uses.hold_for_peer(copy.clone(), staging);
        Ok(Parcel { buffer, copy })
    }

    /// The end of a `recv` whose `send` took the device path (see the module docs): the copy
    /// from the posted staging block, into `handle` reserved here.
    pub(super) fn import(
        &mut self,
        handle: Handle,
        parcel: Result<Parcel<D>, ServerError>,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        let parcel = parcel?;
        let copied = (|| {
            self.reserve_bound(handle.memory.clone(), handle.size(), stream_id)?;
            let dst = self.resolve(handle.binding())?;
            self.advance(stream_id);
            let (driver, driver_stream) = self.split(stream_id);
            // SAFETY: `dst` was resolved from the handle just reserved and bound; the parcel's
            // buffer is the peer's staging block, held until this copy's event completes.
            unsafe { driver.import(driver_stream, &dst, &parcel.buffer) }
        })();
        let mut copy = parcel.copy.lock();
        match copied {
            Ok(event) => {
                *copy = PeerCopy::Issued(event);
                Ok(())
            }
            Err(err) => {
                // Nothing reads the staging block: the source may reuse it at once.
                *copy = PeerCopy::NotIssued;
                Err(err)
            }
        }
    }

    /// `all_reduce` on the device if the driver takes it, else what the host path has to do.
    ///
    /// A failure of this member before or at its collective (a destination too small, a
    /// failed launch) must not leave the other members waiting for it: the driver is told
    /// ([`Driver::abandon_all_reduce`]; NCCL's group is broken and its queued collectives
    /// cancelled), and where the group takes the host path the failure is this member's
    /// contribution to the host round ([`OnDevice::HostFailed`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_reduce_on_device(
        &mut self,
        src: &Binding,
        dst: &Binding,
        dtype: ElemType,
        stream_id: StreamId,
        op: &ReduceOperation,
        group: &[DeviceId],
        path: &Result<Communication, String>,
    ) -> OnDevice {
        match self.try_all_reduce_on_device(src, dst, dtype, stream_id, op, group, path) {
            Ok(DeviceReduce::Issued) => OnDevice::Done,
            Ok(DeviceReduce::Host) => OnDevice::Host,
            Err(err) => match self.driver.abandon_all_reduce(group, dtype, op, path, &err) {
                DeviceReduce::Host => OnDevice::HostFailed(err),
                DeviceReduce::Issued => {
                    self.push_error(stream_id, err);
                    OnDevice::Done
                }
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn try_all_reduce_on_device(
        &mut self,
        src: &Binding,
        dst: &Binding,
        dtype: ElemType,
        stream_id: StreamId,
        op: &ReduceOperation,
        group: &[DeviceId],
        path: &Result<Communication, String>,
    ) -> Result<DeviceReduce, ServerError> {
        let len = src.size_in_used() as usize;
        if len == 0 {
            return Ok(DeviceReduce::Host);
        }
        if dst.size_in_used() < len as u64 {
            return Err(generic(format!(
                "caching allocator: all_reduce of {len} bytes into a buffer of {} bytes",
                dst.size_in_used()
            )));
        }
        let rank = group
            .iter()
            .position(|id| *id == self.device)
            .ok_or_else(|| generic(format!("{} is not in {group:?}", self.device)))?;
        let (src_resource, src_use, src_foreign) = self.resolve_use(src.clone(), stream_id)?;
        let (dst_resource, dst_use, dst_foreign) = self.resolve_use(dst.clone(), stream_id)?;
        self.order_after(stream_id, &[src_use, dst_use])?;
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: both resources were resolved from live handles just above; `len` fits `dst`
        // (checked) and `src` (its binding's size); both are held until an event after the
        // collective (below).
        let reduced = unsafe {
            driver.all_reduce(
                driver_stream,
                Collective {
                    src: &src_resource,
                    dst: &dst_resource,
                    len,
                    dtype,
                    op,
                    group,
                    rank,
                    path,
                },
            )
        }?;
        if reduced == DeviceReduce::Issued {
            note_rewrites(&mut self.streams, stream_id, &[dst_use]);
            self.advance(stream_id);
            let foreign = src_foreign.into_iter().chain(dst_foreign).collect();
            self.hold_until_done(stream_id, foreign)?;
        }
        Ok(reduced)
    }
}
