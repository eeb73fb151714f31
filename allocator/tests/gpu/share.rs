//! Sharing allocations with another process on one GPU (ignored elsewhere): the test spawns
//! this test binary again as the importer (`importer_side`, which does nothing unless
//! `CUDALLOC_SHARE_SOCKET` names the socket to talk on), sends it allocations over a Unix
//! socket (description and descriptors) and checks, for each expandable policy:
//! - the importer reads the exporter's pattern and the exporter reads the importer's;
//! - after the exporter freed the allocation, emptied its cache and dropped its allocator, the
//!   importer still reads and writes the memory, and the device gets it back (free memory
//!   within 64 MiB of where it was) only once the importer closes its mapping;
//! - a map hook of the exporter saw the pages mapped before the allocation was handed out.

use cudalloc::{CachingAllocator, Config, MapHooks, Policy, SharedAllocation, SharedMapping};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::device::GPU;

const MIB: u64 = 1 << 20;
const SOCKET: &str = "CUDALLOC_SHARE_SOCKET";

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

fn read_back(dev: &CudaDevice, ptr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    dev.copy_from_device(ptr, &mut out)
        .expect("copy from the device");
    out
}

fn byte(s: &mut UnixStream) -> u8 {
    let mut b = [0u8; 1];
    s.read_exact(&mut b).expect("a byte from the other process");
    b[0]
}

/// Counts the bytes its hooks were told of.
#[derive(Default)]
struct Announced(AtomicU64);

impl MapHooks for Announced {
    fn mapped(&self, _: usize, _: u64, size: u64) {
        self.0.fetch_add(size, Ordering::Relaxed);
    }
    fn unmapping(&self, _: usize, _: u64, size: u64) {
        self.0.fetch_sub(size, Ordering::Relaxed);
    }
}

/// The importer: opens each allocation sent, checks the exporter's pattern, writes its own
/// (seed + 1), answers 1; for the second allocation it waits for the exporter to let go (a
/// byte), checks it can still read and write, closes and answers 2.
#[test]
#[ignore = "needs a CUDA GPU"]
fn importer_side() {
    let Ok(path) = std::env::var(SOCKET) else {
        return; // run by the exporter's test only
    };
    let mut s = UnixStream::connect(path).expect("connect to the exporter");
    let dev = Arc::new(CudaDevice::new(0).expect("CUDA device 0"));
    for round in 0..2u8 {
        let shared = SharedAllocation::receive(&s).expect("receive the allocation");
        let m = SharedMapping::open(dev.clone(), &shared).expect("open the shared allocation");
        assert_eq!(
            read_back(&dev, m.ptr(), m.size()),
            pattern(m.size(), round * 2)
        );
        dev.copy_to_device(m.ptr(), &pattern(m.size(), round * 2 + 1))
            .unwrap();
        s.write_all(&[1]).unwrap();
        if round == 1 {
            assert_eq!(byte(&mut s), 9, "the exporter let go");
            assert_eq!(read_back(&dev, m.ptr(), m.size()), pattern(m.size(), 3));
            dev.copy_to_device(m.ptr(), &pattern(m.size(), 4)).unwrap();
            assert_eq!(read_back(&dev, m.ptr(), m.size()), pattern(m.size(), 4));
        }
        m.close().expect("close");
        s.write_all(&[2]).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn another_process_opens_a_shared_allocation_and_outlives_the_exporter() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let name = policy.name();
        let cfg = Config::parse(&format!("policy:{name},shareable_segments:True")).unwrap();
        let dev = CudaDevice::new(0).unwrap();
        let baseline = dev.mem_info().unwrap().0;
        let alloc = CachingAllocator::try_new(dev, cfg).expect("the H200 exports memory");
        let hooks = Arc::new(Announced::default());
        alloc.set_map_hooks(Some(hooks.clone()));
        let dir = std::env::temp_dir().join(format!("cudalloc-share-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "share::importer_side",
                "--nocapture",
            ])
            .env(SOCKET, &path)
            .spawn()
            .expect("spawn the importer");
        let (mut s, _) = listener.accept().unwrap();

        // Round 0: both ways, then the exporter frees its allocation.
        let size = 5 * MIB + 4096;
        let a = alloc.allocate(size, StreamId::DEFAULT).unwrap();
        assert!(
            hooks.0.load(Ordering::Relaxed) >= size,
            "{name}: announced first"
        );
        alloc
            .with_device(|d| d.copy_to_device(a.ptr(), &pattern(size, 0)))
            .unwrap();
        alloc.share(a.ptr()).unwrap().send(&s).unwrap();
        assert_eq!(byte(&mut s), 1, "{name}: the importer checked round 0");
        let seen = alloc.with_device(|d| read_back(d, a.ptr(), size));
        assert_eq!(seen, pattern(size, 1), "{name}: the importer's bytes");
        assert_eq!(byte(&mut s), 2);
        alloc.free(a).unwrap();

        // Round 1: the exporter lets go of everything while the importer holds the pages.
        let size = 2 << 30;
        let a = alloc.allocate(size, StreamId::DEFAULT).unwrap();
        alloc
            .with_device(|d| d.copy_to_device(a.ptr(), &pattern(size, 2)))
            .unwrap();
        alloc.share(a.ptr()).unwrap().send(&s).unwrap();
        assert_eq!(byte(&mut s), 1, "{name}: the importer checked round 1");
        let seen = alloc.with_device(|d| read_back(d, a.ptr(), size));
        assert_eq!(seen, pattern(size, 3), "{name}: the importer's bytes");
        alloc.free(a).unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.reserved_bytes(), 0);
        drop(alloc);
        let dev = CudaDevice::new(0).unwrap();
        let held = dev.mem_info().unwrap().0;
        assert!(
            held + size <= baseline + 64 * MIB,
            "{name}: the importer holds the pages ({held} free, {baseline} before)"
        );
        s.write_all(&[9]).unwrap();
        assert_eq!(byte(&mut s), 2, "{name}: the importer closed");
        assert!(
            child.wait().unwrap().success(),
            "{name}: the importer failed"
        );
        let after = dev.mem_info().unwrap().0;
        assert!(
            after + 64 * MIB >= baseline,
            "{name}: the memory is back once the importer closed ({after} < {baseline})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
