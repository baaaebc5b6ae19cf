//! The fake catches what it claims to, so that an empty violation log means something: a read
//! on another stream without an event wait (the race detector, whatever the schedule), a free
//! with work not waited for, a double free, a map off the granularity, use of mapped memory
//! before `cuMemSetAccess`, a partial unmap, a call without a current context. Each breaks a
//! contract on purpose, so each runs alone in a child process of this binary (its own fake,
//! its own log), on fake device 0, calling the driver through cudarc as `src/cuda` does.

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, result};

use crate::child::in_child;
use crate::fake_cuda::{Driver, Fake, fake_or_skip};

/// The fake, in the child process of `test`; `None` in the parent (after the child passed),
/// and on the real driver (these check the fake itself).
pub(crate) fn fake_in_child(test: &str) -> Option<Fake> {
    match fake_or_skip()? {
        Driver::Real => {
            crate::fake_cuda::fake_only("a check of the fake driver itself");
            None
        }
        Driver::Fake(fake) => in_child(test, &[]).then_some(fake),
    }
}

/// How many of the fake's violations contain `needle`.
pub(crate) fn violations_with(fake: &Fake, needle: &str) -> usize {
    fake.violations()
        .iter()
        .filter(|line| line.contains(needle))
        .count()
}

fn stream() -> sys::CUstream {
    result::stream::create(result::stream::StreamKind::NonBlocking).expect("cuStreamCreate")
}

#[test]
fn a_read_on_another_stream_without_an_event_wait_is_a_race_and_with_one_it_is_not() {
    let Some(fake) = fake_in_child(
        "detector::a_read_on_another_stream_without_an_event_wait_is_a_race_and_with_one_it_is_not",
    ) else {
        return;
    };
    // Delayed: the producer's write has not run when the reader's copy runs.
    fake.set_schedule(crate::fake_cuda::Schedule::Delayed, 1);
    let _context = CudaContext::new(0).expect("device 0");
    let (producer, reader) = (stream(), stream());
    let buffer = unsafe { result::malloc_sync(4096) }.expect("cuMemAlloc");
    let mut back = vec![0u8; 4096];
    unsafe {
        result::memcpy_htod_async(buffer, &[7u8; 4096], producer).expect("write");
        // Pageable destination: returns once the reader's copy ran.
        result::memcpy_dtoh_async(&mut back, buffer, reader).expect("read");
    }
    assert_eq!(
        violations_with(&fake, "race:"),
        1,
        "{:?}",
        fake.violations()
    );
    assert!(
        back.iter().all(|b| *b != 7),
        "the unordered read ran before the write"
    );
    fake.clear_violations();

    // The same with the reader waiting for an event after the write.
    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).expect("event");
    unsafe {
        result::memcpy_htod_async(buffer, &[9u8; 4096], producer).expect("write");
        result::event::record(event, producer).expect("record");
        result::stream::wait_event(
            reader,
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
        .expect("wait");
        result::memcpy_dtoh_async(&mut back, buffer, reader).expect("read");
    }
    assert!(back.iter().all(|b| *b == 9), "ordered by the event");
    fake.assert_no_violations();
    unsafe {
        result::ctx::synchronize().expect("sync");
        result::free_sync(buffer).expect("free");
    }
    fake.assert_no_violations();
}

#[test]
fn a_free_with_work_not_waited_for_and_a_double_free_are_violations() {
    let Some(fake) =
        fake_in_child("detector::a_free_with_work_not_waited_for_and_a_double_free_are_violations")
    else {
        return;
    };
    let _context = CudaContext::new(0).expect("device 0");
    let s = stream();
    let buffer = unsafe { result::malloc_sync(4096) }.expect("cuMemAlloc");
    unsafe { result::memcpy_htod_async(buffer, &[1u8; 4096], s) }.expect("write");
    unsafe { result::free_sync(buffer) }.expect("the real cuMemFree succeeds");
    assert_eq!(
        violations_with(&fake, "while work may still use it"),
        1,
        "{:?}",
        fake.violations()
    );
    let again = unsafe { result::free_sync(buffer) };
    assert_eq!(
        again.map_err(|e| e.0),
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        violations_with(&fake, "not a live cuMemAlloc allocation"),
        1
    );
}

