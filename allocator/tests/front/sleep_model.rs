//! A stateful property test of tags, sleep and wake against a model of the live allocations:
//! random allocations of two tags and untagged memory, frees, sleeps (offloaded or not), wakes
//! (some failing for lack of memory: the device is small), `empty_cache`, the release of the
//! host buffers and injected faults (a failed acquiring call or a refused release in the next
//! step) on a simulated device with host backing. After every step the allocator's and the device's
//! invariants hold, the device holds exactly the reserved bytes, a sleeping tag refuses
//! allocations and frees, a failed wake leaves its tag asleep, and every awake allocation reads
//! back the bytes written into it (an offloaded tag's across its sleeps; a tag woken without
//! offload is written again).

use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use proptest::prelude::*;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// The tags; index 2 means untagged.
const TAGS: [&str; 2] = ["weights", "kv"];

#[derive(Clone, Debug)]
enum Op {
    Alloc { tag: usize, size: u64 },
    Free { pick: usize },
    Sleep { tag: usize, offload: bool },
    Wake { tag: usize },
    EmptyCache,
    ReleaseHostBuffers,
    FailNext,
    FailRelease,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![3 => 1u64..4096, 3 => 4096u64..2 * MIB, 2 => 2 * MIB..12 * MIB];
    prop_oneof![
        8 => (0usize..3, size).prop_map(|(tag, size)| Op::Alloc { tag, size }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (0usize..2, any::<bool>()).prop_map(|(tag, offload)| Op::Sleep { tag, offload }),
        3 => (0usize..2).prop_map(|tag| Op::Wake { tag }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ReleaseHostBuffers),
        1 => Just(Op::FailNext),
        1 => Just(Op::FailRelease),
    ]
}

struct Live {
    a: Allocation,
    tag: usize,
    seed: u64,
}

struct Model {
    dev: Arc<SimDevice>,
    alloc: CachingAllocator<Arc<SimDevice>>,
    live: Vec<Live>,
    asleep: [bool; 2],
    offloaded: [bool; 2],
    seeds: u64,
}

/// The first and last bytes of an allocation carry the pattern (enough to catch a lost or moved
/// page, cheap for large blocks).
fn spots(a: &Allocation) -> [(u64, usize); 2] {
    let n = a.size().min(256);
    [(a.ptr(), n as usize), (a.ptr() + a.size() - n, n as usize)]
}

/// The bytes at `at..at + len` of an allocation numbered `seed`: a function of the address, so
/// that overlapping spots agree.
fn pattern(len: usize, seed: u64, at: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((at + i).wrapping_mul(0x9E37_79B9) >> 7 ^ seed.wrapping_mul(131)) as u8)
        .collect()
}

impl Model {
    fn write(&self, l: &Live) {
        for (at, n) in spots(&l.a) {
            self.dev.write(at, &pattern(n, l.seed, at)).unwrap();
        }
    }

    fn holds(&self, l: &Live) -> bool {
        spots(&l.a).iter().all(|&(at, n)| {
            let mut back = vec![0u8; n];
            self.dev.read(at, &mut back).unwrap();
            back == pattern(n, l.seed, at)
        })
    }

    fn awake(&self, tag: usize) -> bool {
        tag == 2 || !self.asleep[tag]
    }

