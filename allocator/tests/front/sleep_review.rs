//! Tags found in a review of sleep and wake: a tagged allocation handed to an allocator that
//! did not make it (its graph pool's, another device's) is no allocation of that allocator,
//! as an untagged one is ([`AllocError::NotAllocated`]), whatever tag number it carries.

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
