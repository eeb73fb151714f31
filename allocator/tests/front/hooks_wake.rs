//! Map hooks around a wake that fails: a chunk the wake's rollback could not unmap (a stuck
//! chunk, unmapped at the next call) is withdrawn, so that the hooks never hold a range the
//! allocator does not list, and the next wake announces its address once.

use cudalloc::{CachingAllocator, Config, MapHooks, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;

/// The ranges announced now, and every rule broken.
struct Recorder {
    dev: Arc<SimDevice>,
    ranges: Mutex<BTreeMap<u64, u64>>,
    errors: Mutex<Vec<String>>,
}

impl MapHooks for Recorder {
    fn mapped(&self, _device: usize, addr: u64, size: u64) {
        let mut r = self.ranges.lock().unwrap();
        let overlaps = r
            .range(..addr + size)
            .next_back()
            .is_some_and(|(&a, &n)| a + n > addr);
        if overlaps {
            let e = format!("{addr:#x}+{size} announced twice");
            self.errors.lock().unwrap().push(e);
        }
        r.insert(addr, size);
    }

    fn unmapping(&self, _device: usize, addr: u64, size: u64) {
        if self.ranges.lock().unwrap().remove(&addr) != Some(size) {
            let e = format!("{addr:#x}+{size} withdrawn, not announced");
            self.errors.lock().unwrap().push(e);
        }
        if !self.dev.accessible_ranges().contains(&(addr, size)) {
            let e = format!("{addr:#x}+{size} withdrawn after its unmap");
            self.errors.lock().unwrap().push(e);
        }
    }
}

#[test]
fn a_chunk_a_failed_wake_left_mapped_is_withdrawn() {
    let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(64 * MIB)));
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::TorchExpandable));
    let rec = Arc::new(Recorder {
        dev: dev.clone(),
        ranges: Mutex::new(BTreeMap::new()),
        errors: Mutex::new(Vec::new()),
    });
    alloc.set_map_hooks(Some(rec.clone()));
    let s = StreamId(0);
    let a = alloc.allocate_tagged(19 * MIB, s, "t").unwrap();
    let b = alloc.allocate_tagged(19 * MIB, s, "t").unwrap();
    alloc.sleep(&["t"], &[]).unwrap();
    let other = alloc.allocate(30 * MIB, s).unwrap();
    // The wake maps the first chunk, runs out of memory at the second, and the release of the
    // first (its rollback) is refused by the driver.
    dev.fail_release(1);
    assert!(alloc.wake(&["t"], s).is_err());
    dev.clear_faults();
    let announced: Vec<(u64, u64)> = rec
        .ranges
        .lock()
        .unwrap()
        .iter()
        .map(|(&a, &n)| (a, n))
        .collect();
    assert_eq!(
        announced,
        alloc.mapped_ranges(),
        "the hooks hold what the allocator lists"
    );
    // Memory back, wake again: the stuck chunk goes, its address is mapped and announced once.
    alloc.free(other).unwrap();
    alloc.empty_cache().unwrap();
    alloc.wake(&["t"], s).unwrap();
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    let errors = rec.errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "{errors:?}");
}
