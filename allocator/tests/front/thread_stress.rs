//! Thread stress (testing tier 5): one `CachingAllocator<Arc<SimDevice>>` with host backing shared
//! by 16 threads doing 20,000 operations each, for every policy.
//!
//! Threads allocate, write a cookie (unique per allocation) at both ends of the block, and free
//! either their own allocations or ones other threads handed over through a shared queue; some
//! allocations are recorded on other streams first; now and then a thread empties the cache or
//! takes a snapshot.
//!
//! Invariants checked:
//! - every cookie reads back unchanged when its allocation is freed, by whichever thread: no two
//!   live blocks overlap and no block is handed out twice, under any interleaving;
//! - every pointer is 512-aligned; frees of live pointers never fail; the only allocation error is
//!   out of memory;
//! - a memory limit holds for all streams together under concurrent allocation;
//! - `check_invariants` holds at the end, and called while other threads run it reports no
//!   violation that does not exist; a snapshot taken while other threads run agrees with its own
//!   statistics (`recompute() == recorded()`, blocks in thread caches included);
//! - at the end, after every free: `allocation.all.current == 0`, allocated and active bytes are 0,
//!   `empty_cache` returns every byte (device outstanding bytes == 0), and dropping the allocator
//!   leaves no event or reservation behind.
//!
//! The thread caches one thread at a time: `thread_caches.rs`.

use cudalloc::stats::StatType;
use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::{Arc, Mutex};

const THREADS: u64 = 16;
const OPS: u64 = 20_000;
const MAX_LOCAL: usize = 32;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

use crate::common;
use common::Rng;

/// Request sizes for this file's sequences.
trait Sizes {
    fn size(&mut self) -> u64;
}

impl Sizes for Rng {
    fn size(&mut self) -> u64 {
        match self.below(20) {
            0..=8 => self.below(2049),
            9..=17 => KIB + self.below(255 * KIB),
            _ => 256 * KIB + self.below(4 * MIB - 256 * KIB),
        }
    }
}

/// One live allocation and its cookie.
struct Tagged {
    a: Allocation,
    cookie: u64,
}

type Alloc = CachingAllocator<Arc<SimDevice>>;

/// Where the cookie goes: the first 8 bytes, and the last 8 of the request when it has 16.
fn spots(a: &Allocation) -> Vec<u64> {
    if a.size() >= 16 {
        vec![a.ptr(), a.ptr() + a.size() - 8]
    } else {
        vec![a.ptr()]
    }
}

fn write_cookie(sim: &SimDevice, t: &Tagged) {
    for at in spots(&t.a) {
        sim.write(at, &t.cookie.to_le_bytes()).unwrap();
    }
}

fn check_cookie(sim: &SimDevice, t: &Tagged) {
    for at in spots(&t.a) {
        let mut buf = [0u8; 8];
        sim.read(at, &mut buf).unwrap();
        assert_eq!(
            u64::from_le_bytes(buf),
            t.cookie,
            "cookie of {:#x}+{} at {at:#x} was overwritten",
            t.a.ptr(),
            t.a.size()
        );
    }
}

fn free_checked(alloc: &Alloc, sim: &SimDevice, t: Tagged) {
    check_cookie(sim, &t);
    let ptr = t.a.ptr();
    alloc
        .free(t.a)
        .unwrap_or_else(|e| panic!("free of live {ptr:#x}: {e:?}"));
}

