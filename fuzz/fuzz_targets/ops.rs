//! Fuzz target `ops`: operation sequences on a simulated device, for every policy.
//!
//! The first input byte picks the setup: the policy (`byte % 3`: torch, torch-expandable,
//! default), one of four tunings of it (`byte / 3 % 4`: none, `max_split_size_mb:40`,
//! `garbage_collection_threshold:0.6`, `roundup_power2_divisions:4`) and the front (`byte / 12 %
//! 2`: the single-threaded [`Pool`], or the thread-safe [`CachingAllocator`]). The second byte
//! picks the device capacity (64 MiB .. 2 GiB). The rest is a sequence of [`Op`]s: allocate,
//! free, record the allocation on another stream, complete one stream's or every stream's work
//! (stream work completes only when told: `set_auto_complete(false)`), empty the cache, fail the
//! next device call or the next release call, change the memory cap, reset peaks, and bad calls (a double free of a freed
//! allocation, a free or `record_stream` of a pointer that was never handed out).
//!
//! Checked after every operation: `check_invariants()` of the pool (or of every shard) and of
//! the device; device outstanding bytes == reserved bytes (at least the reserved bytes once a
//! release call failed: pages unmapped but not released wait for a later call); every live allocation is 512-byte
//! aligned and no two overlap; the number of allocations the statistics count == the live ones;
//! errors are of the expected kind (out of memory with the request's figures; a device error only
//! once a fault was injected; `NotAllocated` for bad calls, which change nothing). At the end,
//! with faults cleared: everything frees, `empty_cache` returns every byte, and after drop the
//! device holds no memory, page, reservation or event.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use cudalloc::sizes::MAX_REQUEST;
use cudalloc::{AllocError, Allocation, CachingAllocator, Config, InvariantError, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const STREAMS: u8 = 4;
const TUNINGS: [&str; 4] = [
    "",
    "max_split_size_mb:40",
    "garbage_collection_threshold:0.6",
    "roundup_power2_divisions:4",
];

/// A request size, drawn from the size classes that matter.
#[derive(Arbitrary, Debug)]
enum Size {
    /// 0 ..= 2048 B (small pool, around the 512 B rounding).
    Tiny(u16),
    /// 0 .. 1 MiB + 4 KiB (the small pool and its edge).
    Small(u32),
    /// 1 MiB .. 97 MiB (large pool: 20 MiB segments, rounded segments, oversize).
    Large(u32),
    /// Any 64-bit size (what no device can hold).
    Huge(u64),
}

impl Size {
    fn bytes(&self) -> u64 {
        match *self {
            Size::Tiny(v) => u64::from(v) % 2049,
            Size::Small(v) => u64::from(v) % (MIB + 4096),
            Size::Large(v) => MIB + u64::from(v) % (96 * MIB),
            Size::Huge(v) => v,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        size: Size,
        stream: u8,
    },
    Free {
        pick: u16,
    },
    RecordStream {
        pick: u16,
        stream: u8,
    },
    CompleteStream {
        stream: u8,
    },
    CompleteAll,
    EmptyCache,
    FailNext,
    /// The next release call (free, unmap, page release, unreserve, event destroy) fails.
    FailRelease,
    /// A cap in MiB (`None`: no cap).
    SetLimit(Option<u16>),
    ResetPeak,
    /// Free an allocation that was already freed (when no live one has its address).
    DoubleFree {
        pick: u16,
    },
    /// Free and `record_stream` a pointer 512 B into a live allocation.
    ForeignPointer {
        pick: u16,
    },
}

/// The allocator under test: the pool itself, or the thread-safe front.
enum Target {
    Pool(Box<Pool<Arc<SimDevice>>>),
    Front(Box<CachingAllocator<Arc<SimDevice>>>),
}

impl Target {
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        match self {
            Target::Pool(p) => p.allocate(size, stream),
            Target::Front(f) => f.allocate(size, stream),
        }
    }

    fn free(&mut self, a: Allocation) -> Result<(), AllocError> {
        match self {
            Target::Pool(p) => p.free(a),
            Target::Front(f) => f.free(a),
        }
    }

    fn record_stream(&mut self, a: &Allocation, stream: StreamId) -> Result<(), AllocError> {
        match self {
            Target::Pool(p) => p.record_stream(a, stream),
            Target::Front(f) => f.record_stream(a.ptr(), stream),
        }
    }

    fn empty_cache(&mut self) -> Result<(), AllocError> {
        match self {
            Target::Pool(p) => p.empty_cache(),
            Target::Front(f) => f.empty_cache(),
        }
    }

    fn set_limit(&mut self, limit: Option<u64>) {
        match self {
            Target::Pool(p) => p.set_limit(limit),
            Target::Front(f) => f.set_memory_limit(limit),
        }
    }

    fn reset_peak(&mut self) {
        match self {
            Target::Pool(p) => p.reset_peak_stats(),
            Target::Front(f) => f.reset_peak_stats(),
        }
    }

    fn reserved(&self) -> u64 {
        match self {
            Target::Pool(p) => p.reserved(),
            Target::Front(f) => f.reserved_bytes(),
        }
    }

    fn check_invariants(&self) -> Result<(), InvariantError> {
        match self {
            Target::Pool(p) => p.check_invariants(),
            Target::Front(f) => f.check_invariants(),
        }
    }

    fn allocations(&self) -> u64 {
        let s = match self {
            Target::Pool(p) => p.stats().clone(),
            Target::Front(f) => f.stats(),
        };
        s.allocation.0[0].current as u64
    }

    /// Bytes the block behind `a` spans (the rounded request when the block is not visible).
    fn span(&self, a: &Allocation, cfg: &Config) -> u64 {
        match self {
            Target::Pool(p) => p.block(a.block()).map_or(0, |b| b.size),
            Target::Front(_) => cfg.pool().round_size(a.size()),
        }
    }
}

struct Run {
    sim: Arc<SimDevice>,
    cfg: Config,
    target: Target,
    live: Vec<Allocation>,
    freed: Vec<Allocation>,
    /// A device fault was injected at some point (device errors are expected from then on).
    faulted: bool,
    /// A release fault was injected at some point: the device may then hold pages the pool no
    /// longer counts (unmapped, not released) until a later call releases them.
    release_faulted: bool,
}

impl Run {
    fn new(setup: u8, capacity: u8) -> Run {
        let policy = Policy::ALL[setup as usize % 3];
        let tuning = TUNINGS[setup as usize / 3 % 4];
        let cfg = Config::parse_onto(Config::for_policy(policy), tuning).expect("tuning parses");
        let capacity = (64 * MIB) << (capacity % 6);
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(capacity)));
        sim.set_auto_complete(false);
        let target = if (setup / 12).is_multiple_of(2) {
            Target::Pool(Box::new(Pool::new(sim.clone(), cfg.clone())))
        } else {
            Target::Front(Box::new(CachingAllocator::new(sim.clone(), cfg.clone())))
        };
        Run {
            sim,
            cfg,
            target,
            live: Vec::new(),
            freed: Vec::new(),
            faulted: false,
            release_faulted: false,
        }
    }

    fn pick(&self, pick: u16) -> Option<usize> {
        (!self.live.is_empty()).then(|| pick as usize % self.live.len())
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Alloc { size, stream } => {
                self.alloc(size.bytes(), StreamId(u64::from(stream % STREAMS)))
            }
            Op::Free { pick } => {
                if let Some(i) = self.pick(*pick) {
                    self.free(i);
                }
            }
            Op::RecordStream { pick, stream } => {
                if let Some(i) = self.pick(*pick) {
                    let s = StreamId(u64::from(stream % STREAMS));
                    let a = &self.live[i];
                    self.target
                        .record_stream(a, s)
                        .expect("record_stream of a live allocation");
                }
            }
            Op::CompleteStream { stream } => self
                .sim
                .complete_stream(StreamId(u64::from(stream % STREAMS))),
            Op::CompleteAll => self.sim.complete_all(),
            Op::EmptyCache => {
                if let Err(e) = self.target.empty_cache() {
                    assert!(
                        self.faulted && matches!(e, AllocError::Device(_)),
                        "empty_cache: {e:?}"
                    );
                }
            }
            Op::FailNext => {
                self.sim.fail_next();
                self.faulted = true;
            }
            Op::FailRelease => {
                self.sim.fail_release(1);
                self.faulted = true;
                self.release_faulted = true;
            }
            Op::SetLimit(mib) => self.target.set_limit(mib.map(|m| u64::from(m) * MIB)),
            Op::ResetPeak => self.target.reset_peak(),
            Op::DoubleFree { pick } => {
                if self.freed.is_empty() {
                    return;
                }
                // A second handle to a freed allocation, which only the `testing` feature makes.
                let a = self.freed[*pick as usize % self.freed.len()].duplicate();
                let ptr = a.ptr();
                if self.live.iter().any(|l| l.ptr() == ptr) {
                    return; // the address was handed out again: a free by it is legitimate
                }
                let r = self.target.record_stream(&a, StreamId(1));
                assert_eq!(
                    r,
                    Err(AllocError::NotAllocated(ptr)),
                    "record_stream after free"
                );
                assert_eq!(
                    self.target.free(a),
                    Err(AllocError::NotAllocated(ptr)),
                    "double free"
                );
            }
            Op::ForeignPointer { pick } => {
                if let Some(i) = self.pick(*pick) {
                    let l = &self.live[i];
                    let ptr = l.ptr() + 512;
                    let a = Allocation::forge(ptr, l.size(), l.stream(), l.block(), l.serial());
                    if self.live.iter().any(|l| l.ptr() == ptr) {
                        return; // that address is another live allocation
                    }
                    let r = self.target.record_stream(&a, StreamId(1));
                    assert_eq!(r, Err(AllocError::NotAllocated(ptr)));
                    assert_eq!(self.target.free(a), Err(AllocError::NotAllocated(ptr)));
                }
            }
        }
    }

    fn alloc(&mut self, size: u64, stream: StreamId) {
        match self.target.allocate(size, stream) {
            Ok(a) => {
                assert_eq!(a.ptr() % 512, 0, "allocation not 512-byte aligned");
                assert_eq!((a.size(), a.stream()), (size, stream));
                self.live.push(a);
            }
            Err(AllocError::OutOfMemory {
                requested,
                rounded,
                reserved,
                ..
            }) => {
                assert_eq!(requested, size);
                assert!(rounded >= size, "rounded {rounded} < requested {size}");
                match self.target {
                    Target::Pool(_) => assert_eq!(reserved, self.target.reserved()),
                    Target::Front(_) => assert!(reserved <= self.target.reserved()),
                }
            }
            Err(AllocError::Device(e)) => assert!(self.faulted, "device error with no fault: {e}"),
            Err(AllocError::TooLarge { requested, limit }) => {
                assert_eq!((requested, limit), (size, MAX_REQUEST));
                assert!(size > MAX_REQUEST, "allocate({size}): too large");
            }
            Err(e) => panic!("allocate({size}): unexpected {e:?}"),
        }
    }

    fn free(&mut self, i: usize) {
        // A failed free leaves the allocation live: `live` keeps its handle until one succeeds.
        let ptr = self.live[i].ptr();
        match self.target.free(self.live[i].duplicate()) {
            Ok(()) => {
                let a = self.live.swap_remove(i);
                if self.freed.len() == 16 {
                    self.freed.remove(0);
                }
                self.freed.push(a);
            }
            Err(AllocError::Device(e)) => {
                assert!(self.faulted, "free: device error with no fault: {e}")
            }
            Err(e) => panic!("free({ptr:#x}): unexpected {e:?}"),
        }
    }

    fn check(&self, what: &dyn std::fmt::Debug) {
        if let Err(e) = self.target.check_invariants() {
            panic!("after {what:?}: {e}");
        }
        self.sim.check_invariants();
        let (outstanding, reserved) = (self.sim.outstanding_bytes(), self.target.reserved());
        if self.release_faulted {
            assert!(
                outstanding >= reserved,
                "after {what:?}: device outstanding {outstanding} < reserved {reserved}"
            );
        } else {
            assert_eq!(
                outstanding, reserved,
                "after {what:?}: device outstanding != reserved"
            );
        }
        assert_eq!(
            self.target.allocations(),
            self.live.len() as u64,
            "after {what:?}"
        );
        let mut spans: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|a| (a.ptr(), self.target.span(a, &self.cfg)))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "after {what:?}: live allocations overlap: {w:?}"
            );
        }
    }

    fn finish(mut self) {
        self.sim.clear_faults();
        self.target.set_limit(None);
        for a in std::mem::take(&mut self.live) {
            self.target.free(a).expect("free with faults cleared");
        }
        self.sim.complete_all();
        self.target
            .empty_cache()
            .expect("empty_cache with faults cleared");
        self.check(&"finish");
        assert_eq!(
            self.target.reserved(),
            0,
            "reserved after freeing everything and empty_cache"
        );
        let sim = self.sim.clone();
        drop(self);
        sim.check_invariants();
        assert_eq!(sim.outstanding_bytes(), 0, "outstanding after drop");
        assert_eq!(sim.live_pages(), 0, "pages after drop");
        assert_eq!(sim.reserved_va_bytes(), 0, "reservations after drop");
        assert_eq!(sim.live_events(), 0, "events after drop");
    }
}

fuzz_target!(|data: &[u8]| cudalloc_fuzz::tolerating_known_bugs(|| {
    if data.len() < 2 {
        return;
    }
    let mut run = Run::new(data[0], data[1]);
    let mut u = Unstructured::new(&data[2..]);
    while !u.is_empty() {
        let Ok(op) = Op::arbitrary(&mut u) else {
            break;
        };
        run.step(&op);
        run.check(&op);
    }
    run.finish();
}));
