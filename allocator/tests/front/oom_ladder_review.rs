//! The front's out-of-memory path across its pools: the stream shards and the tags' pools count
//! against one memory limit, so the last resort of the second try (re-paging the chunks live
//! blocks pin, `pool::repage`) must run in every one of them, whichever pool the request is
//! for. A tagged request never ran the shards' last resort, and an untagged one never ran the
//! tags' pools': each failed with out of memory, within the cap once the other pool's pinned
//! chunk was re-paged (as the same request between two shards succeeds).

use crate::common::pool::check_caching;
use cudalloc::{Allocation, CachingAllocator, Config};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

type Sim = Arc<SimDevice>;
type Caching = CachingAllocator<Sim>;

/// A `default` allocator on a 4 GiB device where `allocate` (of stream 0, in tag "w" or
/// untagged) mapped a 20 MiB chunk that a live 1.5 MiB block now pins, capped 4 MiB above
/// what is mapped: a 20 MiB request fits only once the chunk is re-paged. Returns the live
/// block.
fn pinned(allocate: impl Fn(&Caching, u64) -> Allocation) -> (Sim, Caching, Allocation) {
    let sim = Arc::new(SimDevice::new(
        SimConfig::with_capacity(4 * GIB).host_backing(true),
    ));
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    let a = Caching::new(sim.clone(), cfg);
    let big = allocate(&a, 20 * MIB);
    a.free(big).unwrap();
    a.empty_cache().unwrap();
    let big = allocate(&a, 20 * MIB);
    a.free(big).unwrap();
    let live = allocate(&a, 1536 * KIB);
    assert_eq!(sim.mapped_bytes(), 20 * MIB);
    a.set_memory_limit(Some(sim.mapped_bytes() + 4 * MIB));
    check_caching(&sim, &a);
    (sim, a, live)
}

/// Runs `request` on the allocator [`pinned`] made with `setup`: it must succeed within the
/// cap, count no OOM, and leave nothing behind.
fn fits_after_re_paging(
    setup: impl Fn(&Caching, u64) -> Allocation,
    request: impl Fn(&Caching) -> Result<Allocation, cudalloc::AllocError>,
) {
    let (sim, a, live) = pinned(setup);
    let r = request(&a);
    check_caching(&sim, &a);
    let grown = r.expect("20 MiB fit the cap once the pinned chunk is re-paged");
    assert!(sim.outstanding_bytes() <= a.memory_limit().unwrap());
    assert_eq!(a.stats().num_ooms, 0, "an allocation that succeeded");
    a.free(grown).unwrap();
    a.free(live).unwrap();
    a.empty_cache().unwrap();
    check_caching(&sim, &a);
    assert_eq!(sim.outstanding_bytes(), 0);
}

fn untagged(a: &Caching, size: u64) -> Allocation {
    a.allocate(size, S0).unwrap()
}

fn tagged(a: &Caching, size: u64) -> Allocation {
    a.allocate_tagged(size, S0, "w").unwrap()
}

#[test]
fn a_tagged_request_re_pages_a_chunk_a_stream_shard_pins() {
    fits_after_re_paging(untagged, |a| a.allocate_tagged(20 * MIB, S1, "kv"));
}

#[test]
fn an_untagged_request_re_pages_a_chunk_a_tag_pins() {
    fits_after_re_paging(tagged, |a| a.allocate(20 * MIB, S1));
}

#[test]
fn a_request_of_another_tag_re_pages_a_chunk_a_tag_pins() {
    fits_after_re_paging(tagged, |a| a.allocate_tagged(20 * MIB, S1, "kv"));
}

/// The shards' case, already handled: the reference the other three must match.
#[test]
fn a_request_of_another_stream_re_pages_a_chunk_a_stream_shard_pins() {
    fits_after_re_paging(untagged, |a| a.allocate(20 * MIB, S1));
}

/// A graph pool keeps its memory: out of memory it runs no last resort, tagged or not.
#[test]
fn a_graph_pool_runs_no_last_resort() {
    let (sim, a, live) = pinned(untagged);
    let g = a.graph_pool();
    let before = sim.calls(cudalloc_sys::Call::SynchronizeDevice);
    let e = g.allocate_tagged(20 * MIB, S1, "kv").unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(sim.calls(cudalloc_sys::Call::SynchronizeDevice), before);
    drop(g);
    a.free(live).unwrap();
    check_caching(&sim, &a);
}

/// A wake is a request too: a tag that wakes under a cap its slept bytes fit only once a
/// stream shard's pinned chunk is re-paged wakes (it failed with out of memory when the
/// wake's second try only emptied caches), with its bytes in place.
#[test]
fn a_wake_re_pages_a_chunk_a_stream_shard_pins() {
    let sim = Arc::new(SimDevice::new(
        SimConfig::with_capacity(4 * GIB).host_backing(true),
    ));
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    let a = Caching::new(sim.clone(), cfg);
    let kv = a.allocate_tagged(16 * MIB, S1, "kv").unwrap();
    let bytes: Vec<u8> = (0..kv.size()).map(|i| (i * 7 + i / 251) as u8).collect();
    sim.write(kv.ptr(), &bytes).unwrap();
    a.sleep(&["kv"], &["kv"]).unwrap();
    let slept = a.tag_stats()[0].slept_bytes;
    assert!(slept >= 16 * MIB, "{slept}");
    for empty in [true, false] {
        let big = untagged(&a, 20 * MIB);
        a.free(big).unwrap();
        if empty {
            a.empty_cache().unwrap();
        }
    }
    let live = untagged(&a, 1536 * KIB);
    let mapped = sim.mapped_bytes();
    assert_eq!(mapped, 20 * MIB);
    // Room for the slept bytes only once the 20 MiB chunk shrinks to the live block's page.
    a.set_memory_limit(Some(mapped + slept - 4 * MIB));
    a.wake(&["kv"], S1)
        .expect("the wake fits once the pinned chunk is re-paged");
    assert!(!a.is_asleep("kv"));
    assert!(sim.outstanding_bytes() <= a.memory_limit().unwrap());
    let mut back = vec![0u8; bytes.len()];
    sim.read(kv.ptr(), &mut back).unwrap();
    assert!(back == bytes, "the woken tag's bytes");
    check_caching(&sim, &a);
    a.free(kv).unwrap();
    a.free(live).unwrap();
    a.empty_cache().unwrap();
    check_caching(&sim, &a);
    assert_eq!(sim.outstanding_bytes(), 0);
}