    fn step(&mut self, op: &Op) {
        let s = StreamId(1);
        match *op {
            Op::Alloc { tag, size } => {
                let r = if tag == 2 {
                    self.alloc.allocate(size, s)
                } else {
                    self.alloc.allocate_tagged(size, s, TAGS[tag])
                };
                match r {
                    Ok(a) => {
                        assert!(self.awake(tag), "a sleeping tag allocated");
                        self.seeds += 1;
                        let l = Live {
                            a,
                            tag,
                            seed: self.seeds,
                        };
                        self.write(&l);
                        self.live.push(l);
                    }
                    Err(AllocError::Asleep { .. }) => assert!(!self.awake(tag)),
                    Err(e) => assert!(e.is_out_of_memory() || is_fault(&e), "{e}"),
                }
            }
            Op::Free { pick } if !self.live.is_empty() => {
                let i = pick % self.live.len();
                let tag = self.live[i].tag;
                // A free while the tag sleeps is taken at once (its block goes back at the
                // wake); a fault leaves the allocation live.
                match self.alloc.free_ptr(self.live[i].a.ptr()) {
                    Ok(()) => {
                        self.live.swap_remove(i);
                    }
                    Err(e) => assert!(is_fault(&e) && self.awake(tag), "{e}"),
                }
            }
            Op::Free { .. } => {}
            Op::Sleep { tag, offload } => {
                let off: &[&str] = if offload { &[TAGS[tag]] } else { &[] };
                match self.alloc.sleep(&[TAGS[tag]], off) {
                    // An unmap refused after the copies: asleep all the same.
                    Ok(()) | Err(AllocError::SleepIncomplete { .. }) => {
                        if !self.asleep[tag] {
                            self.offloaded[tag] = offload;
                        }
                        self.asleep[tag] = true;
                    }
                    Err(e) => assert!(is_fault(&e), "{e}"),
                }
            }
            Op::Wake { tag } => match self.alloc.wake(&[TAGS[tag]], s) {
                Ok(()) => self.woke(tag),
                Err(e) => {
                    assert!(e.is_out_of_memory() || is_fault(&e), "{e}");
                    assert!(self.alloc.is_asleep(TAGS[tag]), "a failed wake woke");
                }
            },
            Op::EmptyCache => {
                if let Err(e) = self.alloc.empty_cache() {
                    assert!(is_fault(&e), "{e}");
                }
            }
            Op::ReleaseHostBuffers => {
                if let Err(e) = self.alloc.release_host_buffers() {
                    assert!(is_fault(&e), "{e}");
                }
            }
            // Armed for the next step.
            Op::FailNext => return self.dev.fail_next(),
            Op::FailRelease => return self.dev.fail_release(1),
        }
        self.dev.clear_faults();
        self.check();
    }

    /// After a successful wake of `tag`: a tag not offloaded lost its bytes, written again.
    fn woke(&mut self, tag: usize) {
        let was_asleep = std::mem::replace(&mut self.asleep[tag], false);
        if was_asleep && !self.offloaded[tag] {
            for l in self.live.iter().filter(|l| l.tag == tag) {
                self.write(l);
            }
        }
    }

    fn check(&self) {
        self.alloc.check_invariants().unwrap();
        self.dev.check_invariants();
        assert_eq!(self.dev.outstanding_bytes(), self.alloc.reserved_bytes());
        for (t, name) in TAGS.iter().enumerate() {
            assert_eq!(self.alloc.is_asleep(name), self.asleep[t]);
        }
        for l in self.live.iter().filter(|l| self.awake(l.tag)) {
            assert!(
                self.holds(l),
                "allocation {:#x} of tag {} lost bytes",
                l.a.ptr(),
                l.tag
            );
        }
    }
}

/// An injected fault, as the simulated device reports it (a driver error, or an out-of-memory).
fn is_fault(e: &AllocError) -> bool {
    matches!(e, AllocError::Device(_)) || e.is_out_of_memory()
}

fn run(policy: Policy, capacity: u64, ops: &[Op]) {
    let dev = Arc::new(SimDevice::new(
        SimConfig::with_capacity(capacity).host_backing(true),
    ));
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
    let mut m = Model {
        dev,
        alloc,
        live: Vec::new(),
        asleep: [false; 2],
        offloaded: [false; 2],
        seeds: 0,
    };
    for op in ops {
        m.step(op);
    }
    m.dev.clear_faults();
    for (tag, name) in TAGS.iter().enumerate() {
        while m.asleep[tag] {
            // Free untagged memory until the wake fits.
            if m.alloc.wake(&[name], StreamId(1)).is_ok() {
                m.woke(tag);
                continue;
            }
            let i = m
                .live
                .iter()
                .position(|l| m.awake(l.tag))
                .expect("memory to free");
            let l = m.live.swap_remove(i);
            m.alloc.free(l.a).unwrap();
        }
    }
    m.check();
    for l in m.live.drain(..) {
        m.alloc.free(l.a).unwrap();
    }
    m.alloc.empty_cache().unwrap();
    m.check();
    assert_eq!(m.dev.outstanding_bytes(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tags_sleep_and_wake_lose_no_byte(
        expandable in any::<bool>(),
        capacity in prop_oneof![Just(64 * MIB), Just(160 * MIB)],
        ops in prop::collection::vec(op(), 1..=120),
    ) {
        let policy = if expandable { Policy::TorchExpandable } else { Policy::Default };
        run(policy, capacity, &ops);
    }
}
