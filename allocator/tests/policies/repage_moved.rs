//! Re-paging (`pool::repage`) while a moved block (`pool::moving`) is outstanding: a growth took
//! the pages of its stream's give-back while the device ran behind, so the old addresses of
//! those pages stay mapped until their event completes. A chunk holding such a page gives its
//! memory back only once both its addresses are unmapped: a re-paging that released it while
//! the old addresses were still mapped would count as given back memory the device still
//! holds. Through `CachingAllocator`, whose last resort runs on every stream shard, also on one
//! whose pages on their way back the out-of-memory ladder could not wait for.

use crate::common::pool;

use cudalloc::snapshot::BlockState;
use cudalloc::{Allocation, Config};
use cudalloc_sys::{Call, SimConfig, SimDevice};
use pool::{check_caching, Sim, MIB, S0, S1};
use std::sync::Arc;

type Caching = cudalloc::CachingAllocator<Sim>;

/// A `default` allocator (2 MiB chunks, no thread caches) on a 64 MiB device, capped at 40
/// MiB, whose stream 0 holds a live 2 MiB block and, after it, a free 34 MiB block whose first
/// 30 MiB are pages a growth took from a give-back of stream 0 the device has not caught up
/// with: the old addresses of those 15 pages are a moved block. Returns the live block.
fn moved_behind(sim: &Sim, a: &Caching) -> Allocation {
    let big = a.allocate(30 * MIB, S0).unwrap();
    let live = a.allocate(2 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.set_memory_limit(Some(40 * MIB));
    sim.set_auto_complete(false);
    // 32 + 34 MiB passes the cap: the 30 MiB block goes back, and the growth takes its pages.
    let grown = a.allocate(34 * MIB, S0).unwrap();
    check_caching(sim, a);
    let snap = a.snapshot();
    let blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
    let moved: u64 = blocks
        .filter(|b| b.state == BlockState::Moved)
        .map(|b| b.size)
        .sum();
    assert_eq!(moved, 30 * MIB, "the old addresses of the pages moved");
    assert_eq!(sim.mapped_bytes(), 36 * MIB + moved);
    a.free(grown).unwrap();
    check_caching(sim, a);
    live
}

/// A 38 MiB request of stream 1 (another stream shard than stream 0's) fits the cap only once stream 0's free 34 MiB
/// go back. Its shard's ladder runs out of memory; stream 0's shard cannot wait for its event
/// (the device refuses every event wait), so its moved block and its cached pages stay; the
/// last resort then waits for the whole device and re-pages stream 0's shard. The pages moved
/// must be given back only with their old addresses unmapped: else the device still holds 30
/// MiB the pool no longer counts, and the request, within the cap, finds the device full.
#[test]
fn a_re_paging_gives_back_no_page_still_mapped_at_a_moved_block() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(64 * MIB)));
    let cfg = Config::parse("policy:default,layout_plans:false,max_chunk_mb:2,thread_cache:False")
        .unwrap();
    let a = Caching::new(sim.clone(), cfg);
    let first = a.allocate(512, S0).unwrap();
    a.free(first).unwrap();
    a.empty_cache().unwrap();
    let live = moved_behind(&sim, &a);
    sim.fail_always(Call::SynchronizeEvent);
    let r = a.allocate(38 * MIB, S1);
    sim.clear_faults();
    check_caching(&sim, &a);
    let grown = r.expect("38 MiB fit the cap and the device once stream 0's pages went back");
    assert_eq!(a.reserved_bytes(), 40 * MIB);
    a.free(grown).unwrap();
    a.free(live).unwrap();
    sim.complete_all();
    a.empty_cache().unwrap();
    check_caching(&sim, &a);
    assert_eq!(sim.outstanding_bytes(), 0);
    assert_eq!(sim.mapped_bytes(), 0);
}
