//! Kernel scalars and metadata on their way to the device, without a device allocation per
//! launch.
//!
//! CubeCL packs a launch's scalars, static metadata and dynamic metadata (shapes and strides)
//! into one `MetadataBindingInfo`. What the driver receives depends on its
//! [`MetadataLayout`]: all of it to bind itself, all of it in a device buffer, or (CUDA sm_70
//! on, as `cubecl-cuda` does) scalars and static metadata by value as a `__grid_constant__`
//! with only the dynamic part in a device buffer, when there is one.
//!
//! The device buffer is a scratch slice per stream slot, reserved through the stream's CubeCL
//! manager (so through the engine, its cache and its out-of-memory path) the first time and
//! whenever a launch needs more, and rewritten by every launch. Reuse is safe in stream order:
//! the write for launch n+1 is issued after launch n on the same driver stream (the driver's
//! ordering contract), so launch n has read its metadata before it is overwritten. In steady
//! state a launch therefore costs one copy into the scratch and no allocation.

use cubecl_runtime::server::{Handle, ServerError};

use super::super::driver::{Driver, MetadataLayout, Resource};
use super::ordering::PendingUses;
use super::reserve;
use super::streams::{MetadataScratch, Streams};
use cubecl_common::stream_id::StreamId;

/// The smallest scratch reserved, in bytes (a few shapes and strides).
pub(super) const MIN_SCRATCH: u64 = 256;

/// A launch's info, split as a driver's layout wants it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Split<'a> {
    /// Passed to the driver in `Launch::info`.
    pub(super) inline: &'a [u64],
    /// Uploaded by the server into the stream's scratch, passed in `Launch::metadata`.
    pub(super) upload: Option<&'a [u64]>,
}

/// Splits `data` (CubeCL's `MetadataBindingInfo::data`, dynamic part from `dynamic_offset`).
pub(super) fn split(layout: MetadataLayout, data: &[u64], dynamic_offset: usize) -> Split<'_> {
    match layout {
        MetadataLayout::DriverBinding => Split {
            inline: data,
            upload: None,
        },
        MetadataLayout::DeviceBuffer => Split {
            inline: &[],
            upload: (!data.is_empty()).then_some(data),
        },
        MetadataLayout::GridConstant => {
            let offset = dynamic_offset.min(data.len());
            Split {
                inline: &data[..offset],
                upload: (offset < data.len()).then(|| &data[offset..]),
            }
        }
    }
}

/// The scratch capacity for `bytes`: a power of two, at least [`MIN_SCRATCH`], so a stream
/// grows its scratch a logarithmic number of times.
pub(super) fn scratch_capacity(bytes: u64) -> u64 {
    bytes.max(MIN_SCRATCH).next_power_of_two()
}

/// Copies `values` into the scratch of `stream_id`'s slot (grown first if too small) and
/// returns the scratch.
pub(super) fn upload<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    pending: &mut PendingUses<D::Event>,
    max_binding_size: Option<u64>,
    stream_id: StreamId,
    values: &[u64],
) -> Result<Resource<D>, ServerError> {
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|value| value.to_ne_bytes())
        .collect();
    let len = bytes.len() as u64;
    let fits = streams
        .get(driver, stream_id)
        .metadata
        .as_ref()
        .is_some_and(|scratch| scratch.capacity >= len);
    if !fits {
        // The old scratch goes back to the stream's pool; later work on this stream reuses it
        // in stream order.
        streams.get(driver, stream_id).metadata = None;
        let capacity = scratch_capacity(len);
        let reserved = reserve::reserve(
            driver,
            streams,
            pending,
            max_binding_size,
            capacity,
            stream_id,
        )?;
        let stream = streams.get(driver, stream_id);
        stream.cursor += 1;
        let handle = Handle::new(stream_id, capacity);
        stream
            .memory
            .manager()
            .bind(reserved, handle.memory.clone(), stream.cursor)
            .map_err(ServerError::Io)?;
        stream.metadata = Some(MetadataScratch { handle, capacity });
    }
    let stream = streams.get(driver, stream_id);
    let scratch = stream
        .metadata
        .as_ref()
        .expect("the scratch was just reserved");
    let resource = stream
        .memory
        .manager()
        .get_resource(scratch.handle.clone().binding().memory, None, None)
        .map_err(ServerError::Io)?;
    // SAFETY: `resource` was just resolved from the stream's live metadata scratch, which the
    // stream keeps bound (and allocated) for as long as it exists.
    unsafe { driver.write(&mut stream.driver, &resource, &bytes) }?;
    Ok(resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_constants_pass_the_static_part_and_upload_only_the_dynamic_part() {
        let data = [1, 2, 3, 4, 5];
        assert_eq!(
            split(MetadataLayout::GridConstant, &data, 3),
            Split {
                inline: &[1, 2, 3],
                upload: Some(&[4, 5]),
            }
        );
        // No dynamic metadata: nothing to upload (cubecl-cuda's `dynamic_metadata_offset <
        // data.len()` test).
        assert_eq!(
            split(MetadataLayout::GridConstant, &data, 5),
            Split {
                inline: &data,
                upload: None,
            }
        );
        // Only dynamic metadata.
        assert_eq!(
            split(MetadataLayout::GridConstant, &data, 0),
            Split {
                inline: &[],
                upload: Some(&data),
            }
        );
    }

    #[test]
    fn a_device_buffer_layout_uploads_everything_and_a_driver_binding_nothing() {
        let data = [7, 8];
        assert_eq!(
            split(MetadataLayout::DeviceBuffer, &data, 1),
            Split {
                inline: &[],
                upload: Some(&data),
            }
        );
        assert_eq!(
            split(MetadataLayout::DeviceBuffer, &[], 0),
            Split {
                inline: &[],
                upload: None,
            }
        );
        assert_eq!(
            split(MetadataLayout::DriverBinding, &data, 1),
            Split {
                inline: &data,
                upload: None,
            }
        );
    }

    #[test]
    fn the_scratch_grows_in_powers_of_two_from_its_minimum() {
        assert_eq!(scratch_capacity(0), MIN_SCRATCH);
        assert_eq!(scratch_capacity(8), MIN_SCRATCH);
        assert_eq!(scratch_capacity(MIN_SCRATCH + 1), 2 * MIN_SCRATCH);
        assert_eq!(scratch_capacity(5000), 8192);
    }
}
