//! Sharing allocations between two processes on one GPU, simulated on one host-backed
//! `SimDevice` (the exporter's allocator and the importer's mapping use the same device, as two
//! processes use the same GPU): an imported allocation reads the exporter's bytes and the
//! exporter reads the importer's; the description crosses a Unix socket with its descriptors;
//! the importer keeps the memory after the exporter freed it, emptied its cache and dropped its
//! allocator, until it closes the mapping; the config key is checked at configuration and at
//! `try_new`, and an allocation that cannot be shared names the key to set.

use cudalloc::{AllocError, CachingAllocator, Config, Policy, SharedAllocation, SharedMapping};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const EXPANDABLE: [Policy; 2] = [Policy::TorchExpandable, Policy::Default];

fn device(shareable: bool) -> Arc<SimDevice> {
    let cfg = SimConfig::with_capacity(1 << 30).host_backing(true);
    Arc::new(SimDevice::new(cfg.shareable(shareable)))
}

fn shareable(policy: Policy) -> Config {
    let name = policy.name();
    Config::parse(&format!("policy:{name},shareable_segments:True")).expect("config")
}

fn exporter(dev: &Arc<SimDevice>, policy: Policy) -> CachingAllocator<Arc<SimDevice>> {
    CachingAllocator::try_new(dev.clone(), shareable(policy)).expect("a device that shares")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn read(dev: &SimDevice, ptr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    dev.read(ptr, &mut out).expect("read");
    out
}

/// Sends `shared` over a socket pair and receives it, as the importing process would.
fn through_a_socket(shared: &SharedAllocation) -> SharedAllocation {
    let (a, b) = UnixStream::pair().expect("socket pair");
    shared.send(&a).expect("send");
    SharedAllocation::receive(&b).expect("receive")
}

#[test]
fn the_key_parses_and_the_torch_policy_refuses_it() {
    let cfg = Config::parse("shareable_segments:True").unwrap();
    assert!(cfg.pool().shareable_segments);
    assert!(
        !Config::default().pool().shareable_segments,
        "off by default"
    );
    let bad = Config::parse("shareable_segments:maybe").unwrap_err();
    assert_eq!(bad.key, "shareable_segments");
    let torch = Config::parse("policy:torch,shareable_segments:True").unwrap_err();
    assert_eq!(torch.key, "shareable_segments");
    assert!(torch.message.contains("cuMemAlloc"), "{torch}");
    let expandable = "policy:torch,expandable_segments:True,shareable_segments:True";
    assert!(Config::parse(expandable).is_ok());
}

#[test]
fn a_device_that_cannot_export_is_refused_when_the_allocator_is_built() {
    let dev = device(false);
    let e = CachingAllocator::try_new(dev.clone(), shareable(Policy::Default)).unwrap_err();
    assert_eq!(e.key, "shareable_segments");
    assert!(e.message.contains("cannot export"), "{e}");
    assert_eq!(dev.total_calls(), 0, "nothing was allocated");
    assert!(
        CachingAllocator::try_new(dev, Config::default()).is_ok(),
        "key off: no question"
    );
}

#[test]
fn an_allocation_that_cannot_be_shared_names_the_key() {
    let dev = device(true);
    for (cfg, words) in [
        (Config::default(), "shareable_segments:True"),
        (Config::for_policy(Policy::Torch), "cuMemAlloc"),
    ] {
        let alloc = CachingAllocator::new(dev.clone(), cfg);
        let a = alloc.allocate(MIB, StreamId::DEFAULT).unwrap();
        match alloc.share(a.ptr()) {
            Err(e @ AllocError::NotShareable { .. }) => {
                assert!(e.to_string().contains(words), "{e}")
            }
            other => panic!("expected NotShareable, got {other:?}"),
        }
        assert!(matches!(
            alloc.share(a.ptr() + 512),
            Err(AllocError::NotAllocated(_))
        ));
        alloc.free(a).unwrap();
    }
    dev.check_invariants();
}

#[test]
fn an_imported_allocation_reads_and_writes_the_exporters_bytes() {
    for policy in EXPANDABLE {
        let dev = device(true);
        let alloc = exporter(&dev, policy);
        let _neighbour = alloc.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
        let a = alloc.allocate(5 * MIB + 512, StreamId::DEFAULT).unwrap();
        let len = a.size() as usize;
        dev.write(a.ptr(), &pattern(len, 1)).unwrap();
        let shared = alloc.share(a.ptr()).unwrap();
        assert_eq!((shared.size, shared.device), (a.size(), 0));
        assert!(shared.offset + shared.size <= shared.page_bytes());
        let received = through_a_socket(&shared);
        drop(shared); // the exporter's descriptors close; the importer's are its own
        assert_eq!(
            received.description(),
            alloc.share(a.ptr()).unwrap().description()
        );
        let calls = dev.calls(Call::ImportPage);
        let m = SharedMapping::open(dev.clone(), &received).unwrap();
        assert_eq!(
            dev.calls(Call::ImportPage) - calls,
            received.pages.len() as u64
        );
        assert_ne!(m.ptr(), a.ptr(), "{policy:?}: its own addresses");
        assert_eq!(read(&dev, m.ptr(), len), pattern(len, 1), "{policy:?}");
        dev.write(m.ptr(), &pattern(len, 2)).unwrap();
        assert_eq!(read(&dev, a.ptr(), len), pattern(len, 2), "{policy:?}");
        let page_bytes = dev.page_bytes();
        m.close().unwrap();
        assert_eq!(
            dev.page_bytes(),
            page_bytes,
            "closing frees nothing the exporter holds"
        );
        alloc.free(a).unwrap();
        alloc.check_invariants().unwrap();
        dev.check_invariants();
    }
}

#[test]
fn the_importer_keeps_the_memory_after_the_exporter_lets_it_go() {
    for policy in EXPANDABLE {
        let dev = device(true);
        let alloc = exporter(&dev, policy);
        let a = alloc.allocate(8 * MIB, StreamId::DEFAULT).unwrap();
        let len = a.size() as usize;
        dev.write(a.ptr(), &pattern(len, 7)).unwrap();
        let shared = through_a_socket(&alloc.share(a.ptr()).unwrap());
        let m = alloc.open_shared(&shared).unwrap();
        drop(shared);
        alloc.free(a).unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(
            alloc.reserved_bytes(),
            0,
            "{policy:?}: the exporter holds nothing"
        );
        drop(alloc);
        let (_, held) = m.range();
        assert_eq!(
            dev.page_bytes(),
            held,
            "{policy:?}: the importer's pages stay"
        );
        assert_eq!(read(&dev, m.ptr(), len), pattern(len, 7), "{policy:?}");
        dev.write(m.ptr(), b"still mine").unwrap();
        m.close().unwrap();
        assert_eq!(
            dev.outstanding_bytes(),
            0,
            "{policy:?}: the last handle frees it"
        );
        assert_eq!((dev.live_pages(), dev.reserved_va_bytes()), (0, 0));
        dev.check_invariants();
    }
}

#[test]
fn a_failed_open_leaves_nothing_behind() {
    let dev = device(true);
    let alloc = exporter(&dev, Policy::Default);
    let a = alloc.allocate(6 * MIB, StreamId::DEFAULT).unwrap();
    let shared = alloc.share(a.ptr()).unwrap();
    let (pages, va) = (dev.live_pages(), dev.reserved_va_bytes());
    for k in 1..=2 * shared.pages.len() as u64 + 2 {
        dev.fail_call(k);
        let opened = SharedMapping::open(dev.clone(), &shared);
        dev.clear_faults();
        match opened {
            Ok(m) => m.close().unwrap(),
            Err(e) => assert!(matches!(e, AllocError::Device(_)), "{e}"),
        }
        assert_eq!(
            (dev.live_pages(), dev.reserved_va_bytes()),
            (pages, va),
            "fault {k}"
        );
        dev.check_invariants();
    }
    alloc.free(a).unwrap();
}

#[test]
fn a_bad_description_is_refused() {
    let dev = device(true);
    let alloc = exporter(&dev, Policy::Default);
    let a = alloc.allocate(MIB, StreamId::DEFAULT).unwrap();
    let mut shared = alloc.share(a.ptr()).unwrap();
    let bytes = shared.description();
    let e = SharedAllocation::from_description(&bytes[1..], Vec::new()).unwrap_err();
    assert!(matches!(e, AllocError::BadShare { .. }), "{e}");
    let e = SharedAllocation::from_description(&bytes, Vec::new()).unwrap_err();
    assert!(e.to_string().contains("descriptors"), "{e}");
    shared.offset = shared.page_bytes();
    let e = SharedMapping::open(dev.clone(), &shared).unwrap_err();
    assert!(matches!(e, AllocError::BadShare { .. }), "{e}");
    alloc.free(a).unwrap();
    dev.check_invariants();
}

#[test]
fn a_sleeping_tag_refuses_to_share() {
    let dev = device(true);
    let alloc = exporter(&dev, Policy::Default);
    let a = alloc
        .allocate_tagged(4 * MIB, StreamId::DEFAULT, "kv")
        .unwrap();
    assert!(alloc.share(a.ptr()).is_ok(), "an awake tag shares");
    alloc.sleep(&["kv"], &[]).unwrap();
    match alloc.share(a.ptr()) {
        Err(AllocError::Asleep { tag, .. }) => assert_eq!(tag.as_deref(), Some("kv")),
        other => panic!("expected Asleep, got {other:?}"),
    }
    alloc.wake(&["kv"], StreamId::DEFAULT).unwrap();
    alloc.free(a).unwrap();
}
