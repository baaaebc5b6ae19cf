//! Cross-stream ordering: work on one stream that uses a buffer written on another stream waits
//! for the work issued there so far (an event recorded on the producer, waited on by the
//! consumer).

use cubecl_common::stream_id::StreamId as CubeStreamId;
use cubecl_runtime::server::ServerError;

use super::super::driver::Driver;
use super::streams::Streams;

/// Orders later work on `consumer` after the work issued so far on each of `producers`.
pub(super) fn order_after<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    consumer: CubeStreamId,
    producers: &[CubeStreamId],
) -> Result<(), ServerError> {
    for &producer in producers {
        if producer == consumer {
            continue;
        }
        let event = {
            let stream = streams.get(driver, producer);
            driver.record_event(&mut stream.driver)?
        };
        let stream = streams.get(driver, consumer);
        driver.wait_event(&mut stream.driver, event)?;
    }
    Ok(())
}

/// Adds `stream` to `producers` unless it is there already.
pub(super) fn note_producer(producers: &mut Vec<CubeStreamId>, stream: CubeStreamId) {
    if !producers.contains(&stream) {
        producers.push(stream);
    }
}