fn page_properties() -> sys::CUmemAllocationProp {
    // SAFETY: all zeroes is a valid property (device 0 is id 0).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop
}

#[test]
fn virtual_memory_off_the_granularity_before_access_or_partly_unmapped_is_refused() {
    let Some(fake) = fake_in_child(
        "detector::virtual_memory_off_the_granularity_before_access_or_partly_unmapped_is_refused",
    ) else {
        return;
    };
    const PAGE: usize = 2 << 20;
    let _context = CudaContext::new(0).expect("device 0");
    let prop = page_properties();
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let s = stream();
    unsafe {
        let mut granularity = 0usize;
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        .result()
        .expect("granularity");
        assert_eq!(granularity, PAGE);
        let mut base = 0;
        let odd = sys::cuMemAddressReserve(&mut base, PAGE + 4096, 0, 0, 0);
        assert_eq!(
            odd,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "a size off the granularity"
        );
        sys::cuMemAddressReserve(&mut base, 2 * PAGE, 0, 0, 0)
            .result()
            .expect("reserve");
        let (mut first, mut second) = (0, 0);
        sys::cuMemCreate(&mut first, PAGE, &prop, 0)
            .result()
            .expect("create");
        sys::cuMemCreate(&mut second, PAGE, &prop, 0)
            .result()
            .expect("create");
        let off = sys::cuMemMap(base + (PAGE as u64) / 2, PAGE, 0, first, 0);
        assert_eq!(
            off,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "an offset off the granularity"
        );
        sys::cuMemMap(base, PAGE, 0, first, 0)
            .result()
            .expect("map");
        let twice = sys::cuMemMap(base, PAGE, 0, second, 0);
        assert_eq!(
            twice,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "a map over a mapping"
        );
        sys::cuMemMap(base + PAGE as u64, PAGE, 0, second, 0)
            .result()
            .expect("map");
        // Before cuMemSetAccess: no use.
        let early = result::memcpy_htod_async(base, &[3u8; 64], s);
        assert_eq!(
            early.map_err(|e| e.0),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        sys::cuMemSetAccess(base, 2 * PAGE, &access, 1)
            .result()
            .expect("access");
        // One copy across both pages.
        let data: Vec<u8> = (0..4096).map(|i| i as u8).collect();
        let across = base + PAGE as u64 - 2048;
        result::memcpy_htod_async(across, &data, s).expect("write");
        let mut back = vec![0u8; 4096];
        result::memcpy_dtoh_async(&mut back, across, s).expect("read");
        assert_eq!(back, data);
        let partial = sys::cuMemUnmap(base, PAGE / 2);
        assert_eq!(
            partial,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "part of a mapping"
        );
        assert_eq!(
            violations_with(&fake, "INVALID_VALUE"),
            5,
            "{:#?}",
            fake.violations()
        );
        fake.clear_violations();
        sys::cuMemUnmap(base, 2 * PAGE).result().expect("unmap");
        sys::cuMemRelease(first).result().expect("release");
        sys::cuMemRelease(second).result().expect("release");
        sys::cuMemAddressFree(base, 2 * PAGE)
            .result()
            .expect("free the range");
    }
    fake.assert_no_violations();
    assert_eq!(fake.live(0).created, 0);
    assert_eq!(fake.live(0).reserved_ranges, 0);
}

#[test]
fn a_call_without_a_current_context_is_invalid_context() {
    let Some(fake) = fake_in_child("detector::a_call_without_a_current_context_is_invalid_context")
    else {
        return;
    };
    let _context = CudaContext::new(0).expect("device 0");
    let unbound = std::thread::spawn(|| unsafe { result::malloc_sync(4096) }.map_err(|e| e.0))
        .join()
        .expect("thread");
    assert_eq!(unbound, Err(CUresult::CUDA_ERROR_INVALID_CONTEXT));
    assert_eq!(violations_with(&fake, "no current context"), 1);
}
