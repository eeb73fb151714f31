//! The `default` policy under a memory limit (`policy::default::budget`, `pool::repage`): growth
//! maps chunks of up to `max_chunk_mb` as without a limit, and when a growth does not fit even
//! after every cached chunk went back, the chunks live blocks keep mapped are made again from
//! the pages those blocks touch and their free pages go back (not those of shareable segments,
//! not during a capture, not without a limit). On the simulated device with host backing, so the bytes
//! of the live blocks are checked across it; the core's invariants hold after every step.

use crate::common::pool;

use cudalloc::{AllocError, Allocation, Config, Pool};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
use pool::{alloc, check, free, past_loading, Sim, GIB, KIB, MIB, S0, S1};
use std::sync::Arc;

const PAGE: u64 = 2 * MIB;
/// A stream that can be captured (the sim refuses the legacy and per-thread default streams).
const CAP: StreamId = StreamId(5);

/// A `default` pool (no layout plans) past its loading, capped at `limit` bytes, on a device of
/// `capacity` bytes with host backing.
fn capped(limit: Option<u64>, capacity: u64) -> (Sim, Pool<Sim>) {
    capped_with(limit, capacity, "")
}

/// [`capped`] with more config keys (`extra` starts with a comma).
fn capped_with(limit: Option<u64>, capacity: u64, extra: &str) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(
        SimConfig::with_capacity(capacity).host_backing(true),
    ));
    let cfg = Config::parse(&format!("policy:default,layout_plans:false{extra}")).unwrap();
    let mut pool = Pool::new(sim.clone(), cfg);
    past_loading(&mut pool);
    pool.set_limit(limit);
    (sim, pool)
}

/// Bytes derived from `seed`, `len` of them.
fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i.wrapping_mul(0x9E37_79B1) >> 11) ^ seed.wrapping_mul(97)) as u8)
        .collect()
}

/// Writes `seed`'s pattern over all of `a`.
fn fill(sim: &SimDevice, a: &Allocation, seed: u64) {
    sim.write(a.ptr(), &pattern(a.size(), seed)).expect("write");
}

/// True when all of `a` holds `seed`'s pattern.
fn holds(sim: &SimDevice, a: &Allocation, seed: u64) -> bool {
    let mut back = vec![0u8; a.size() as usize];
    sim.read(a.ptr(), &mut back).expect("read");
    back == pattern(a.size(), seed)
}

/// A 20 MiB growth mapped as one chunk, then freed, and a live 1.5 MiB block (large pool)
/// placed at its start: the chunk keeps 18 MiB of whole free pages mapped.
fn pinned_chunk(sim: &Sim, pool: &mut Pool<Sim>) -> Allocation {
    let maps = sim.calls(Call::Map);
    let big = alloc(pool, 20 * MIB, S0);
    assert_eq!(
        sim.calls(Call::Map) - maps,
        1,
        "one chunk under the limit too"
    );
    let at = big.ptr();
    free(pool, big);
    let live = alloc(pool, 1536 * KIB, S0);
    assert_eq!(live.ptr(), at);
    fill(sim, &live, 1);
    assert_eq!(sim.mapped_bytes(), 20 * MIB);
    check(sim, pool);
    live
}

#[test]
fn a_growth_past_the_limit_re_makes_a_pinned_chunk_and_keeps_the_live_bytes() {
    let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
    let live = pinned_chunk(&sim, &mut pool);
    let (syncs, waits) = (pool.stats().num_sync_all_streams, pool.stats().device_waits);
    let (maps, unmaps) = (sim.calls(Call::Map), sim.calls(Call::Unmap));

    // 20 MiB more for another stream (its own range) do not fit beside 20 MiB mapped under
    // 24 MiB: the chunk goes, its one live page comes back at its address.
    let grown = alloc(&mut pool, 20 * MIB, S1);
    check(&sim, &pool);
    assert!(
        holds(&sim, &live, 1),
        "the live bytes moved with their page"
    );
    assert_eq!(sim.mapped_bytes(), 22 * MIB);
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 1, "the pinned chunk");
    assert_eq!(
        sim.calls(Call::Map) - maps,
        2,
        "its live page, then the growth"
    );
    let s = pool.stats();
    assert_eq!(
        s.num_sync_all_streams - syncs,
        2,
        "the last rung, then the re-paging"
    );
    assert!(
        s.device_waits - waits >= 3,
        "the device, the copies out and back"
    );
    assert_eq!(s.num_ooms, 0);
    assert_eq!(pool.host_buffer_bytes(), 0, "the staging buffer is freed");

    free(&mut pool, grown);
    free(&mut pool, live);
    check(&sim, &pool);
}

