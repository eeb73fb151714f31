//! Tests of shared pages on [`SimDevice`] (the exporter and the importer are two processes on
//! one GPU, simulated on one device) and of moving descriptors over a Unix socket (`fds`).
//!
//! Invariants checked here (each test ends with `check_invariants()`):
//! - only a page made by `create_shareable_page` exports; a plain page is refused with the
//!   driver's code ([`NOT_EXPORTABLE`]), a device without sharing refuses to make one;
//! - an imported page maps the same bytes: a write through one mapping reads back through the
//!   other, in both directions;
//! - the physical memory lives while any handle does: the importer keeps it after the exporter
//!   released its handle, its bytes count once against the capacity, and it is gone (an import
//!   refused) once every handle is released;
//! - a descriptor survives being sent over a Unix socket (`SCM_RIGHTS`) and duplicated;
//! - the wrappers count, fail and book the new calls like the others.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use cudalloc_sys::fds::{recv_fds, send_fds, MAX_FDS};
use cudalloc_sys::wrap::{CountCalls, FailCalls, Limit, TimeCalls};
use cudalloc_sys::{Call, Device, DeviceError, PageHandle, SimConfig, SimDevice, NOT_EXPORTABLE};

const G: u64 = 2 << 20;

fn backed() -> SimDevice {
    SimDevice::new(SimConfig::with_capacity(1 << 30).host_backing(true))
}

/// Maps `page` (of `G` bytes) into a fresh reservation, accessible; returns the address.
fn map_alone(dev: &SimDevice, page: PageHandle) -> u64 {
    let va = dev.reserve(G).unwrap();
    dev.map(va, G, page).unwrap();
    dev.set_access(va, G, &[]).unwrap();
    va
}

fn unmap_alone(dev: &SimDevice, va: u64, page: PageHandle) {
    dev.unmap(va, G).unwrap();
    dev.release_page(page).unwrap();
    dev.unreserve(va, G).unwrap();
}

#[test]
fn a_plain_page_does_not_export() {
    let dev = backed();
    let page = dev.create_page(G).unwrap();
    match dev.export_page(page) {
        Err(DeviceError::Driver { code, call, .. }) => {
            assert_eq!((code, call), (NOT_EXPORTABLE, "export_page"));
        }
        other => panic!("expected the driver's refusal, got {other:?}"),
    }
    dev.release_page(page).unwrap();
    dev.check_invariants();
}

#[test]
fn a_device_without_sharing_refuses_shareable_pages() {
    let dev = SimDevice::new(SimConfig::with_capacity(1 << 30).shareable(false));
    assert!(!dev.can_share().unwrap());
    let made = dev.create_shareable_page(G);
    assert!(
        matches!(made, Err(DeviceError::Driver { code: 801, .. })),
        "{made:?}"
    );
    assert_eq!(dev.live_pages(), 0);
    assert!(backed().can_share().unwrap());
    dev.check_invariants();
}

#[test]
fn an_import_maps_the_same_bytes() {
    let dev = backed();
    let page = dev.create_shareable_page(G).unwrap();
    let fd = dev.export_page(page).unwrap();
    let exporter = map_alone(&dev, page);
    let imported = dev.import_page(fd.as_fd(), G).unwrap();
    assert_ne!(imported, page, "an import is a handle of its own");
    let importer = map_alone(&dev, imported);
    assert_ne!(importer, exporter);
    dev.write(exporter + 100, b"from the exporter").unwrap();
    let mut seen = [0u8; 17];
    dev.read(importer + 100, &mut seen).unwrap();
    assert_eq!(&seen, b"from the exporter");
    dev.write(importer + G - 4, b"back").unwrap();
    let mut back = [0u8; 4];
    dev.read(exporter + G - 4, &mut back).unwrap();
    assert_eq!(&back, b"back");
    assert_eq!(dev.page_bytes(), G, "an import adds no memory");
    dev.check_invariants();
    unmap_alone(&dev, importer, imported);
    unmap_alone(&dev, exporter, page);
    assert_eq!(dev.page_bytes(), 0);
    dev.check_invariants();
}

#[test]
fn the_importer_keeps_the_memory_after_the_exporter_releases_it() {
    let dev = backed();
    let page = dev.create_shareable_page(G).unwrap();
    let exporter = map_alone(&dev, page);
    dev.write(exporter, b"kept").unwrap();
    let fd = dev.export_page(page).unwrap();
    let imported = dev.import_page(fd.as_fd(), G).unwrap();
    unmap_alone(&dev, exporter, page);
    assert_eq!(
        dev.page_bytes(),
        G,
        "the importer's handle holds the memory"
    );
    let importer = map_alone(&dev, imported);
    let mut seen = [0u8; 4];
    dev.read(importer, &mut seen).unwrap();
    assert_eq!(&seen, b"kept");
    dev.check_invariants();
    unmap_alone(&dev, importer, imported);
    assert_eq!(dev.page_bytes(), 0, "the last handle frees it");
    let late = dev.import_page(fd.as_fd(), G);
    assert!(
        matches!(late, Err(DeviceError::Driver { code: 1, .. })),
        "{late:?}"
    );
    dev.check_invariants();
}

