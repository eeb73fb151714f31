//! Stateful property test (testing tier 2): random operation sequences against a reference model
//! of live allocations, for every policy, on a simulated device with host backing (4 GiB, or
//! 1 GiB or 256 MiB so that the device itself runs out of memory).
//!
//! The three policies run with their plain configuration, and a fourth test picks one of eight
//! tuned configuration strings per case; each test runs 2,000 cases of up to 200 steps.
//!
//! Operations: allocate (sizes from 1..=2048 B, 1 KiB..1 MiB, 1..64 MiB, and 0), free a random
//! live allocation, record it on another stream (then free it, or not), complete one stream's or
//! every stream's work, `empty_cache`, fail the next device call, set or clear a memory limit.
//!
//! Invariants checked after every step:
//! - `Pool::check_invariants` (blocks tile segments, no two free neighbours, indexes, statistics
//!   equal what the snapshot recomputes) and `SimDevice::check_invariants`;
//! - device outstanding bytes == the pool's reserved bytes;
//! - every live allocation is 512-aligned, is backed by an allocated block at its address that is
//!   at least the rounded request, and no two live allocations overlap;
//! - `allocation.all.current` == the number of live allocations in the model;
//! - data: a cookie written into each allocation (start and end) reads back unchanged at free;
//! - errors: an allocation fails only with `OutOfMemory` (with `requested`, `reserved` and
//!   `allocated` filled in), or with `Device(_)` right after a device fault was injected;
//!   frees and `empty_cache` fail only right after an injected fault.
//!
//! At the end, after freeing everything, completing all work and `empty_cache`: nothing is
//! reserved, nothing is outstanding on the device; after dropping the pool: no events, pages,
//! segments or reservations are left.

use cudalloc::stats::StatType;
use cudalloc::{AllocError, Allocation, Config, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use proptest::prelude::*;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const STREAMS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    RecordFree { pick: usize, other: u64 },
    Record { pick: usize, other: u64 },
    Complete { stream: u64 },
    CompleteAll,
    EmptyCache,
    FailNext,
    Limit(Option<u64>),
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=2048,
        4 => 1024u64..MIB,
        2 => MIB..64 * MIB,
        1 => Just(0u64),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let stream = 0..STREAMS;
    prop_oneof![
        10 => (size_strategy(), stream.clone()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), stream.clone()).prop_map(|(pick, other)| Op::RecordFree { pick, other }),
        1 => (any::<usize>(), stream.clone()).prop_map(|(pick, other)| Op::Record { pick, other }),
        2 => stream.prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::CompleteAll),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::FailNext),
        1 => prop_oneof![Just(None), (64 * MIB..2 * GIB).prop_map(Some)].prop_map(Op::Limit),
    ]
}

struct Live {
    a: Allocation,
    cookie: u64,
}

struct Model {
    sim: Arc<SimDevice>,
    pool: Pool<Arc<SimDevice>>,
    live: Vec<Live>,
    next_cookie: u64,
    /// A fault was injected before this step: device errors are allowed.
    armed: bool,
}

/// Where the cookie goes: the first 8 bytes, and the last 8 of the request when it has 16.
fn cookie_spots(a: &Allocation) -> Vec<u64> {
    if a.size() >= 16 {
        vec![a.ptr(), a.ptr() + a.size() - 8]
    } else {
        vec![a.ptr()]
    }
}

impl Model {
    fn new(config: Config, capacity: u64) -> Model {
        let cfg = SimConfig::with_capacity(capacity).host_backing(true);
        let sim = Arc::new(SimDevice::new(cfg));
        sim.set_auto_complete(false);
        let pool = Pool::new(sim.clone(), config);
        Model {
            sim,
            pool,
            live: Vec::new(),
            next_cookie: 0x5eed_0000_0000_0001,
            armed: false,
        }
    }

    fn step(&mut self, op: &Op) {
        let armed_now = std::mem::take(&mut self.armed);
        match op {
            Op::Alloc { size, stream } => self.alloc(*size, StreamId(*stream), armed_now),
            Op::Free { pick } => self.free(*pick, None, armed_now),
            Op::RecordFree { pick, other } => self.free(*pick, Some(StreamId(*other)), armed_now),
            Op::Record { pick, other } => {
                if !self.live.is_empty() {
                    let a = &self.live[pick % self.live.len()].a;
                    self.pool.record_stream(a, StreamId(*other)).unwrap();
                }
            }
            Op::Complete { stream } => self.sim.complete_stream(StreamId(*stream)),
            Op::CompleteAll => self.sim.complete_all(),
            Op::EmptyCache => {
                if let Err(e) = self.pool.empty_cache() {
                    assert!(
                        armed_now,
                        "empty_cache failed with no fault injected: {e:?}"
                    );
                    assert!(matches!(e, AllocError::Device(_)), "{e:?}");
                }
            }
            Op::FailNext => {
                self.sim.fail_next();
                self.armed = true;
            }
            Op::Limit(l) => self.pool.set_limit(*l),
        }
        if armed_now {
            self.sim.clear_faults();
        }
        self.check();
    }