fn worker(id: u64, alloc: &Alloc, sim: &SimDevice, shared: &Mutex<Vec<Tagged>>) {
    let mut rng = Rng(0x7431_0000 + id);
    let mut local: Vec<Tagged> = Vec::new();
    let home = StreamId(id % 4);
    for n in 0..OPS {
        let r = rng.below(100);
        if r < 46 && local.len() < MAX_LOCAL {
            let size = rng.size();
            let stream = if rng.below(8) == 0 {
                StreamId(rng.below(4))
            } else {
                home
            };
            match alloc.allocate(size, stream) {
                Ok(a) => {
                    assert_eq!(a.ptr() % 512, 0);
                    let t = Tagged {
                        a,
                        cookie: (id << 48) ^ n ^ 0x00c0_ffee_0000_0000,
                    };
                    write_cookie(sim, &t);
                    if rng.below(2) == 0 {
                        shared.lock().unwrap().push(t);
                    } else {
                        local.push(t);
                    }
                }
                Err(AllocError::OutOfMemory { .. }) => {}
                Err(e) => panic!("thread {id}: allocate({size}): {e:?}"),
            }
        } else if r < 70 {
            if !local.is_empty() {
                let i = rng.below(local.len() as u64) as usize;
                let t = local.swap_remove(i);
                if rng.below(6) == 0 {
                    alloc
                        .record_stream(t.a.ptr(), StreamId(rng.below(4)))
                        .unwrap();
                }
                free_checked(alloc, sim, t);
            }
        } else if r < 96 {
            let taken = shared.lock().unwrap().pop();
            if let Some(t) = taken {
                free_checked(alloc, sim, t);
            }
        } else if r < 97 {
            alloc.empty_cache().unwrap();
        } else if r < 98 {
            let snap = alloc.snapshot();
            assert_eq!(snap.recompute(), snap.recorded(), "thread {id}: a snapshot");
            let _ = snap.fragmentation();
            let _ = alloc.stats();
        }
    }
    for t in local {
        free_checked(alloc, sim, t);
    }
}

fn stress(policy: Policy) {
    let cfg = SimConfig::with_capacity(4 * GIB).host_backing(true);
    let sim = Arc::new(SimDevice::new(cfg));
    let alloc = CachingAllocator::new(sim.clone(), Config::for_policy(policy));
    let shared = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for id in 0..THREADS {
            let (alloc, sim, shared) = (&alloc, &sim, &shared);
            s.spawn(move || worker(id, alloc, sim, shared));
        }
    });
    let rest = std::mem::take(&mut *shared.lock().unwrap());
    for t in rest {
        free_checked(&alloc, &sim, t);
    }
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.allocation.get(StatType::All).current, 0);
    assert_eq!(stats.allocated_bytes.get(StatType::All).current, 0);
    assert_eq!(sim.outstanding_bytes(), alloc.reserved_bytes());
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    let count = stats.allocation.get(StatType::All);
    assert!(count.allocated > (THREADS * OPS / 8) as i64, "{count:?}");
    assert_eq!(count.allocated, count.freed);
    assert_eq!(stats.active.get(StatType::All).current, 0);
    assert_eq!(stats.active_bytes.get(StatType::All).current, 0);
    assert_eq!(stats.requested_bytes.get(StatType::All).current, 0);
    assert_eq!(alloc.reserved_bytes(), 0);
    assert_eq!(sim.outstanding_bytes(), 0);
    drop(alloc);
    sim.check_invariants();
    assert_eq!(sim.live_events(), 0);
    assert_eq!(sim.reserved_va_bytes(), 0);
}

#[test]
fn sixteen_threads_torch() {
    stress(Policy::Torch);
}

#[test]
fn sixteen_threads_torch_expandable() {
    stress(Policy::TorchExpandable);
}

#[test]
fn sixteen_threads_default() {
    stress(Policy::Default);
}

