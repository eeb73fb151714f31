//! Shareable pages on the real driver (need a CUDA GPU; `cargo test -p cudalloc-sys --test
//! cuda_share -- --ignored`): the driver's answer to an export of a plain page is the one the
//! simulated device gives (`NOT_EXPORTABLE`), and an imported page maps the same memory and
//! keeps it after the exporter released its handle.

use std::os::fd::AsFd;
use std::sync::Mutex;

use cudalloc_sys::{CudaDevice, Device, DeviceError};

static GPU: Mutex<()> = Mutex::new(());

fn gpu() -> (std::sync::MutexGuard<'static, ()>, CudaDevice) {
    let guard = GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    (guard, CudaDevice::new(0).expect("CUDA device 0"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn export_of_a_plain_page_is_refused() {
    let (_guard, dev) = gpu();
    assert!(
        dev.can_share().unwrap(),
        "the H200 exports POSIX descriptors"
    );
    let g = dev.granularity().unwrap();
    let page = dev.create_page(g).unwrap();
    let refused = dev.export_page(page);
    dev.release_page(page).unwrap();
    match refused {
        Err(DeviceError::Driver { code, .. }) => assert_eq!(
            code,
            cudalloc_sys::NOT_EXPORTABLE,
            "the driver's code for an export of a plain page (the sim's NOT_EXPORTABLE)"
        ),
        other => panic!("expected a driver error, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_imported_page_maps_the_same_memory_and_outlives_its_exporter() {
    let (_guard, dev) = gpu();
    let g = dev.granularity().unwrap();
    let page = dev.create_shareable_page(g).unwrap();
    let fd = dev.export_page(page).unwrap();
    let (a, b) = (dev.reserve(g).unwrap(), dev.reserve(g).unwrap());
    dev.map(a, g, page).unwrap();
    dev.set_access(a, g, &[]).unwrap();
    dev.copy_to_device(a, b"written through the first mapping")
        .unwrap();
    let imported = dev.import_page(fd.as_fd(), g).unwrap();
    drop(fd);
    dev.unmap(a, g).unwrap();
    dev.release_page(page).unwrap();
    dev.map(b, g, imported).unwrap();
    dev.set_access(b, g, &[]).unwrap();
    let mut seen = [0u8; 33];
    dev.copy_from_device(b, &mut seen).unwrap();
    assert_eq!(&seen, b"written through the first mapping");
    dev.unmap(b, g).unwrap();
    dev.release_page(imported).unwrap();
    dev.unreserve(a, g).unwrap();
    dev.unreserve(b, g).unwrap();
}