    fn alloc(&mut self, size: u64, stream: StreamId, armed: bool) {
        match self.pool.allocate(size, stream) {
            Ok(a) => {
                assert_eq!(a.size(), size);
                assert_eq!(a.stream(), stream);
                let cookie = self.next_cookie;
                self.next_cookie = self.next_cookie.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for at in cookie_spots(&a) {
                    self.sim.write(at, &cookie.to_le_bytes()).unwrap();
                }
                self.live.push(Live { a, cookie });
            }
            Err(AllocError::OutOfMemory {
                requested,
                rounded,
                reserved,
                allocated,
                limit,
                ..
            }) => {
                assert_eq!(requested, size);
                assert_eq!(rounded, self.pool.config().round_size(size));
                assert_eq!(reserved, self.pool.reserved());
                let all = self.pool.stats().allocated_bytes.get(StatType::All).current;
                assert_eq!(allocated, all as u64);
                assert_eq!(limit, self.pool.limit());
            }
            Err(AllocError::Device(e)) => {
                assert!(
                    armed,
                    "allocate({size}) failed with no fault injected: {e:?}"
                );
            }
            Err(e) => panic!("allocate({size}): unexpected error {e:?}"),
        }
    }

    fn check_cookie(&self, l: &Live) {
        for at in cookie_spots(&l.a) {
            let mut buf = [0u8; 8];
            self.sim.read(at, &mut buf).unwrap();
            assert_eq!(
                u64::from_le_bytes(buf),
                l.cookie,
                "cookie of {:#x}+{} at {at:#x} was overwritten",
                l.a.ptr(),
                l.a.size()
            );
        }
    }

    fn free(&mut self, pick: usize, record: Option<StreamId>, armed: bool) {
        if self.live.is_empty() {
            return;
        }
        let i = pick % self.live.len();
        self.check_cookie(&self.live[i]);
        let a = &self.live[i].a;
        if let Some(s) = record {
            self.pool.record_stream(a, s).unwrap();
        }
        match self.pool.free(a.duplicate()) {
            Ok(()) => {
                self.live.swap_remove(i);
            }
            Err(AllocError::Device(e)) => {
                assert!(armed, "free failed with no fault injected: {e:?}");
            }
            Err(e) => panic!("free({:#x}): unexpected error {e:?}", a.ptr()),
        }
    }

    fn check(&self) {
        if let Err(e) = self.pool.check_invariants() {
            panic!("pool invariant: {e}");
        }
        self.sim.check_invariants();
        assert_eq!(
            self.sim.outstanding_bytes(),
            self.pool.reserved(),
            "device outstanding bytes != reserved bytes"
        );
        let stats = self.pool.stats();
        assert_eq!(
            stats.allocation.get(StatType::All).current,
            self.live.len() as i64
        );
        let mut spans: Vec<(u64, u64)> = Vec::with_capacity(self.live.len());
        for l in &self.live {
            let a = &l.a;
            assert_eq!(a.ptr() % 512, 0, "{:#x} is not 512-aligned", a.ptr());
            let b = self.pool.block(a.block()).expect("live block");
            assert!(b.allocated, "block of {:#x} is not allocated", a.ptr());
            assert_eq!(b.addr, a.ptr());
            assert!(b.size >= self.pool.config().round_size(a.size()));
            spans.push((a.ptr(), b.size));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "live blocks {:#x}+{} and {:#x} overlap",
                w[0].0,
                w[0].1,
                w[1].0
            );
        }
    }

    /// Frees everything and checks that every byte goes back to the device.
    fn finish(mut self) {
        self.sim.clear_faults();
        for l in std::mem::take(&mut self.live) {
            self.check_cookie(&l);
            self.pool.free(l.a).unwrap();
        }
        self.check();
        self.sim.complete_all();
        self.pool.empty_cache().unwrap();
        self.check();
        assert_eq!(self.pool.reserved(), 0, "reserved bytes after empty_cache");
        assert_eq!(self.sim.outstanding_bytes(), 0);
        assert_eq!(self.pool.pending_events(), 0);
        let sim = self.sim.clone();
        drop(self);
        sim.check_invariants();
        assert_eq!(sim.outstanding_bytes(), 0);
        assert_eq!(sim.live_mallocs(), 0);
        assert_eq!(sim.live_pages(), 0);
        assert_eq!(sim.mapped_bytes(), 0);
        assert_eq!(sim.reserved_va_bytes(), 0);
        assert_eq!(sim.live_events(), 0, "events leaked");
    }
}

fn run(config: Config, capacity: u64, ops: &[Op]) {
    let mut m = Model::new(config, capacity);
    for op in ops {
        m.step(op);
    }
    m.finish();
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(), 1..=200)
}

/// Device capacities: 4 GiB as the main case, and smaller ones so that the device itself (not
/// only a limit) runs out of memory within 200 steps.
fn capacity() -> impl Strategy<Value = u64> {
    prop_oneof![2 => Just(4 * GIB), 1 => Just(GIB), 1 => Just(256 * MIB)]
}