/// `check_invariants` compares the shards with the shared reserved counter and the live table;
/// called while other threads allocate and free, it must not report a violation that does not
/// exist (it has to look at one consistent state).
#[test]
fn check_invariants_is_consistent_while_threads_run() {
    for policy in Policy::ALL {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
        let alloc = CachingAllocator::new(sim.clone(), Config::for_policy(policy));
        let done = std::sync::atomic::AtomicBool::new(false);
        let errors = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..8u64)
                .map(|id| {
                    let alloc = &alloc;
                    s.spawn(move || {
                        let mut rng = Rng(id + 1);
                        let mut mine = Vec::new();
                        for _ in 0..20_000 {
                            if mine.len() < 16 && rng.below(2) == 0 {
                                let size = 2 * MIB + rng.below(30 * MIB);
                                if let Ok(a) = alloc.allocate(size, StreamId(id)) {
                                    mine.push(a);
                                }
                            } else if let Some(a) = mine.pop() {
                                alloc.free(a).unwrap();
                            }
                            if rng.below(64) == 0 {
                                alloc.empty_cache().unwrap();
                            }
                        }
                        for a in mine {
                            alloc.free(a).unwrap();
                        }
                    })
                })
                .collect();
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Err(e) = alloc.check_invariants() {
                        errors.lock().unwrap().push(e);
                    }
                }
            });
            for w in workers {
                w.join().unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let errors = errors.into_inner().unwrap();
        assert!(
            errors.is_empty(),
            "{policy:?}: {} false violations while threads ran, e.g. {:?}",
            errors.len(),
            errors.first()
        );
        alloc.check_invariants().unwrap();
    }
}

/// A memory limit caps the bytes held from the device by all streams together, also while
/// threads on different streams (different shards) allocate at the same time.
#[test]
fn memory_limit_holds_across_streams() {
    const LIMIT: u64 = 256 * MIB;
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    let alloc = CachingAllocator::new(sim.clone(), Config::for_policy(Policy::Torch));
    alloc.set_memory_limit(Some(LIMIT));
    let peak = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for id in 0..THREADS {
            let (alloc, sim, peak) = (&alloc, &sim, &peak);
            s.spawn(move || {
                let mut rng = Rng(0x11 + id);
                let mut mine = Vec::new();
                for _ in 0..5_000 {
                    // 10..30 MiB in 2 MiB steps: every request is a segment of its own size.
                    let size = (5 + rng.below(11)) * 2 * MIB;
                    match alloc.allocate(size, StreamId(id)) {
                        Ok(a) => {
                            let held = sim.outstanding_bytes().max(alloc.reserved_bytes());
                            peak.fetch_max(held, std::sync::atomic::Ordering::Relaxed);
                            mine.push(a);
                        }
                        Err(AllocError::OutOfMemory { .. }) => {}
                        Err(e) => panic!("{e:?}"),
                    }
                    if mine.len() > 2 || (rng.below(2) == 0 && !mine.is_empty()) {
                        let i = rng.below(mine.len() as u64) as usize;
                        alloc.free(mine.swap_remove(i)).unwrap();
                    }
                    if rng.below(4) == 0 {
                        // Keep the device busy: cached segments go back, new ones come.
                        alloc.empty_cache().unwrap();
                    }
                }
                for a in mine {
                    alloc.free(a).unwrap();
                }
            });
        }
    });
    let peak = peak.into_inner();
    assert!(
        peak <= LIMIT,
        "{} MiB held from the device under a {} MiB limit",
        peak >> 20,
        LIMIT >> 20
    );
    alloc.check_invariants().unwrap();
}

#[test]
fn allocator_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Alloc>();
}

/// Blocks left in the cache of a thread that exited go back to their pool: a later allocation
/// of the same size on another thread reuses them instead of asking the device for more
/// (64 MiB blocks: the large part of the thread caches).
#[test]
fn caches_of_exited_threads_are_adopted() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    let alloc = CachingAllocator::new(sim.clone(), Config::for_policy(Policy::Default));
    for _ in 0..8 {
        // Joined explicitly: a thread's cache is orphaned by its thread-local destructors,
        // which have run once `join` returns (the end of `scope` does not wait for them).
        std::thread::scope(|s| {
            s.spawn(|| {
                let a = alloc.allocate(64 * MIB, StreamId(1)).unwrap();
                alloc.free(a).unwrap();
            })
            .join()
            .unwrap();
        });
    }
    let a = alloc.allocate(64 * MIB, StreamId(1)).unwrap();
    assert!(
        alloc.reserved_bytes() <= 128 * MIB,
        "{} MiB reserved: blocks of exited threads were not reused",
        alloc.reserved_bytes() >> 20
    );
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
}
