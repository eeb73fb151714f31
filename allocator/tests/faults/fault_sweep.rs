//! Fault sweep (testing tier 3): one fixed sequence of 1,000 operations, replayed once for every
//! device call it makes, with exactly that call failing.
//!
//! The sequence is drawn once from a fixed seed (SplitMix64): allocations of mixed sizes (0 B,
//! 1..2 KiB, 1 KiB..1 MiB, 1..64 MiB) on three streams, frees, `record_stream` on another stream
//! followed by a free, completion of one stream's work (`set_auto_complete(false)`: events
//! complete only when told), `empty_cache`, and a memory cap set and lifted (so the
//! out-of-memory ladder runs), on a 1 GiB `SimDevice`. A clean run per policy counts the
//! acquiring device calls the sequence makes (`malloc`, `reserve`, `create_page`, `map`,
//! `set_access`, `create_event`, `record_event`, `query_event`, `synchronize_event`, `mem_info`:
//! the calls `SimDevice::fail_call` counts; releases never fail); then, for call index `i`, a
//! fresh device with `sim.fail_call(i)` (counted from the start) replays the same sequence.
//!
//! Checked after every operation of every replay: no panic; an allocation fails only with
//! `OutOfMemory` (whose `requested` is the request and `reserved` the pool's) or, in a faulty
//! replay, `Device(_)`; a free or `empty_cache` fails only with `Device(_)` in a faulty replay,
//! and a failed free leaves the allocation live (it is freed later); `Pool::check_invariants()`
//! is Ok; device outstanding bytes == the pool's reserved bytes. After the sequence, with faults
//! cleared: every live allocation frees, all work completes, an allocation of every size class
//! on every stream succeeds (the allocator is usable), and after the pool is dropped (with those
//! allocations still live) the device holds no memory, page, reservation or event.
//!
//! Coverage and cost: every call index is swept for every policy (no stride). At commit
//! 89f24dd the sequence makes 333 acquiring calls under `torch`, 738 under `torch-expandable`
//! and 2,211 under `default` (which asks `mem_info` and maps in chunks), so the three sweeps
//! replay it about 3,300 times; the replays run on all available cores (at most 8), about 15 s
//! in all on two busy cores with `cargo test`'s opt-level 2. Each sweep prints its current size
//! and time (`--nocapture`), and checks that the injected faults did surface as errors in some
//! replays.

use cudalloc::{AllocError, Allocation, Config, Policy, Pool};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const OPS: usize = 1000;
const SEED: u64 = 0x5eed_fa17;
const STREAMS: u64 = 3;

use crate::common;
use common::{panic_text, Rng};

/// Request sizes for this file's sequences.
trait Sizes {
    fn size(&mut self) -> u64;
}

impl Sizes for Rng {
    fn size(&mut self) -> u64 {
        match self.below(20) {
            0 => 0,
            1..=6 => self.range(1, 2 * KIB + 1),
            7..=13 => self.range(KIB, MIB),
            _ => self.range(MIB, 64 * MIB),
        }
    }
}

/// One step of the fixed sequence. Allocations go into numbered slots; a step on an empty slot
/// (its allocation failed in this replay) does nothing.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc { slot: usize, size: u64, stream: u64 },
    Free { slot: usize },
    RecordFree { slot: usize, stream: u64 },
    Complete { stream: u64 },
    EmptyCache,
    Limit(Option<u64>),
}

/// The sequence: about 45% allocations, 35% frees (a fifth of them after `record_stream`), the
/// rest completions, `empty_cache` and cap changes.
fn sequence() -> Vec<Op> {
    let mut rng = Rng(SEED);
    let mut live: Vec<usize> = Vec::new();
    let mut next_slot = 0;
    let mut ops = Vec::with_capacity(OPS);
    while ops.len() < OPS {
        let r = rng.below(100);
        let op = match r {
            0..=44 => {
                let slot = next_slot;
                next_slot += 1;
                live.push(slot);
                Op::Alloc {
                    slot,
                    size: rng.size(),
                    stream: rng.below(STREAMS),
                }
            }
            45..=79 if !live.is_empty() => {
                let slot = live.swap_remove(rng.below(live.len() as u64) as usize);
                if r >= 73 {
                    Op::RecordFree {
                        slot,
                        stream: rng.below(STREAMS),
                    }
                } else {
                    Op::Free { slot }
                }
            }
            80..=89 => Op::Complete {
                stream: rng.below(STREAMS),
            },
            90..=93 => Op::EmptyCache,
            94..=99 => Op::Limit((rng.below(2) == 0).then(|| rng.range(128 * MIB, 512 * MIB))),
            _ => continue,
        };
        ops.push(op);
    }
    ops
}

