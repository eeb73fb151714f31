//! Tests of [`CudaDevice`] against the real driver.
//!
//! `driver_presence_decides_new` runs everywhere. The rest need a CUDA GPU and are ignored by
//! default: `cargo test -p cudalloc-sys --test cuda -- --ignored`. They share device 0 and compare
//! free memory, so they take a lock and run one at a time.

use std::sync::{Arc, Mutex, MutexGuard};

use cudalloc_sys::{CudaDevice, Device, DeviceError, PageHandle, StreamId, MALLOC_ALIGNMENT};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

static GPU: Mutex<()> = Mutex::new(());

/// Device 0, with the lock that keeps GPU tests apart.
fn gpu() -> (MutexGuard<'static, ()>, CudaDevice) {
    let guard = GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dev = CudaDevice::new(0).expect("CUDA device 0");
    (guard, dev)
}

/// `len` bytes that differ from their neighbours and from another `seed`'s bytes.
fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ seed)
        .collect()
}

/// Reads `len` bytes at `ptr` back from the device.
fn read(dev: &CudaDevice, ptr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0; len as usize];
    dev.copy_from_device(ptr, &mut out)
        .expect("copy from device");
    out
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DeviceError>) {
    match result {
        Err(DeviceError::InvalidArgument { .. }) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn driver_presence_decides_new() {
    // SAFETY: this only tries to open the candidate library names and closes them again.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    let opened = std::panic::catch_unwind(|| CudaDevice::new(0)).expect("new must not panic");
    if present {
        opened.expect("libcuda is present, so device 0 should open");
        return;
    }
    assert!(
        matches!(opened, Err(DeviceError::Unavailable(_))),
        "{opened:?}"
    );
    // Every later call answers the same, from the cached outcome.
    assert!(matches!(
        CudaDevice::new(0),
        Err(DeviceError::Unavailable(_))
    ));
    assert!(matches!(
        CudaDevice::device_count(),
        Err(DeviceError::Unavailable(_))
    ));
    assert!(matches!(
        CudaDevice::can_access_peer(0, 1),
        Err(DeviceError::Unavailable(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn malloc_write_read_free() {
    let (_lock, dev) = gpu();
    for (seed, size) in [4, KIB, MIB, GIB].into_iter().enumerate() {
        let ptr = dev.malloc(size).expect("malloc");
        assert_eq!(ptr % MALLOC_ALIGNMENT, 0, "{size} bytes at {ptr:#x}");
        let data = pattern(size, seed as u8);
        dev.copy_to_device(ptr, &data).expect("copy to device");
        assert!(
            read(&dev, ptr, size) == data,
            "{size} bytes read back differ"
        );
        assert_invalid(dev.free(ptr, size + 1));
        dev.free(ptr, size).expect("free");
        assert_invalid(dev.free(ptr, size));
    }
    assert_invalid(dev.malloc(0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn malloc_beyond_total_is_out_of_memory() {
    let (_lock, dev) = gpu();
    let (_, total) = dev.mem_info().expect("mem_info");
    let err = dev
        .malloc(total + GIB)
        .expect_err("more than the device has");
    assert!(err.is_out_of_memory(), "{err:?}");
    // The failure is not sticky.
    let ptr = dev.malloc(MIB).expect("malloc after out-of-memory");
    dev.free(ptr, MIB).expect("free");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn granularity_is_a_cached_power_of_two() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().expect("granularity");
    assert!(g.is_power_of_two(), "{g}");
    assert_eq!(dev.granularity().unwrap(), g);
    assert!(CudaDevice::device_count().unwrap() >= 1);
    assert_eq!(dev.ordinal(), 0);
}

/// Creates `count` pages of `g` bytes and maps page `i` at `va + i * g`.
fn map_pages(dev: &CudaDevice, va: u64, g: u64, count: u64) -> Vec<PageHandle> {
    let pages: Vec<_> = (0..count)
        .map(|_| dev.create_page(g).expect("page"))
        .collect();
    for (i, page) in (0..).zip(&pages) {
        dev.map(va + i * g, g, *page).expect("map");
    }
    pages
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_map_write_remap_release() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().unwrap();
    let span = (64 * MIB).max(16 * g);
    let va = dev.reserve(span).expect("reserve");
    let pages = map_pages(&dev, va, g, 8);
    dev.set_access(va, 8 * g, &[]).expect("set_access");

    let data = pattern(8 * g, 7);
    dev.copy_to_device(va, &data).expect("write across pages");
    assert!(read(&dev, va, 8 * g) == data);
    let straddle = va + 3 * g - 100;
    assert!(read(&dev, straddle, 200) == data[(3 * g - 100) as usize..(3 * g + 100) as usize]);

    // Broken preconditions are rejected before the driver sees them.
    assert_invalid(dev.release_page(pages[3]));
    assert_invalid(dev.unreserve(va, span));
    assert_invalid(dev.map(va + 3 * g, g, pages[0]));

    // Move page 3 to slot 10: its contents travel with it.
    dev.unmap(va + 3 * g, g).expect("unmap");
    assert_invalid(dev.unmap(va + 3 * g, g));
    let slot = va + 10 * g;
    dev.map(slot, g, pages[3]).expect("remap");
    dev.set_access(slot, g, &[]).expect("set_access again");
    assert!(read(&dev, slot, g) == data[(3 * g) as usize..(4 * g) as usize]);
    assert!(read(&dev, va + 4 * g, g) == data[(4 * g) as usize..(5 * g) as usize]);

    dev.unmap(slot, g).expect("unmap moved page");
    for i in (0..8).filter(|&i| i != 3) {
        dev.unmap(va + i * g, g).expect("unmap");
    }
    for page in &pages {
        dev.release_page(*page).expect("release");
    }
    assert_invalid(dev.release_page(pages[0]));
    dev.unreserve(va, span).expect("unreserve");
    assert_invalid(dev.unreserve(va, span));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_misaligned_arguments_are_invalid() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().unwrap();
    assert_invalid(dev.reserve(g + 1));
    assert_invalid(dev.reserve(0));
    assert_invalid(dev.create_page(g / 2));
    let va = dev.reserve(4 * g).expect("reserve");
    let page = dev.create_page(g).expect("page");
    assert_invalid(dev.map(va + 4 * KIB, g, page));
    assert_invalid(dev.map(va, 2 * g, page));
    assert_invalid(dev.map(va + 4 * g, g, page)); // past the reservation
    dev.map(va, g, page).expect("aligned map");
    assert_invalid(dev.set_access(va + 4 * KIB, g, &[]));
    assert_invalid(dev.set_access(va, 2 * g, &[])); // second granule is not mapped
    assert_invalid(dev.unmap(va, g / 2));
    dev.unmap(va, g).expect("unmap");
    dev.release_page(page).expect("release");
    dev.unreserve(va, 4 * g).expect("unreserve");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_follow_stream_work() {
    let (_lock, dev) = gpu();
    let stream = dev.create_stream().expect("stream");
    let event = dev.create_event().expect("event");
    let buf = dev.malloc(GIB).expect("malloc");
    dev.memset_async(buf, 0xAB, GIB, stream).expect("memset");
    dev.record_event(event, stream).expect("record");
    let _maybe_done = dev.query_event(event).expect("query");
    dev.synchronize_event(event).expect("synchronize");
    assert!(dev.query_event(event).unwrap());
    assert_eq!(read(&dev, buf + GIB - 16, 16), vec![0xAB; 16]);

    // Pooled events are recorded again, also on the legacy default stream.
    dev.record_event(event, StreamId::DEFAULT)
        .expect("record again");
    dev.synchronize_event(event).expect("synchronize again");
    assert!(dev.query_event(event).unwrap());
    dev.synchronize().expect("synchronize context");

    dev.destroy_event(event).expect("destroy");
    assert_invalid(dev.destroy_event(event));
    assert_invalid(dev.query_event(event));
    dev.destroy_stream(stream).expect("destroy stream");
    assert_invalid(dev.destroy_stream(stream));
    dev.free(buf, GIB).expect("free");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_work_from_any_thread() {
    let (_lock, dev) = gpu();
    let dev = Arc::new(dev);
    let ptrs: Vec<u64> = (0..4u8)
        .map(|seed| {
            let dev = Arc::clone(&dev);
            std::thread::spawn(move || {
                let ptr = dev.malloc(MIB).unwrap();
                dev.copy_to_device(ptr, &pattern(MIB, seed)).unwrap();
                ptr
            })
        })
        .map(|thread| thread.join().unwrap())
        .collect();
    std::thread::scope(|scope| {
        for (seed, ptr) in (0..).zip(&ptrs) {
            let dev = &dev;
            scope.spawn(move || {
                assert!(read(dev, *ptr, MIB) == pattern(MIB, seed));
                dev.free(*ptr, MIB).unwrap();
            });
        }
    });
}

/// A call leaves the caller's current context as it found it: none on a fresh thread (which
/// then still has none), ours when ours was current (nothing to restore); making and dropping a
/// device on a fresh thread leave none current too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_leave_the_callers_context_as_they_found_it() {
    use cudarc::driver::result::ctx::get_current;
    let (_lock, dev) = gpu();
    let dev = Arc::new(dev);
    let d = Arc::clone(&dev);
    std::thread::spawn(move || {
        let ours = d.context().cu_ctx();
        assert_eq!(
            get_current().unwrap(),
            None,
            "a fresh thread has no context"
        );
        let ptr = d.malloc(MIB).unwrap();
        d.copy_to_device(ptr, &pattern(MIB, 3)).unwrap();
        assert_eq!(
            get_current().unwrap(),
            None,
            "malloc and a copy made theirs current"
        );
        let stream = d.create_stream().unwrap();
        d.wait_stream(stream).unwrap();
        d.destroy_stream(stream).unwrap();
        d.free(ptr, MIB).unwrap();
        assert_eq!(
            get_current().unwrap(),
            None,
            "a stream's calls made theirs current"
        );
        let again = CudaDevice::new(0).unwrap();
        assert_eq!(get_current().unwrap(), None, "new made its context current");
        drop(again);
        assert_eq!(
            get_current().unwrap(),
            None,
            "a drop made its context current"
        );
        d.context().bind_to_thread().unwrap();
        let ptr = d.malloc(MIB).unwrap();
        d.free(ptr, MIB).unwrap();
        assert_eq!(
            get_current().unwrap(),
            Some(ours),
            "our own context stays current"
        );
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn free_memory_returns_to_baseline() {
    let (_lock, dev) = gpu();
    dev.synchronize().unwrap();
    let (baseline, _) = dev.mem_info().unwrap();
    let g = dev.granularity().unwrap();

    let ptrs: Vec<u64> = (0..8).map(|_| dev.malloc(256 * MIB).unwrap()).collect();
    let span = (64 * MIB).max(8 * g);
    let va = dev.reserve(span).unwrap();
    let pages = map_pages(&dev, va, g, 8);
    dev.set_access(va, 8 * g, &[]).unwrap();
    let event = dev.create_event().unwrap();
    let (during, _) = dev.mem_info().unwrap();
    assert!(during + 2 * GIB <= baseline, "{during} free of {baseline}");

    dev.destroy_event(event).unwrap();
    for i in 0..8 {
        dev.unmap(va + i * g, g).unwrap();
    }
    pages
        .iter()
        .for_each(|page| dev.release_page(*page).unwrap());
    dev.unreserve(va, span).unwrap();
    ptrs.iter()
        .for_each(|ptr| dev.free(*ptr, 256 * MIB).unwrap());
    dev.synchronize().unwrap();
    let (after, _) = dev.mem_info().unwrap();
    assert!(
        after.abs_diff(baseline) <= 64 * MIB,
        "{after} free, {baseline} before"
    );
}

#[test]
#[ignore = "needs two CUDA GPUs with peer access"]
fn peers_read_vmm_memory() {
    let (_lock, dev) = gpu();
    assert!(
        CudaDevice::device_count().unwrap() >= 2 && CudaDevice::can_access_peer(1, 0).unwrap(),
        "this test needs two GPUs where device 1 can access device 0"
    );
    let peer = CudaDevice::new(1).expect("CUDA device 1");
    dev.enable_peer_access(&peer).expect("enable");
    dev.enable_peer_access(&peer).expect("enable again is Ok");
    let g = dev.granularity().unwrap();
    let va = dev.reserve(g).unwrap();
    let page = dev.create_page(g).unwrap();
    dev.map(va, g, page).unwrap();
    dev.set_access(va, g, &[1, 0, 1])
        .expect("set_access with peers");
    let data = pattern(g, 3);
    dev.copy_to_device(va, &data).unwrap();
    assert!(read(&peer, va, g) == data, "device 1 reads device 0's page");
    dev.unmap(va, g).unwrap();
    dev.release_page(page).unwrap();
    dev.unreserve(va, g).unwrap();
}
