//! Tags, sleep and wake across an allocator and its graph pools: a tagged allocation handed to
//! an allocator that did not make it (its graph pool's, another device's) is no allocation of
//! that allocator, as an untagged one is ([`AllocError::NotAllocated`]), whatever tag number
//! it carries; a graph pool dropped while a tag of it sleeps with pages left mapped gives them
//! back to the limit it shares.

use cudalloc::{AllocError, CachingAllocator, Config, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// The free of a graph pool's tagged allocation into the allocator it came from (which has no
/// tag) is refused, not a panic; the graph pool frees it afterwards.
#[test]
fn a_tagged_allocation_of_another_allocator_is_not_allocated_here() {
    let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::Default));
    let graphs = alloc.graph_pool();
    let x = graphs.allocate_tagged(MIB, StreamId(1), "t").unwrap();
    assert_eq!(
        alloc.free(x.duplicate()),
        Err(AllocError::NotAllocated(x.ptr()))
    );
    // With a tag of the same number here, too.
    let mine = alloc.allocate_tagged(MIB, StreamId(1), "t").unwrap();
    assert_eq!(
        alloc.free(x.duplicate()),
        Err(AllocError::NotAllocated(x.ptr()))
    );
    graphs.free(x).unwrap();
    alloc.free(mine).unwrap();
    alloc.check_invariants().unwrap();
    graphs.check_invariants().unwrap();
}

/// A graph pool dropped while a tag of it sleeps with pages its sleep could not unmap (the
/// driver refused): dropping it unmaps them and takes them out of the limit's count, which
/// the allocator it came from shares; that allocator can then use its whole limit again.
#[test]
fn a_graph_pool_dropped_asleep_gives_its_stuck_pages_back_to_the_limit() {
    let mut incomplete = 0;
    for k in 1..=8 {
        let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::Default));
        alloc.set_memory_limit(Some(256 * MIB));
        let graphs = alloc.graph_pool();
        let held: Vec<_> = (0..3)
            .map(|_| graphs.allocate_tagged(40 * MIB, StreamId(1), "t").unwrap())
            .collect();
        dev.fail_release(k);
        let slept = graphs.sleep(&["t"], &[]);
        dev.clear_faults();
        if let Err(AllocError::SleepIncomplete { mapped, .. }) = slept {
            assert!(mapped > 0, "k={k}");
            incomplete += 1;
        }
        drop(held);
        drop(graphs);
        assert_eq!(
            dev.outstanding_bytes(),
            0,
            "k={k}: the pool's pages went back"
        );
        let all = alloc.allocate(256 * MIB, StreamId(1));
        assert!(all.is_ok(), "k={k}: the whole limit is free again: {all:?}");
        alloc.free(all.unwrap()).unwrap();
        alloc.check_invariants().unwrap();
    }
    assert!(incomplete > 0, "no unmap was ever refused");
}