/// Acquiring calls made so far (the ones `fail_call` counts).
fn acquiring_calls(sim: &SimDevice) -> u64 {
    Call::ALL
        .iter()
        .filter(|c| !c.is_release())
        .map(|&c| sim.calls(c))
        .sum()
}

struct Replay {
    sim: Arc<SimDevice>,
    pool: Pool<Arc<SimDevice>>,
    slots: Vec<Option<Allocation>>,
    faulty: bool,
    /// Operations that failed with `Device(_)`.
    device_errors: u64,
    label: String,
}

impl Replay {
    fn new(policy: Policy, fail_call: Option<u64>) -> Replay {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(GIB)));
        sim.set_auto_complete(false);
        if let Some(i) = fail_call {
            sim.fail_call(i);
        }
        let label = match fail_call {
            Some(i) => format!("{policy:?}, fail_call({i})"),
            None => format!("{policy:?}, clean run"),
        };
        Replay {
            pool: Pool::new(sim.clone(), Config::for_policy(policy)),
            sim,
            slots: Vec::new(),
            faulty: fail_call.is_some(),
            device_errors: 0,
            label,
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Alloc { slot, size, stream } => {
                if self.slots.len() <= slot {
                    self.slots.resize_with(slot + 1, || None);
                }
                match self.pool.allocate(size, StreamId(stream)) {
                    Ok(a) => {
                        assert_eq!(a.ptr() % 512, 0, "unaligned allocation");
                        self.slots[slot] = Some(a);
                    }
                    Err(AllocError::OutOfMemory {
                        requested,
                        reserved,
                        ..
                    }) => {
                        assert_eq!(requested, size);
                        assert_eq!(reserved, self.pool.reserved());
                    }
                    Err(AllocError::Device(_)) if self.faulty => self.device_errors += 1,
                    // An injected out-of-memory on `reserve` reads as exhausted address space.
                    Err(AllocError::AddressSpace { requested, .. }) if self.faulty => {
                        assert_eq!(requested, size);
                        self.device_errors += 1;
                    }
                    Err(e) => panic!("allocate({size}): unexpected {e:?}"),
                }
            }
            Op::Free { slot } => self.free(slot, None),
            Op::RecordFree { slot, stream } => self.free(slot, Some(StreamId(stream))),
            Op::Complete { stream } => self.sim.complete_stream(StreamId(stream)),
            Op::EmptyCache => {
                if let Err(e) = self.pool.empty_cache() {
                    assert!(
                        self.faulty && matches!(e, AllocError::Device(_)),
                        "empty_cache: {e:?}"
                    );
                    self.device_errors += 1;
                }
            }
            Op::Limit(limit) => self.pool.set_limit(limit),
        }
    }

    fn free(&mut self, slot: usize, record: Option<StreamId>) {
        let Some(a) = self.slots.get(slot).and_then(Option::as_ref) else {
            return;
        };
        if let Some(s) = record {
            self.pool
                .record_stream(a, s)
                .expect("record_stream of a live allocation");
        }
        // A failed free leaves the allocation live: the slot keeps its handle.
        match self.pool.free(a.duplicate()) {
            Ok(()) => self.slots[slot] = None,
            Err(AllocError::Device(_)) if self.faulty => {
                self.device_errors += 1;
                let b = self.pool.block(a.block()).expect("block of a failed free");
                assert!(
                    b.allocated && b.addr == a.ptr(),
                    "a failed free changed the block"
                );
            }
            Err(e) => panic!("free({:#x}): unexpected {e:?}", a.ptr()),
        }
    }

    fn check(&self, what: &str) {
        if let Err(e) = self.pool.check_invariants() {
            panic!("{}: after {what}: {e}", self.label);
        }
        assert_eq!(
            self.sim.outstanding_bytes(),
            self.pool.reserved(),
            "{}: after {what}: device outstanding bytes != reserved bytes",
            self.label
        );
    }

    /// Runs the sequence; returns the acquiring calls it made.
    fn run(&mut self, ops: &[Op]) -> u64 {
        for (n, &op) in ops.iter().enumerate() {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| self.step(op))) {
                panic!(
                    "{}: op {n} ({op:?}) panicked: {}",
                    self.label,
                    panic_text(&p)
                );
            }
            self.check(&format!("op {n} ({op:?})"));
        }
        acquiring_calls(&self.sim)
    }

    /// With faults cleared: everything frees, every size class allocates on every stream, and
    /// dropping the pool (with those allocations live) gives every byte back.
    fn finish(mut self) {
        let label = self.label.clone();
        self.sim.clear_faults();
        self.pool.set_limit(None);
        for a in std::mem::take(&mut self.slots).into_iter().flatten() {
            self.pool
                .free(a)
                .unwrap_or_else(|e| panic!("{label}: free after the sequence: {e:?}"));
        }
        self.sim.complete_all();
        self.check("freeing everything");
        for stream in 0..STREAMS {
            for size in [0, 1000, 700 * KIB, 5 * MIB, 12 * MIB, 40 * MIB] {
                let a = self.pool.allocate(size, StreamId(stream));
                let a = a.unwrap_or_else(|e| panic!("{label}: allocate({size}) after: {e:?}"));
                self.slots.push(Some(a));
            }
        }
        self.check("allocating after the sequence");
        let sim = self.sim.clone();
        drop(self);
        common::assert_device_empty(&sim, &label);
    }
}

