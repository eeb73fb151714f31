//! The `default` policy under a memory limit (`policy::default::budget`, `pool::repage`): growth
//! maps chunks of up to `max_chunk_mb` as without a limit, and when a growth does not fit even
//! after every cached chunk went back, the chunks live blocks keep mapped are made again from
//! the pages those blocks touch and their free pages go back (not those of shareable segments,
//! not during a capture, not without a limit). On the simulated device with host backing, so the bytes
//! of the live blocks are checked across it, each driver call of it failing in turn; the core's
//! invariants hold after every step.

use crate::common::{assert_device_empty, pool};

use cudalloc::{AllocError, Allocation, Config, Pool};
use cudalloc_sys::wrap::LogCalls;
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

/// The device calls re-paging makes besides the chunks': map, unmap, copy_device_async,
/// alloc_host, copy_to_host_async.
const EXTRA: [Call; 5] = [
    Call::Map,
    Call::Unmap,
    Call::CopyDeviceAsync,
    Call::AllocHost,
    Call::CopyToHostAsync,
];

/// The counts of [`EXTRA`] now.
fn sim_calls(sim: &SimDevice) -> [u64; 5] {
    EXTRA.map(|c| sim.calls(c))
}

/// The counts of [`EXTRA`] since `before`.
fn delta(sim: &SimDevice, before: &[u64; 5]) -> [u64; 5] {
    let now = sim_calls(sim);
    std::array::from_fn(|i| now[i] - before[i])
}

/// [`check`] where pages may be strays: the device holds the pool's bytes and its strays.
fn check_held(sim: &SimDevice, pool: &Pool<Sim>) {
    pool.check_invariants().unwrap();
    sim.check_invariants();
    let held = pool.reserved() + pool.excess().stray;
    assert_eq!(sim.outstanding_bytes(), held, "device vs held");
}