/// Live blocks on both sides of free pages in one chunk, a live block across two chunks and
/// small blocks: every live byte stays, only whole free pages go.
#[test]
fn re_paging_keeps_every_page_a_live_block_touches() {
    let (sim, mut pool) = capped(Some(46 * MIB), 4 * GIB);
    // Two chunks: 40 MiB (one window) and 4 MiB after it.
    let whole = alloc(&mut pool, 44 * MIB, S0);
    let base = whole.ptr();
    free(&mut pool, whole);
    // A 3 MiB block at the start, a 6 MiB one across the window's end (38..44 MiB), and small
    // blocks in their own range; free pages between.
    let first = alloc(&mut pool, 3 * MIB, S0);
    let gap = alloc(&mut pool, 35 * MIB, S0);
    let across = alloc(&mut pool, 6 * MIB, S0);
    assert_eq!((first.ptr(), across.ptr()), (base, base + 38 * MIB));
    free(&mut pool, gap);
    let small: Vec<Allocation> = (0..4).map(|_| alloc(&mut pool, 300 * KIB, S0)).collect();
    let live: Vec<&Allocation> = [&first, &across].into_iter().chain(&small).collect();
    for (k, a) in live.iter().enumerate() {
        fill(&sim, a, k as u64 + 10);
    }
    check(&sim, &pool);
    assert_eq!(
        sim.mapped_bytes(),
        44 * MIB + PAGE,
        "the two chunks and a small page"
    );
    let (maps, unmaps) = (sim.calls(Call::Map), sim.calls(Call::Unmap));

    // 10 MiB more for another stream pass the limit unless the 34 MiB of whole free pages
    // between the 3 MiB block's second page and the 6 MiB block go back.
    let grown = alloc(&mut pool, 10 * MIB, S1);
    check(&sim, &pool);
    for (k, a) in live.iter().enumerate() {
        assert!(holds(&sim, a, k as u64 + 10), "live block {k}");
    }
    // Kept: pages 0-1 (the 3 MiB block), the page at 38 MiB (the 6 MiB block's first; the
    // chunk after it, which no free page touches, stays whole), the small page; the growth.
    assert_eq!(sim.mapped_bytes(), 3 * PAGE + 4 * MIB + PAGE + 10 * MIB);
    // One chunk per run of kept pages (0-4 MiB, 38-40 MiB), then the growth.
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 1);
    assert_eq!(sim.calls(Call::Map) - maps, 3);
    free(&mut pool, grown);
    for a in [first, across].into_iter().chain(small) {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

#[test]
fn during_a_capture_the_pinned_chunk_stays_and_the_growth_fails() {
    let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
    let live = pinned_chunk(&sim, &mut pool);
    let pages = sim.live_pages();
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let r = pool.allocate(20 * MIB, CAP);
    assert!(matches!(r, Err(AllocError::OutOfMemory { .. })), "{r:?}");
    sim.end_capture(CAP).expect("no call the capture forbids");
    pool.end_capture(CaptureMode::Global).unwrap();
    assert_eq!(sim.live_pages(), pages);
    assert_eq!(sim.mapped_bytes(), 20 * MIB);
    assert!(holds(&sim, &live, 1));
    check(&sim, &pool);
    // Outside the capture the same request is served.
    let grown = alloc(&mut pool, 20 * MIB, CAP);
    assert!(holds(&sim, &live, 1));
    check(&sim, &pool);
    free(&mut pool, grown);
    free(&mut pool, live);
}

/// A growth of 20 MiB on stream 1 fails out of memory and the chunk `pinned_chunk` made stays
/// as it was, its live bytes included.
fn pinned_chunk_stays(sim: &Sim, pool: &mut Pool<Sim>) {
    let live = pinned_chunk(sim, pool);
    let r = pool.allocate(20 * MIB, S1);
    assert!(matches!(r, Err(AllocError::OutOfMemory { .. })), "{r:?}");
    assert_eq!(sim.mapped_bytes(), 20 * MIB);
    assert!(holds(sim, &live, 1));
    check(sim, pool);
    free(pool, live);
}

/// Without a limit the device's own capacity ends the ladder as before: the last resort is the
/// capped mode's.
#[test]
fn without_a_limit_a_full_device_does_not_re_page() {
    let (sim, mut pool) = capped(None, 24 * MIB);
    pinned_chunk_stays(&sim, &mut pool);
}

/// A re-made chunk holds only the pages its live blocks touched: once they are freed it goes
/// back alone.
#[test]
fn a_re_made_chunk_goes_back_once_its_blocks_are_freed() {
    let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
    let live = pinned_chunk(&sim, &mut pool);
    let grown = alloc(&mut pool, 20 * MIB, S1);
    free(&mut pool, live);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(
        sim.mapped_bytes(),
        20 * MIB,
        "the re-made chunk went back alone"
    );
    free(&mut pool, grown);
    pool.empty_cache().unwrap();
    assert_eq!(sim.mapped_bytes(), 0);
    check(&sim, &pool);
}

/// A shareable segment's chunks may have been exported: another process would keep the old
/// physical allocation, so they stay as they are and the growth fails as before.
#[test]
fn chunks_of_shareable_segments_are_not_re_paged() {
    let (sim, mut pool) = capped_with(Some(24 * MIB), 4 * GIB, ",shareable_segments:True");
    pinned_chunk_stays(&sim, &mut pool);
}

/// One failed driver call anywhere in the allocation that re-makes the chunk: the allocation
/// may fail, but every invariant holds and the live bytes stay; the next try succeeds.
#[test]
fn a_failed_call_while_re_making_loses_no_byte() {
    for k in 1..64 {
        let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
        let live = pinned_chunk(&sim, &mut pool);
        sim.fail_call(k);
        let r = pool.allocate(20 * MIB, S1);
        sim.clear_faults();
        check(&sim, &pool);
        assert!(holds(&sim, &live, 1), "k={k}: bytes lost");
        // A chunk whose new pages could not be created stays: out of memory, as before.
        if let Err(e) = &r {
            let ok = matches!(e, AllocError::Device(_) | AllocError::OutOfMemory { .. });
            assert!(ok, "k={k}: {e:?}");
        }
        let grown = r.unwrap_or_else(|_| alloc(&mut pool, 20 * MIB, S1));
        assert!(holds(&sim, &live, 1), "k={k}: bytes lost on the next try");
        check(&sim, &pool);
        free(&mut pool, grown);
        free(&mut pool, live);
    }
}

#[test]
fn with_repage_under_cap_off_a_capped_pool_maps_single_pages_and_moves_nothing() {
    let (sim, mut pool) = capped_with(Some(24 * MIB), 4 * GIB, ",repage_under_cap:False");
    let maps = sim.calls(Call::Map);
    let big = alloc(&mut pool, 20 * MIB, S0);
    assert_eq!(sim.calls(Call::Map) - maps, 10, "one page per call");
    free(&mut pool, big);
    let live = alloc(&mut pool, 1536 * KIB, S0);
    fill(&sim, &live, 1);
    let syncs = pool.stats().num_sync_all_streams;
    let grown = alloc(&mut pool, 20 * MIB, S1);
    assert!(holds(&sim, &live, 1));
    assert!(sim.mapped_bytes() <= 24 * MIB);
    assert!(
        pool.stats().num_sync_all_streams - syncs <= 1,
        "at most the last rung's wait, no re-paging"
    );
    check(&sim, &pool);
    free(&mut pool, grown);
    free(&mut pool, live);
}

type Caching = cudalloc::CachingAllocator<Sim>;

/// A `CachingAllocator` (thread caches on, several stream shards) whose stream-0 shard holds a
/// 20 MiB chunk that a live 1.5 MiB block (filled with pattern 3) pins, capped 4 MiB above what
/// is mapped.
fn caching_pinned() -> (Sim, Caching, Allocation) {
    let sim = Arc::new(SimDevice::new(
        SimConfig::with_capacity(4 * GIB).host_backing(true),
    ));
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    let alloc = Caching::new(sim.clone(), cfg);
    let big = alloc.allocate(20 * MIB, S0).unwrap();
    let at = big.ptr();
    alloc.free(big).unwrap();
    alloc.empty_cache().unwrap();
    let big = alloc.allocate(20 * MIB, S0).unwrap();
    assert_eq!(big.ptr(), at);
    alloc.free(big).unwrap();
    let live = alloc.allocate(1536 * KIB, S0).unwrap();
    fill(&sim, &live, 3);
    alloc.set_memory_limit(Some(sim.mapped_bytes() + 4 * MIB));
    (sim, alloc, live)
}

/// Through `CachingAllocator`: the first try of a growth past the limit stops before the last
/// resort, the caches and the other shards give their cached memory back, and every shard's
/// last resort re-pages the chunk a live block of another stream's shard pins.
#[test]
fn a_caching_allocator_re_pages_on_its_second_try() {
    let (sim, alloc, live) = caching_pinned();
    let grown = alloc.allocate(20 * MIB, S1).unwrap();
    alloc.check_invariants().unwrap();
    assert!(
        holds(&sim, &live, 3),
        "the live bytes moved with their page"
    );
    assert!(alloc.reserved_bytes() <= sim.mapped_bytes());
    alloc.free(grown).unwrap();
    alloc.free(live).unwrap();
    alloc.check_invariants().unwrap();
}

/// The same with each driver call failing in turn: the allocation succeeds or fails with a
/// device error or out of memory (or of address space), never loses the live bytes, and the
/// invariants hold.
#[test]
fn a_caching_allocator_loses_no_byte_when_a_call_of_its_last_resort_fails() {
    for k in 1..48 {
        let (sim, alloc, live) = caching_pinned();
        sim.fail_call(k);
        let r = alloc.allocate(20 * MIB, S1);
        sim.clear_faults();
        alloc.check_invariants().unwrap();
        assert!(holds(&sim, &live, 3), "k={k}: bytes lost");
        match r {
            Ok(a) => alloc.free(a).unwrap(),
            Err(e) => assert!(
                matches!(e, AllocError::Device(_)) || e.is_out_of_memory(),
                "k={k}: {e:?}"
            ),
        }
        alloc.free(live).unwrap();
        alloc.check_invariants().unwrap();
    }
}
