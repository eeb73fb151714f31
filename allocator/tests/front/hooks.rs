//! Map hooks against a model: random sequences of allocations (untagged, tagged and from a
//! graph pool), frees, `empty_cache`, sleep and wake, injected faults (acquiring calls and
//! releases) and hooks replaced midway, on every policy. A recorder checks each call as it
//! comes and the whole picture after every step:
//! - a range is announced once it is mapped and accessible (or `malloc`'d), never twice
//!   without its withdrawal between, and withdrawn while it is still mapped, naming exactly
//!   what was announced;
//! - after every step the announced ranges are exactly what the allocators list
//!   ([`CachingAllocator::mapped_ranges`]), all of them mapped and accessible on the device, and
//!   they are all of the device's accessible pages and segments (one allocator and its graph
//!   pool on the device) unless a release fault left a chunk mapped that nothing uses;
//! - every byte of every live allocation lies in an announced range;
//! - hooks replaced get every range withdrawn, their successors every range announced; at the
//!   end, after every free and the allocators' drop, nothing is announced.

use cudalloc::{Allocation, CachingAllocator, Config, MapHooks, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;

/// Announced ranges, checked against the device at each call.
struct Recorder {
    dev: Arc<SimDevice>,
    ranges: Mutex<BTreeMap<u64, u64>>,
    errors: Mutex<Vec<String>>,
}

impl Recorder {
    fn new(dev: &Arc<SimDevice>) -> Arc<Recorder> {
        Arc::new(Recorder {
            dev: dev.clone(),
            ranges: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(Vec::new()),
        })
    }

    fn fail(&self, msg: String) {
        self.errors.lock().unwrap().push(msg);
    }

    fn ranges(&self) -> Vec<(u64, u64)> {
        self.ranges
            .lock()
            .unwrap()
            .iter()
            .map(|(&a, &n)| (a, n))
            .collect()
    }

    fn covers(&self, addr: u64, size: u64) -> bool {
        let ranges = self.ranges.lock().unwrap();
        let mut at = addr;
        while at < addr + size {
            match ranges.range(..=at).next_back() {
                Some((&a, &n)) if a + n > at => at = a + n,
                _ => return false,
            }
        }
        true
    }
}

impl MapHooks for Recorder {
    fn mapped(&self, device: usize, addr: u64, size: u64) {
        if device != 0 {
            self.fail(format!("device {device}"));
        }
        if !self.dev.accessible_ranges().contains(&(addr, size)) {
            self.fail(format!(
                "{addr:#x}+{size} announced but not mapped and accessible"
            ));
        }
        let mut ranges = self.ranges.lock().unwrap();
        let before = ranges.range(..addr + size).next_back();
        if before.is_some_and(|(&a, &n)| a + n > addr) {
            self.fail(format!(
                "{addr:#x}+{size} announced over an announced range"
            ));
        }
        ranges.insert(addr, size);
    }

    fn unmapping(&self, _device: usize, addr: u64, size: u64) {
        if self.ranges.lock().unwrap().remove(&addr) != Some(size) {
            self.fail(format!("{addr:#x}+{size} withdrawn but not announced so"));
        }
        if !self.dev.accessible_ranges().contains(&(addr, size)) {
            self.fail(format!("{addr:#x}+{size} withdrawn after its unmap"));
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Owner {
    Untagged,
    Tag,
    Graph,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        mib: u64,
        stream: u64,
        tagged: bool,
        graph: bool,
    },
    Free(usize),
    EmptyCache,
    FailNext,
    FailRelease,
    Sleep,
    Wake,
    Rehook,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1..40u64, 0..2u64, any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(mib, stream, tagged, graph)| Op::Alloc { mib, stream, tagged, graph }),
        5 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::FailNext),
        1 => Just(Op::FailRelease),
        1 => Just(Op::Sleep),
        1 => Just(Op::Wake),
        1 => Just(Op::Rehook),
    ]
}