/// The device holds no virtual range but the pool's segments: every scratch range was freed.
fn no_scratch_left(sim: &SimDevice, pool: &Pool<Sim>) {
    let snap = pool.snapshot();
    let segments = snap.segments.iter().filter(|s| s.expandable);
    assert_eq!(
        sim.reserved_va_bytes(),
        segments.map(|s| s.size).sum::<u64>()
    );
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
    let calls = pool.stats().calls;
    let before = sim_calls(&sim);

    // 20 MiB more for another stream (its own range) do not fit beside 20 MiB mapped under
    // 24 MiB: the chunk goes, its one live page comes back at its address.
    let grown = alloc(&mut pool, 20 * MIB, S1);
    check(&sim, &pool);
    assert!(
        holds(&sim, &live, 1),
        "the live bytes moved with their page"
    );
    assert_eq!(sim.mapped_bytes(), 22 * MIB);
    let s = pool.stats();
    assert_eq!(s.calls.unmaps - calls.unmaps, 1, "the pinned chunk");
    assert_eq!(
        s.calls.maps - calls.maps,
        2,
        "its live page, then the growth"
    );
    // On the device besides: the live page mapped at the scratch range and unmapped from it,
    // the scratch range reserved and freed, one copy on the device and none through the host.
    let d = delta(&sim, &before);
    assert_eq!((d[0], d[1]), (3, 2), "maps, unmaps");
    assert_eq!(d[2], 1, "copies on the device");
    assert_eq!((d[3], d[4]), (0, 0), "no host buffer, no host copy");
    no_scratch_left(&sim, &pool);
    assert_eq!(
        s.num_sync_all_streams - syncs,
        2,
        "the last rung, then the re-paging"
    );
    // The last rung has no whole chunk to unmap, so it does not wait.
    assert_eq!(
        s.device_waits - waits,
        2,
        "re-paging's: the device, the chunk's copy"
    );
    assert_eq!(s.num_ooms, 0);
    assert_eq!(pool.host_buffer_bytes(), 0);
    assert_eq!(sim.host_bytes(), 0);

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
    let calls = pool.stats().calls;
    let before = sim_calls(&sim);

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
    let s = pool.stats().calls;
    assert_eq!(s.unmaps - calls.unmaps, 1);
    assert_eq!(s.maps - calls.maps, 3);
    // Both runs hold live bytes: mapped at the scratch range and unmapped from it too; one
    // copy each.
    let d = delta(&sim, &before);
    assert_eq!((d[0], d[1], d[2]), (5, 3, 2), "maps, unmaps, copies");
    no_scratch_left(&sim, &pool);
    free(&mut pool, grown);
    for a in [first, across].into_iter().chain(small) {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// Two chunks re-made in one re-paging, the scratch range reused for the second, with a live
/// block across their boundary and free pages in both: each chunk's part of it lands in that
/// chunk's new allocation, and every live byte stays.
#[test]
fn one_re_paging_re_makes_two_chunks_a_live_block_spans() {
    let (sim, mut pool) = capped(Some(84 * MIB), 4 * GIB);
    // Two 40 MiB chunks (two windows).
    let whole = alloc(&mut pool, 80 * MIB, S0);
    let base = whole.ptr();
    free(&mut pool, whole);
    // 3 MiB at 0, 8 MiB across the windows' boundary (36..44 MiB), 4 MiB at 76 MiB; the gaps
    // between them freed: 32 MiB of whole free pages in each chunk.
    let sizes = [3, 33, 8, 32, 4].map(|m| m * MIB);
    let mut blocks: Vec<Allocation> = sizes.iter().map(|&n| alloc(&mut pool, n, S0)).collect();
    let offsets: Vec<u64> = blocks.iter().map(|a| a.ptr() - base).collect();
    assert_eq!(offsets, [0, 3, 36, 44, 76].map(|m| m * MIB));
    free(&mut pool, blocks.remove(3));
    free(&mut pool, blocks.remove(1));
    for (k, a) in blocks.iter().enumerate() {
        fill(&sim, a, k as u64 + 20);
    }
    assert_eq!(sim.mapped_bytes(), 80 * MIB);
    let calls = pool.stats().calls;
    let before = sim_calls(&sim);

    // 30 MiB more for another stream pass the limit unless both chunks' free pages go back.
    let grown = alloc(&mut pool, 30 * MIB, S1);
    check(&sim, &pool);
    no_scratch_left(&sim, &pool);
    for (k, a) in blocks.iter().enumerate() {
        assert!(holds(&sim, a, k as u64 + 20), "live block {k}");
    }
    // Kept: 0-4, 36-40 (first chunk), 40-44, 76-80 MiB (second); then the growth, with its
    // window's slack where the budget leaves room.
    let kept = 16 * MIB;
    assert!((kept + 30 * MIB..=kept + 40 * MIB).contains(&sim.mapped_bytes()));
    let s = pool.stats().calls;
    assert_eq!(s.unmaps - calls.unmaps, 2, "both chunks");
    assert!(s.maps - calls.maps >= 5, "four kept runs, then the growth");
    // Each kept run holds live bytes: four copies, one per run.
    assert_eq!(delta(&sim, &before)[2], 4, "copies on the device");
    free(&mut pool, grown);
    for a in blocks {
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

/// The names of the calls of [`last_resort_calls`] that faults of `kind` count (acquiring or
/// release calls), in order.
fn counted(release: bool) -> Vec<&'static str> {
    let calls = last_resort_calls().into_iter();
    calls
        .filter(|c| c.is_release() == release)
        .map(Call::name)
        .collect()
}

/// Each acquiring call of the allocation that re-makes the chunk failing in turn: the
/// allocation may fail, but every invariant holds, the live bytes stay and no scratch range is
/// left; a failure while the bytes are copied leaves the chunk as it was, and one of the map at
/// the chunk's address is tried again with the same page. The next try succeeds.
#[test]
fn a_failed_call_while_re_making_loses_no_byte() {
    let calls = counted(false);
    // From the copy stream on: the scratch range, the copy and its wait, the live page's map at
    // its address; then the growth.
    let from = calls.iter().position(|&c| c == "open_stream").unwrap();
    assert_eq!(
        calls[from..from + 11],
        [
            "open_stream",
            "reserve",
            "create_page",
            "map",
            "set_access",
            "copy_device_async",
            "create_event",
            "record_event",
            "synchronize_event",
            "map",
            "set_access"
        ]
    );
    for (i, name) in calls.iter().enumerate() {
        let k = i as u64 + 1;
        let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
        let live = pinned_chunk(&sim, &mut pool);
        sim.fail_call(k);
        let r = pool.allocate(20 * MIB, S1);
        sim.clear_faults();
        check(&sim, &pool);
        no_scratch_left(&sim, &pool);
        assert!(holds(&sim, &live, 1), "{name} (k={k}): bytes lost");
        if (from..from + 9).contains(&i) {
            assert_eq!(
                sim.mapped_bytes(),
                20 * MIB,
                "{name} (k={k}): the chunk stays"
            );
            assert!(r.is_err(), "{name} (k={k}): nothing was given back");
        }
        if (from + 9..from + 11).contains(&i) {
            assert!(r.is_ok(), "{name} (k={k}): mapped again");
        }
        if let Err(e) = &r {
            let ok = matches!(e, AllocError::Device(_) | AllocError::OutOfMemory { .. });
            assert!(ok, "{name} (k={k}): {e:?}");
        }
        let grown = r.unwrap_or_else(|_| alloc(&mut pool, 20 * MIB, S1));
        assert!(
            holds(&sim, &live, 1),
            "{name} (k={k}): bytes lost on the next try"
        );
        check(&sim, &pool);
        no_scratch_left(&sim, &pool);
        free(&mut pool, grown);
        free(&mut pool, live);
    }
}

/// The map of the live page at its chunk's address failing twice in a row (the page and its
/// retry): its bytes are lost, but a fresh allocation keeps its addresses mapped, so every
/// invariant holds and the pool goes on.
#[test]
fn a_live_page_whose_map_fails_twice_is_lost_but_its_addresses_stay_mapped() {
    let calls = counted(false);
    let from = calls.iter().position(|&c| c == "open_stream").unwrap();
    // The 1-based number of the live page's first map at its address.
    let k = (from + 10) as u64;
    assert_eq!(calls[from + 9], "map");
    let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
    let live = pinned_chunk(&sim, &mut pool);
    sim.fail_call(k);
    sim.fail_every(k + 1);
    let r = pool.allocate(20 * MIB, S1);
    sim.clear_faults();
    check(&sim, &pool);
    no_scratch_left(&sim, &pool);
    assert!(!holds(&sim, &live, 1), "a fresh page holds other bytes");
    let grown = r.unwrap_or_else(|_| alloc(&mut pool, 20 * MIB, S1));
    check(&sim, &pool);
    fill(&sim, &live, 2);
    assert!(
        holds(&sim, &live, 2),
        "the live block's addresses are usable"
    );
    free(&mut pool, grown);
    free(&mut pool, live);
    check(&sim, &pool);
}

/// Each release call of the allocation that re-makes the chunk failing in turn (the unmap from
/// the scratch range included: its page stays mapped there, the chunk as it was, and the
/// scratch range is freed once that page is unmapped): the live bytes stay, every invariant
/// holds, and once the pool is dropped the device holds nothing.
#[test]
fn a_failed_release_while_re_making_loses_no_byte_and_leaks_nothing() {
    let calls = counted(true);
    assert!(
        calls.contains(&"unmap") && calls.contains(&"unreserve"),
        "{calls:?}"
    );
    for (i, name) in calls.iter().enumerate() {
        let k = i as u64 + 1;
        let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
        let live = pinned_chunk(&sim, &mut pool);
        sim.fail_release(k);
        let r = pool.allocate(20 * MIB, S1);
        sim.clear_faults();
        check_held(&sim, &pool);
        assert!(holds(&sim, &live, 1), "{name} (k={k}): bytes lost");
        let grown = r.unwrap_or_else(|_| alloc(&mut pool, 20 * MIB, S1));
        assert!(
            holds(&sim, &live, 1),
            "{name} (k={k}): bytes lost on the next try"
        );
        check_held(&sim, &pool);
        free(&mut pool, grown);
        free(&mut pool, live);
        drop(pool);
        assert_device_empty(&sim, &format!("{name} (k={k})"));
    }
}

/// The page of the live block stuck at the scratch range (its unmap refused): the chunk stays
/// as it was, the page counts against the limit, and the next re-paging unmaps it, frees the
/// scratch range left and makes the chunk again.
#[test]
fn a_page_stuck_at_the_scratch_range_goes_at_the_next_re_paging() {
    let calls = counted(true);
    let sync = counted(false);
    assert!(sync.contains(&"synchronize_event"));
    // The first unmap after the copy's wait is the scratch range's: the releases before the
    // last resort's are counted from the log of the same steps.
    let (sim, mut pool) = capped(Some(24 * MIB), 4 * GIB);
    let live = pinned_chunk(&sim, &mut pool);
    let all = last_resort_calls();
    let wait = all
        .iter()
        .position(|&c| c == Call::SynchronizeEvent)
        .unwrap();
    let k = all[..wait].iter().filter(|c| c.is_release()).count() as u64 + 1;
    assert_eq!(calls[k as usize - 1], "unmap");
    let pages = sim.live_pages();
    sim.fail_release(k);
    let r = pool.allocate(20 * MIB, S1);
    sim.clear_faults();
    assert!(r.is_err(), "{r:?}");
    check_held(&sim, &pool);
    assert_eq!(
        pool.excess().stray,
        2 * MIB,
        "the stuck page counts against the limit"
    );
    assert!(holds(&sim, &live, 1));
    assert_eq!(
        sim.mapped_bytes(),
        20 * MIB + 2 * MIB,
        "the chunk and the stuck page"
    );
    assert_eq!(sim.live_pages(), pages + 1);
    let held_va = pool.snapshot().segments.iter().map(|s| s.size).sum::<u64>();
    assert!(
        sim.reserved_va_bytes() > held_va,
        "the scratch range is left"
    );
    let grown = alloc(&mut pool, 20 * MIB, S1);
    check(&sim, &pool);
    no_scratch_left(&sim, &pool);
    assert!(holds(&sim, &live, 1));
    assert_eq!(sim.mapped_bytes(), 22 * MIB);
    free(&mut pool, grown);
    free(&mut pool, live);
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
    for k in 1..64 {
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

/// The device calls of the allocation that forces the last resort after [`pinned_chunk`], in
/// order, read from a call log of the same steps.
fn last_resort_calls() -> Vec<Call> {
    let sim = Arc::new(SimDevice::new(
        SimConfig::with_capacity(4 * GIB).host_backing(true),
    ));
    let log = Arc::new(LogCalls::new(sim.clone()));
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    let mut pool = Pool::new(log.clone(), cfg);
    let a = pool.allocate(512, S0).unwrap();
    pool.free(a).unwrap();
    pool.empty_cache().unwrap();
    pool.set_limit(Some(24 * MIB));
    let big = pool.allocate(20 * MIB, S0).unwrap();
    pool.free(big).unwrap();
    let live = pool.allocate(1536 * KIB, S0).unwrap();
    log.take_lines();
    let grown = pool.allocate(20 * MIB, S1).unwrap();
    let calls = log.take_lines().into_iter().map(|line| {
        let name = line.split('(').next().unwrap_or_default().to_owned();
        *Call::ALL.iter().find(|c| c.name() == name).expect("a call")
    });
    let calls = calls.collect();
    pool.free(grown).unwrap();
    pool.free(live).unwrap();
    calls
}
