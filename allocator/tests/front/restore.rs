//! `CachingAllocator::allocate_at`: a pool put back to an earlier state, as CUDA graph trees
//! restore a graph pool to a checkpoint (free what is live now, hand out again at the same
//! addresses what was live then).
//!
//! Checked: after random allocations and frees, a restore hands out every block of the
//! checkpoint at its address with its size, leaves the blocks allocated exactly as they were,
//! and keeps the invariants and statistics exact (the check recomputes them); under `torch`
//! (fixed segments, split blocks) and `torch-expandable` (a graph pool's rules); a block in a
//! thread cache is taken back first; a range that is live, spans blocks, belongs to another
//! stream, is unaligned or asked for during a capture is refused by name, nothing changed.

use crate::common::Rng;
use cudalloc::snapshot::BlockState;
use cudalloc::stats::StatType;
use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S: StreamId = StreamId(7);

type Alloc = CachingAllocator<Arc<SimDevice>>;

fn allocator(policy: Policy) -> Alloc {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
    CachingAllocator::new(sim, Config::for_policy(policy))
}

/// One live block: address, block size, bytes requested.
type Live = (u64, u64, u64);

/// The allocated blocks, in address order.
fn live_blocks(alloc: &Alloc) -> Vec<Live> {
    let mut live: Vec<Live> = alloc
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::Allocated)
        .map(|b| (b.addr, b.size, b.requested))
        .collect();
    live.sort_unstable();
    live
}

/// A size between 512 bytes and 24 MiB, small and large pool alike.
fn size(rng: &mut Rng) -> u64 {
    match rng.below(3) {
        0 => rng.range(1, 1 << 20),
        1 => rng.range(1 << 20, 8 * MIB),
        _ => rng.range(8 * MIB, 24 * MIB),
    }
}

/// Frees everything in `held`, then hands out `checkpoint` again at its addresses.
fn restore(alloc: &Alloc, held: Vec<Allocation>, checkpoint: &[Live]) -> Vec<Allocation> {
    for a in held {
        alloc.free(a).unwrap();
    }
    checkpoint
        .iter()
        .map(|&(ptr, size, requested)| {
            let a = alloc.allocate_at(ptr, size, requested, S).unwrap();
            assert_eq!((a.ptr(), a.size()), (ptr, requested));
            a
        })
        .collect()
}

fn restores_a_checkpoint_after_random_work(policy: Policy, seed: u64) {
    let alloc = allocator(policy);
    let mut rng = Rng(seed);
    let mut held: Vec<Allocation> = Vec::new();
    for round in 0..6 {
        for _ in 0..rng.range(10, 40) {
            if !held.is_empty() && rng.below(3) == 0 {
                let i = rng.below(held.len() as u64) as usize;
                alloc.free(held.swap_remove(i)).unwrap();
            } else {
                held.push(alloc.allocate(size(&mut rng), S).unwrap());
            }
        }
        let checkpoint = live_blocks(&alloc);
        let stats = alloc.stats();
        // What a graph tree does between its checkpoint and the restore: frees, in any order.
        let keep = rng.below(held.len() as u64 + 1) as usize;
        while held.len() > keep {
            let i = rng.below(held.len() as u64) as usize;
            alloc.free(held.swap_remove(i)).unwrap();
        }
        held = restore(&alloc, held, &checkpoint);
        alloc.check_invariants().unwrap();
        assert_eq!(live_blocks(&alloc), checkpoint, "{policy:?} round {round}");
        let now = alloc.stats();
        for (what, a, b) in [
            (
                "allocated bytes",
                &now.allocated_bytes,
                &stats.allocated_bytes,
            ),
            ("active bytes", &now.active_bytes, &stats.active_bytes),
            (
                "requested bytes",
                &now.requested_bytes,
                &stats.requested_bytes,
            ),
            ("allocations", &now.allocation, &stats.allocation),
            ("reserved bytes", &now.reserved_bytes, &stats.reserved_bytes),
        ] {
            assert_eq!(
                a.get(StatType::All).current,
                b.get(StatType::All).current,
                "{what}, {policy:?} round {round}"
            );
        }
    }
    for a in held {
        alloc.free(a).unwrap();
    }
    alloc.check_invariants().unwrap();
    assert_eq!(live_blocks(&alloc), Vec::<Live>::new());
}

#[test]
fn a_checkpoint_is_restored_at_its_addresses_under_torch() {
    for seed in 1..=8 {
        restores_a_checkpoint_after_random_work(Policy::Torch, seed);
    }
}

#[test]
fn a_checkpoint_is_restored_at_its_addresses_under_torch_expandable() {
    for seed in 1..=8 {
        restores_a_checkpoint_after_random_work(Policy::TorchExpandable, seed);
    }
}

#[test]
fn a_block_in_a_thread_cache_is_taken_back_first() {
    let alloc = allocator(Policy::Default);
    let a = alloc.allocate(MIB, S).unwrap();
    let (ptr, requested) = (a.ptr(), a.size());
    let size = live_blocks(&alloc)[0].1;
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.stats().thread_cache.blocks,
        1,
        "the free went to a cache"
    );
    let again = alloc.allocate_at(ptr, size, requested, S).unwrap();
    assert_eq!(again.ptr(), ptr);
    alloc.check_invariants().unwrap();
    alloc.free(again).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_range_that_is_not_free_is_refused_and_nothing_changes() {
    let alloc = allocator(Policy::TorchExpandable);
    let a = alloc.allocate(4 * MIB, S).unwrap();
    let b = alloc.allocate(4 * MIB, S).unwrap();
    let (pa, pb) = (a.ptr(), b.ptr());
    let before = live_blocks(&alloc);
    let not_free = |r: Result<Allocation, AllocError>, what: &str| match r {
        Err(e @ AllocError::NotFree { .. }) => {
            assert!(e.to_string().contains("cannot hand out"), "{what}: {e}")
        }
        other => panic!("{what}: expected NotFree, got {other:?}"),
    };
    not_free(alloc.allocate_at(pa, 4 * MIB, 4 * MIB, S), "a live block");
    alloc.free(a).unwrap();
    not_free(
        alloc.allocate_at(pa, 8 * MIB, 8 * MIB, S),
        "a free block and a live one",
    );
    not_free(
        alloc.allocate_at(pa, 4 * MIB, 4 * MIB, StreamId(9)),
        "another stream",
    );
    not_free(
        alloc.allocate_at(pa + 1, 512, 512, S),
        "an unaligned address",
    );
    not_free(
        alloc.allocate_at(pa, 4 * MIB, 5 * MIB, S),
        "more requested than held",
    );
    alloc.begin_capture(CaptureMode::Relaxed);
    match alloc.allocate_at(pa, 4 * MIB, 4 * MIB, S) {
        Err(AllocError::DuringCapture { .. }) => {}
        other => panic!("during a capture: expected DuringCapture, got {other:?}"),
    }
    alloc.end_capture(CaptureMode::Relaxed).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(live_blocks(&alloc), before[1..].to_vec());
    let again = alloc.allocate_at(pa, 4 * MIB, 4 * MIB, S).unwrap();
    assert_eq!(live_blocks(&alloc), before);
    alloc.free(again).unwrap();
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(pb, before[1].0);
}