struct World {
    dev: Arc<SimDevice>,
    alloc: CachingAllocator<Arc<SimDevice>>,
    graph: CachingAllocator<Arc<SimDevice>>,
    /// Live allocations and who made them.
    live: Vec<(Allocation, Owner)>,
    hooks: Arc<Recorder>,
    asleep: bool,
    /// A release fault was armed at some step.
    release_failed: bool,
}

impl World {
    fn step(&mut self, op: &Op) {
        let s = |n: u64| StreamId(n);
        match *op {
            Op::Alloc {
                mib,
                stream,
                tagged,
                graph,
            } => {
                let size = mib * MIB - 4096;
                let (a, owner) = match (graph, tagged) {
                    (true, _) => (self.graph.allocate(size, s(stream)), Owner::Graph),
                    (false, true) if !self.asleep => {
                        (self.alloc.allocate_tagged(size, s(0), "t"), Owner::Tag)
                    }
                    (false, true) => return,
                    (false, false) => (self.alloc.allocate(size, s(stream)), Owner::Untagged),
                };
                if let Ok(a) = a {
                    self.live.push((a, owner));
                }
            }
            Op::Free(i) if !self.live.is_empty() => {
                let (a, owner) = self.live.swap_remove(i % self.live.len());
                let from = if owner == Owner::Graph {
                    &self.graph
                } else {
                    &self.alloc
                };
                if from.free(a.duplicate()).is_err() {
                    // A sleeping tag's allocation, or a release fault: it stays live.
                    self.live.push((a, owner));
                }
            }
            Op::Free(_) => {}
            Op::EmptyCache => {
                let _ = self.alloc.empty_cache();
                let _ = self.graph.empty_cache();
            }
            Op::FailNext => self.dev.fail_next(),
            Op::FailRelease => {
                self.dev.fail_release(1);
                self.release_failed = true;
            }
            // An incomplete sleep (`SleepIncomplete`) leaves the tag asleep too: ask it.
            Op::Sleep => {
                let _ = self.alloc.sleep(&["t"], &[]);
                self.asleep = self.alloc.is_asleep("t");
            }
            Op::Wake => {
                let _ = self.alloc.wake(&["t"], StreamId(0));
                self.asleep = self.alloc.is_asleep("t");
            }
            Op::Rehook => {
                let next = Recorder::new(&self.dev);
                self.alloc.set_map_hooks(Some(next.clone()));
                self.graph.set_map_hooks(Some(next.clone()));
                let old = std::mem::replace(&mut self.hooks, next);
                assert_eq!(old.ranges(), Vec::new(), "replaced hooks keep no range");
                assert_eq!(old.errors.lock().unwrap().clone(), Vec::<String>::new());
            }
        }
    }

    fn check(&self, step: usize) {
        let errors = self.hooks.errors.lock().unwrap().clone();
        assert_eq!(errors, Vec::<String>::new(), "step {step}");
        let announced = self.hooks.ranges();
        let accessible = self.dev.accessible_ranges();
        for r in &announced {
            assert!(
                accessible.contains(r),
                "step {step}: {r:?} announced, not accessible"
            );
        }
        // A chunk whose unmap failed while nothing used it (a wake rolled back) stays mapped,
        // withdrawn: only a release fault leaves one.
        let unannounced = accessible.iter().filter(|r| !announced.contains(r)).count();
        assert!(
            unannounced == 0 || self.release_failed,
            "step {step}: the device"
        );
        let mut listed = self.alloc.mapped_ranges();
        listed.extend(self.graph.mapped_ranges());
        listed.sort_unstable();
        assert_eq!(announced, listed, "step {step}: the allocators' lists");
        for (a, owner) in &self.live {
            if !(self.asleep && *owner == Owner::Tag) {
                assert!(
                    self.hooks.covers(a.ptr(), a.size()),
                    "step {step}: {:#x}",
                    a.ptr()
                );
            }
        }
    }
}