#[test]
fn an_import_of_a_stranger_or_the_wrong_size_is_refused() {
    let dev = backed();
    let (reader, _writer) = std::io::pipe().unwrap();
    let stranger = OwnedFd::from(reader);
    let r = dev.import_page(stranger.as_fd(), G);
    assert!(
        matches!(r, Err(DeviceError::Driver { code: 1, .. })),
        "{r:?}"
    );
    let page = dev.create_shareable_page(G).unwrap();
    let fd = dev.export_page(page).unwrap();
    let r = dev.import_page(fd.as_fd(), 2 * G);
    assert!(
        matches!(r, Err(DeviceError::Driver { code: 1, .. })),
        "{r:?}"
    );
    assert_eq!(dev.live_pages(), 1);
    dev.release_page(page).unwrap();
    dev.check_invariants();
}

#[test]
fn a_descriptor_crosses_a_socket_and_still_imports() {
    let dev = backed();
    let pages: Vec<PageHandle> = (0..3)
        .map(|_| dev.create_shareable_page(G).unwrap())
        .collect();
    let fds: Vec<OwnedFd> = pages.iter().map(|&p| dev.export_page(p).unwrap()).collect();
    let (a, b) = UnixStream::pair().unwrap();
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    send_fds(&a, b"xyz", &borrowed).unwrap();
    drop(fds); // the sender's copies close; the receiver's stay open
    let mut buf = [0u8; 3];
    let got = recv_fds(&b, &mut buf, MAX_FDS).unwrap();
    assert_eq!((&buf, got.len()), (b"xyz", 3));
    let va = map_alone(&dev, pages[1]);
    dev.write(va, b"second").unwrap();
    let imported = dev.import_page(got[1].as_fd(), G).unwrap();
    let importer = map_alone(&dev, imported);
    let mut seen = [0u8; 6];
    dev.read(importer, &mut seen).unwrap();
    assert_eq!(&seen, b"second");
    unmap_alone(&dev, importer, imported);
    unmap_alone(&dev, va, pages[1]);
    dev.release_page(pages[0]).unwrap();
    dev.release_page(pages[2]).unwrap();
    dev.check_invariants();
}

#[test]
fn socket_messages_keep_their_descriptors_apart() {
    let (a, b) = UnixStream::pair().unwrap();
    let files: Vec<OwnedFd> = (0..4)
        .map(|_| OwnedFd::from(std::io::pipe().unwrap().0))
        .collect();
    let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
    send_fds(&a, &[1], &fds[..1]).unwrap();
    send_fds(&a, &[3], &fds[1..]).unwrap();
    let mut one = [0u8; 1];
    assert_eq!(recv_fds(&b, &mut one, MAX_FDS).unwrap().len(), 1);
    assert_eq!(one, [1]);
    assert_eq!(recv_fds(&b, &mut one, MAX_FDS).unwrap().len(), 3);
    assert_eq!(one, [3]);
    let too_many = vec![fds[0]; MAX_FDS + 1];
    let e = send_fds(&a, &[0], &too_many).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(send_fds(&a, &[], &fds).is_err(), "a message needs a byte");
    drop(a);
    let eof = recv_fds(&b, &mut one, MAX_FDS).unwrap_err();
    assert_eq!(eof.kind(), std::io::ErrorKind::UnexpectedEof);
}

#[test]
fn wrappers_count_fail_and_book_the_sharing_calls() {
    let counted = CountCalls::new(backed());
    let page = counted.create_shareable_page(G).unwrap();
    let fd = counted.export_page(page).unwrap();
    let imported = counted.import_page(fd.as_fd(), G).unwrap();
    assert_eq!(counted.calls(Call::CreatePage), 1);
    assert_eq!(
        (
            counted.calls(Call::ExportPage),
            counted.calls(Call::ImportPage)
        ),
        (1, 1)
    );
    assert_eq!(counted.outstanding_bytes(), G, "an import books nothing");
    counted.release_page(imported).unwrap();
    counted.release_page(page).unwrap();
    assert_eq!(counted.outstanding_bytes(), 0);

    // A shareable page is timed as a `create_page`; an export and an import once each.
    let timed = TimeCalls::new(backed());
    let page = timed.create_shareable_page(G).unwrap();
    let fd = timed.export_page(page).unwrap();
    let imported = timed.import_page(fd.as_fd(), G).unwrap();
    let calls = |kind| timed.time(kind).calls;
    assert_eq!(calls(Call::CreatePage), 1);
    assert_eq!((calls(Call::ExportPage), calls(Call::ImportPage)), (1, 1));
    timed.release_page(imported).unwrap();
    timed.release_page(page).unwrap();
    assert_eq!(calls(Call::ReleasePage), 2);

    let limited = Limit::new(backed(), G);
    let page = limited.create_shareable_page(G).unwrap();
    let over = limited.create_shareable_page(G);
    assert!(
        matches!(over, Err(DeviceError::OutOfMemory { .. })),
        "{over:?}"
    );
    let fd = limited.export_page(page).unwrap();
    let imported = limited.import_page(fd.as_fd(), G).unwrap();
    assert_eq!(limited.outstanding_bytes(), G);
    limited.release_page(imported).unwrap();
    limited.release_page(page).unwrap();
    assert_eq!(limited.outstanding_bytes(), 0);

    let failing = FailCalls::new(backed());
    let page = failing.create_shareable_page(G).unwrap();
    failing.fail_next();
    assert!(failing.export_page(page).is_err());
    let fd = failing.export_page(page).unwrap();
    failing.fail_next();
    assert!(failing.import_page(fd.as_fd(), G).is_err());
    assert_eq!(
        failing.inner().live_pages(),
        1,
        "a failed import changes nothing"
    );
    failing.release_page(page).unwrap();
    failing.inner().check_invariants();
}