/// Tuned configurations: oversize rules, rounding divisions, garbage collection, and the
/// `default` policy's chunk size and budget at their extremes.
const TUNED: [&str; 8] = [
    "policy:torch,max_split_size_mb:20",
    "policy:torch,max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5",
    "policy:torch,roundup_power2_divisions:[1:4,8:2,>:8],garbage_collection_threshold:0.3",
    "policy:torch-expandable,max_split_size_mb:24,roundup_power2_divisions:4",
    "policy:torch-expandable,garbage_collection_threshold:0.6",
    "policy:default,max_chunk_mb:2,fragmentation_budget:0",
    "policy:default,max_chunk_mb:64,fragmentation_budget:1",
    "policy:default,max_split_size_mb:32,roundup_power2_divisions:2,garbage_collection_threshold:0.7",
];

proptest! {
    #![proptest_config(config())]

    #[test]
    fn model_tuned(which in 0..TUNED.len(), capacity in capacity(), ops in ops()) {
        run(Config::parse(TUNED[which]).unwrap(), capacity, &ops);
    }

    #[test]
    fn model_torch(capacity in capacity(), ops in ops()) {
        run(Config::for_policy(Policy::Torch), capacity, &ops);
    }

    #[test]
    fn model_torch_expandable(capacity in capacity(), ops in ops()) {
        run(Config::for_policy(Policy::TorchExpandable), capacity, &ops);
    }

    #[test]
    fn model_default(capacity in capacity(), ops in ops()) {
        run(Config::for_policy(Policy::Default), capacity, &ops);
    }
}

/// A fixed sequence that exercises every operation once, so a regression shows up without
/// relying on the random search.
#[test]
fn model_smoke_every_op() {
    let ops = [
        Op::Alloc {
            size: 1000,
            stream: 0,
        },
        Op::Alloc {
            size: 5 * MIB,
            stream: 1,
        },
        Op::Alloc { size: 0, stream: 2 },
        Op::Record { pick: 0, other: 1 },
        Op::RecordFree { pick: 1, other: 2 },
        Op::Alloc {
            size: 40 * MIB,
            stream: 0,
        },
        Op::Complete { stream: 2 },
        Op::Alloc {
            size: 700 << 10,
            stream: 1,
        },
        Op::Limit(Some(128 * MIB)),
        Op::Alloc {
            size: 63 * MIB,
            stream: 2,
        },
        Op::Alloc {
            size: 63 * MIB,
            stream: 2,
        },
        Op::FailNext,
        Op::Alloc {
            size: 3 * MIB,
            stream: 0,
        },
        Op::Free { pick: 0 },
        Op::EmptyCache,
        Op::Limit(None),
        Op::CompleteAll,
        Op::Free { pick: 0 },
    ];
    for policy in Policy::ALL {
        for capacity in [4 * GIB, 256 * MIB] {
            run(Config::for_policy(policy), capacity, &ops);
        }
    }
}

/// A page moved from a releasing block to a growth of the same stream (its old addresses still
/// mapped), then the query of the moved block's event fails and the event is recorded again:
/// the growth's own release now completes before the moved block's.
fn moved_then_recorded_again() -> Vec<Op> {
    use Op::*;
    vec![
        Alloc { size: 1, stream: 0 },
        Free { pick: 0 },
        Alloc { size: 1, stream: 1 },
        Alloc { size: 1, stream: 0 },
        Free { pick: 0 },
        Complete { stream: 0 },
        Free { pick: 0 },
        Alloc {
            size: 6291457,
            stream: 1,
        },
        Free { pick: 0 },
        Limit(Some(109051904)),
        Alloc { size: 1, stream: 2 },
        Alloc { size: 1, stream: 0 },
        CompleteAll,
        FailNext,
        Alloc { size: 1, stream: 0 },
    ]
}

/// A sequence the model once failed (device outstanding bytes above the reserved ones): the
/// growth's release completed first and gave the moved page back while the moved block's
/// addresses still held it. A release now waits for a moved block of its stream ahead of it.
#[test]
fn a_release_waits_for_a_moved_block_whose_event_was_recorded_again() {
    let ops = moved_then_recorded_again();
    run(Config::for_policy(Policy::Default), 4 * GIB, &ops);
}

/// The same state (a moved block and a later release of its stream, the moved block's event
/// recorded again), emptied by `empty_cache` with each release call in turn failing: the moved
/// block is unmapped first, and a later block of its stream stays releasing while it could not
/// be, so that once `empty_cache` succeeds the device holds no page the pool does not count.
#[test]
fn empty_cache_unmaps_a_moved_block_before_the_later_releases_of_its_stream() {
    let ops = moved_then_recorded_again();
    for k in 1..=8 {
        let mut m = Model::new(Config::for_policy(Policy::Default), 4 * GIB);
        for op in &ops {
            m.step(op);
        }
        m.sim.fail_release(k);
        let _ = m.pool.empty_cache();
        m.sim.clear_faults();
        // A page whose release failed is released at the next try.
        m.pool.empty_cache().unwrap();
        m.check();
        m.finish();
    }
}