fn run(policy: Policy, ops: &[Op]) {
    let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(192 * MIB)));
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
    let hooks = Recorder::new(&dev);
    alloc.set_map_hooks(Some(hooks.clone()));
    let graph = alloc.graph_pool();
    let mut w = World {
        dev,
        alloc,
        graph,
        live: Vec::new(),
        hooks,
        asleep: false,
        release_failed: false,
    };
    for (i, op) in ops.iter().enumerate() {
        w.step(op);
        if !matches!(op, Op::FailNext | Op::FailRelease) {
            w.dev.clear_faults(); // an armed fault hits the next step
        }
        w.check(i);
    }
    w.dev.clear_faults();
    let (tagged, others): (Vec<_>, Vec<_>) = std::mem::take(&mut w.live)
        .into_iter()
        .partition(|(_, o)| *o == Owner::Tag);
    for (a, owner) in others {
        let from = if owner == Owner::Graph {
            &w.graph
        } else {
            &w.alloc
        };
        from.free(a).unwrap();
    }
    if w.asleep {
        w.graph.empty_cache().unwrap();
        w.alloc.empty_cache().unwrap();
        w.alloc.wake(&["t"], StreamId(0)).unwrap();
    }
    for (a, _) in tagged {
        w.alloc.free(a).unwrap();
    }
    w.check(ops.len());
    let World {
        alloc,
        graph,
        hooks,
        ..
    } = w;
    drop(graph);
    drop(alloc);
    assert_eq!(hooks.errors.lock().unwrap().clone(), Vec::<String>::new());
    assert_eq!(
        hooks.ranges(),
        Vec::new(),
        "everything withdrawn at the end"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_mapped_byte_is_announced_and_withdrawn_before_its_unmap(
        policy in prop_oneof![Just(Policy::Torch), Just(Policy::TorchExpandable), Just(Policy::Default)],
        ops in prop::collection::vec(op(), 1..=80),
    ) {
        run(policy, &ops);
    }
}

/// Hooks replaced while pages moved to a growth are still mapped at their old addresses (the
/// device runs behind): the old hooks hear those addresses withdrawn, the new ones hear them
/// announced, so that the later unmap withdraws from the new hooks only what they were told of.
#[test]
fn hooks_replaced_while_moved_pages_are_mapped_hear_of_them() {
    use cudalloc::config::{DefaultConfig, PolicyConfig};
    use cudalloc::FrontConfig;
    let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(16 << 30)));
    let mut d = DefaultConfig {
        max_chunk: 2 * MIB,
        fragmentation_budget: 0.75,
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.move_pages = true;
    let front = FrontConfig {
        thread_cache: Some(false),
        ..FrontConfig::default()
    };
    let cfg = Config::default()
        .with_policy(PolicyConfig::Default(d))
        .unwrap();
    let alloc = CachingAllocator::new(dev.clone(), cfg.with_front(front).unwrap());
    let s = StreamId(0);
    let loaded = alloc.allocate(512, s).unwrap();
    alloc.free(loaded).unwrap();
    alloc.empty_cache().unwrap();
    dev.set_auto_complete(false);
    let old = Recorder::new(&dev);
    alloc.set_map_hooks(Some(old.clone()));
    let large = alloc.allocate(30 * MIB, s).unwrap();
    let kept = alloc.allocate(2 * MIB, s).unwrap();
    let small = alloc.allocate(6 * MIB, s).unwrap();
    let kept2 = alloc.allocate(2 * MIB, s).unwrap();
    alloc.free(large).unwrap();
    alloc.free(small).unwrap();
    let grown = alloc.allocate(34 * MIB, s).unwrap();
    assert!(alloc.stats().pages_moved > 0, "the growth moved pages");
    let mapped: u64 = alloc.mapped_ranges().iter().map(|r| r.1).sum();
    assert_eq!(mapped, dev.mapped_bytes(), "every mapped range listed");
    let new = Recorder::new(&dev);
    alloc.set_map_hooks(Some(new.clone()));
    assert_eq!(old.ranges(), Vec::new(), "all withdrawn from the old hooks");
    dev.complete_all();
    let poll = alloc.allocate(512, s).unwrap();
    for a in [kept, kept2, grown, poll] {
        alloc.free(a).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(new.errors.lock().unwrap().clone(), Vec::<String>::new());
    assert_eq!(old.errors.lock().unwrap().clone(), Vec::<String>::new());
    assert_eq!(new.ranges(), Vec::new(), "all withdrawn at the end");
}