/// Replays the sequence once per acquiring call of a clean run, with that call failing.
fn sweep(policy: Policy) {
    let ops = sequence();
    let mut clean = Replay::new(policy, None);
    let calls = clean.run(&ops);
    clean.finish();
    let next = AtomicU64::new(1);
    let surfaced = AtomicU64::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i > calls {
                    break;
                }
                let mut r = Replay::new(policy, Some(i));
                r.run(&ops);
                if r.device_errors > 0 {
                    surfaced.fetch_add(1, Ordering::Relaxed);
                }
                r.finish();
            });
        }
    });
    let surfaced = surfaced.into_inner();
    println!(
        "{policy:?}: {OPS} ops make {calls} acquiring device calls; failed each in turn, one \
         per replay, in {:.1} s on {threads} threads; {surfaced} replays saw a device error \
         (the rest absorbed the fault: an out-of-memory retry, or a failure returned as OOM)",
        start.elapsed().as_secs_f64()
    );
    assert!(calls > 100, "{policy:?}: only {calls} calls");
    assert!(surfaced > 0, "{policy:?}: no injected fault surfaced");
}

#[test]
fn the_sequence_mixes_every_kind_of_operation() {
    let ops = sequence();
    assert_eq!(ops.len(), OPS);
    let count = |f: fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
    assert!(count(|o| matches!(o, Op::Alloc { .. })) > 400);
    assert!(count(|o| matches!(o, Op::Free { .. })) > 200);
    assert!(count(|o| matches!(o, Op::RecordFree { .. })) > 40);
    assert!(count(|o| matches!(o, Op::EmptyCache)) > 20);
    assert!(count(|o| matches!(o, Op::Limit(Some(_)))) > 10);
    for policy in Policy::ALL {
        let mut r = Replay::new(policy, None);
        let calls = r.run(&ops);
        let stats = r.pool.stats();
        assert!(stats.num_ooms > 0, "{policy:?}: the cap never bit");
        assert!(calls > 100, "{policy:?}: {calls} calls");
        // The device runs behind (work completes only when told): `default` moves pages.
        let moves = policy == Policy::Default;
        assert_eq!(stats.pages_moved > 0, moves, "{policy:?}: {stats:?}");
        r.finish();
    }
}

#[test]
fn fail_every_call_torch() {
    sweep(Policy::Torch);
}

#[test]
fn fail_every_call_torch_expandable() {
    sweep(Policy::TorchExpandable);
}

#[test]
fn fail_every_call_default() {
    sweep(Policy::Default);
}
