//! `move_pages` (`pool::moving`, `policy::default::behind`): a growth maps the pages of its
//! stream's releasing blocks at its own addresses before it creates pages, so that pages a
//! give-back left on their way back (the device runs behind) are not held twice; the old
//! addresses are unmapped, the pages kept, once the device catches up. Pages of another stream
//! never move, nor any during a capture. Run with `SimDevice::set_auto_complete(false)`, so that
//! work completes only when the test says. The core's invariants, and the device's, hold after
//! every step.

use crate::common::pool;

use cudalloc::policy::default::DefaultConfig;
use cudalloc::snapshot::BlockState;
use cudalloc::{Allocation, Pool};
use cudalloc_sys::{Call, CaptureMode, Device, StreamId};
use pool::{alloc, check, free, Sim, MIB, S0, S1};

/// A stream that can be captured (not a legacy default stream).
const CAP: StreamId = StreamId(5);

/// A pool of `default` (no layout plans; `move_pages` as `moving`, 2 MiB chunks and `budget`)
/// past its loading on a 16 GiB device whose work completes only when told.
fn lagging(moving: bool, budget: f64) -> (Sim, Pool<Sim>) {
    let mut d = DefaultConfig {
        max_chunk: 2 * MIB,
        fragmentation_budget: budget,
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.move_pages = moving;
    pool::behind(d)
}

/// Bytes of physical memory the device holds.
fn used(sim: &Sim) -> u64 {
    let (free, total) = sim.mem_info().unwrap();
    total - free
}

/// A 30 MiB and a 6 MiB free block, each before a live 2 MiB block, the second pair on
/// `stream` (a 75% budget): a 34 MiB growth on stream 0 then passes the budget by 4 MiB, and
/// the 6 MiB block is the one the budget gives back. Returns the live blocks.
fn layout_with_excess(pool: &mut Pool<Sim>, stream: StreamId) -> [Allocation; 2] {
    let large = alloc(pool, 30 * MIB, S0);
    let k1 = alloc(pool, 2 * MIB, S0);
    let small = alloc(pool, 6 * MIB, stream);
    let k2 = alloc(pool, 2 * MIB, stream);
    free(pool, large);
    free(pool, small);
    [k1, k2]
}

/// Lets the device catch up, polls (a small allocation), frees `live` and empties the cache:
/// nothing stays mapped.
fn finish(sim: &Sim, mut pool: Pool<Sim>, live: impl IntoIterator<Item = Allocation>) {
    sim.complete_all();
    let poll = alloc(&mut pool, 512, S0);
    check(sim, &pool);
    for a in live.into_iter().chain([poll]) {
        free(&mut pool, a);
    }
    pool.empty_cache().unwrap();
    check(sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(used(sim), 0);
}

/// The 6 MiB block the budget gives back for a 34 MiB growth of its own stream, with the device
/// behind: its 3 pages become the growth's first 6 MiB (14 pages created, not 17), and the
/// device holds 28 MiB more, not 34. Its old addresses stay mapped to them until the device
/// catches up; then they are unmapped and no page is released.
#[test]
fn a_growth_maps_the_pages_its_give_back_left_on_their_way_back() {
    for moving in [true, false] {
        let (sim, mut pool) = lagging(moving, 0.75);
        let live = layout_with_excess(&mut pool, S0);
        let (pages, before) = (sim.calls(Call::CreatePage), used(&sim));
        let grown = alloc(&mut pool, 34 * MIB, S0);
        check(&sim, &pool);
        let created = sim.calls(Call::CreatePage) - pages;
        assert_eq!(created, if moving { 14 } else { 17 }, "moving {moving}");
        assert_eq!(pool.stats().pages_moved, if moving { 3 } else { 0 });
        let grew = used(&sim) - before;
        assert_eq!(grew, if moving { 28 * MIB } else { 34 * MIB });
        assert_eq!(pool.releasing_bytes(), 0, "moving {moving}");
        // Moved: the old addresses still map the pages until the device catches up.
        let doubled = if moving { 6 * MIB } else { 0 };
        assert_eq!(sim.mapped_bytes(), pool.reserved() + doubled);
        if moving {
            sim.complete_all();
            let (unmaps, releases) = (sim.calls(Call::Unmap), sim.calls(Call::ReleasePage));
            let poll = alloc(&mut pool, 512, S0);
            check(&sim, &pool);
            assert_eq!(sim.calls(Call::Unmap) - unmaps, 3, "the old addresses");
            assert_eq!(sim.calls(Call::ReleasePage), releases, "the pages stay");
            assert_eq!(sim.mapped_bytes(), pool.reserved());
            free(&mut pool, poll);
        }
        finish(&sim, pool, live.into_iter().chain([grown]));
    }
}

/// Pages of another stream's give-back do not move (its queued work is not ordered before the
/// growth's uses): the growth creates its 17 pages, and the 6 MiB block is cached again
/// (`keep_while_behind`).
#[test]
fn pages_of_another_stream_do_not_move() {
    let (sim, mut pool) = lagging(true, 0.75);
    let live = layout_with_excess(&mut pool, S1);
    let pages = sim.calls(Call::CreatePage);
    let grown = alloc(&mut pool, 34 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::CreatePage) - pages, 17);
    assert_eq!(pool.stats().pages_moved, 0);
    assert_eq!(pool.releasing_bytes(), 0, "taken back into the cache");
    finish(&sim, pool, live.into_iter().chain([grown]));
}

/// A 40 MiB free block of the small pool (forty 1 MiB blocks freed, one kept after them) given
/// back whole for a 20 MiB growth of the large pool (a 2% budget) with the device behind: the
/// growth takes its first 10 pages, and the rest (20 MiB) stays on its way back with an event
/// of its own, to be unmapped and released once the device catches up. All on `stream`.
/// Returns the device, the pool and the live blocks.
fn partly_moved(stream: StreamId) -> (Sim, Pool<Sim>, [Allocation; 2]) {
    let (sim, mut pool) = lagging(true, 0.02);
    let small: Vec<Allocation> = (0..40).map(|_| alloc(&mut pool, MIB, stream)).collect();
    let k = alloc(&mut pool, MIB, stream);
    for a in small {
        free(&mut pool, a);
    }
    let pages = sim.calls(Call::CreatePage);
    let grown = alloc(&mut pool, 20 * MIB, stream);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::CreatePage), pages, "no page created");
    assert_eq!(pool.stats().pages_moved, 10);
    assert_eq!(pool.releasing_bytes(), 20 * MIB);
    (sim, pool, [k, grown])
}

#[test]
fn the_rest_of_a_partly_moved_block_stays_on_its_way_back() {
    let (sim, mut pool, live) = partly_moved(S0);
    let in_state = |state| -> Vec<u64> {
        let snap = pool.snapshot();
        let blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
        blocks
            .filter(|b| b.state == state)
            .map(|b| b.size)
            .collect()
    };
    assert_eq!(in_state(BlockState::Moved), [20 * MIB], "the moved part");
    assert_eq!(in_state(BlockState::Releasing), [20 * MIB], "the rest");
    sim.complete_all();
    let releases = sim.calls(Call::ReleasePage);
    let poll = alloc(&mut pool, 512, S0);
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    assert_eq!(
        sim.calls(Call::ReleasePage) - releases,
        10,
        "the rest's pages"
    );
    assert_eq!(sim.mapped_bytes(), pool.reserved());
    free(&mut pool, poll);
    finish(&sim, pool, live);
}

/// During a capture no page moves (a graph may be launched on another stream): the growth
/// creates its pages, and the releasing rest of [`partly_moved`] stays as it was.
#[test]
fn no_page_moves_during_a_capture() {
    let (sim, mut pool, live) = partly_moved(CAP);
    let pages = sim.calls(Call::CreatePage);
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let captured = alloc(&mut pool, 20 * MIB, CAP);
    sim.end_capture(CAP).expect("no call the capture forbids");
    pool.end_capture(CaptureMode::Global).unwrap();
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::CreatePage) - pages, 10);
    assert_eq!(pool.stats().pages_moved, 10, "as before the capture");
    assert_eq!(pool.releasing_bytes(), 20 * MIB);
    finish(&sim, pool, live.into_iter().chain([captured]));
}

/// `empty_cache` and dropping the pool wait for moved blocks as for releasing ones: their old
/// addresses are unmapped, and the device ends empty.
#[test]
fn empty_cache_and_drop_unmap_the_old_addresses() {
    let (sim, mut pool, [k, grown]) = partly_moved(S0);
    free(&mut pool, grown);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    assert_eq!(sim.mapped_bytes(), pool.reserved());
    finish(&sim, pool, [k]);
    let (sim, pool, _live) = partly_moved(S0);
    drop(pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(used(&sim), 0);
}

/// A pool put to sleep with a moved block (and the releasing rest of it) holds no page on the
/// device, and wakes with its live blocks' chunks mapped at their addresses again.
#[test]
fn a_pool_sleeps_and_wakes_with_a_moved_block() {
    let (sim, mut pool, live) = partly_moved(S0);
    let reserved = pool.reserved();
    pool.sleep(false).unwrap();
    check(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(used(&sim), 0);
    pool.wake(S0).unwrap();
    check(&sim, &pool);
    assert!(
        pool.reserved() <= reserved,
        "{} > {reserved}",
        pool.reserved()
    );
    assert_eq!(sim.mapped_bytes(), pool.reserved());
    finish(&sim, pool, live);
}

/// Under a cap of 70 MiB the 34 MiB growth of [`layout_with_excess`] (40 MiB reserved) gives
/// back the 6 MiB block for the cap, and the device is behind: with the rule the growth takes
/// its pages and fits (68 MiB), with no wait; without it, it does not fit until the ladder
/// waits for them.
#[test]
fn under_a_cap_a_growth_takes_the_pages_instead_of_waiting() {
    for moving in [true, false] {
        let (sim, mut pool) = lagging(moving, 0.75);
        pool.set_limit(Some(70 * MIB));
        let live = layout_with_excess(&mut pool, S0);
        let waits = || sim.calls(Call::SynchronizeEvent) + sim.calls(Call::SynchronizeDevice);
        let before = waits();
        let grown = alloc(&mut pool, 34 * MIB, S0);
        check(&sim, &pool);
        assert_eq!(waits() == before, moving, "moving {moving}: waits");
        assert_eq!(pool.stats().pages_moved, if moving { 3 } else { 0 });
        assert!(pool.reserved() <= 70 * MIB);
        finish(&sim, pool, live.into_iter().chain([grown]));
    }
}

/// An unmap of moved addresses that fails (the third of the block's ten) leaves the block moved,
/// with the addresses not yet unmapped still mapped and the invariants holding, and is tried
/// again at the next poll; no page is released for it.
#[test]
fn a_failed_unmap_of_moved_addresses_is_tried_again() {
    let (sim, mut pool, live) = partly_moved(S0);
    sim.complete_all();
    let releases = sim.calls(Call::ReleasePage);
    sim.fail_release(3);
    let first = alloc(&mut pool, 512, S0);
    check(&sim, &pool);
    sim.clear_faults();
    let moved = |pool: &Pool<Sim>| {
        let snap = pool.snapshot();
        let mut blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
        blocks.any(|b| b.state == BlockState::Moved)
    };
    assert!(moved(&pool), "still moved after the failed unmap");
    let second = alloc(&mut pool, 512, S0);
    check(&sim, &pool);
    assert!(!moved(&pool), "unmapped at the next poll");
    assert_eq!(sim.mapped_bytes(), pool.reserved());
    // The rest's 10 pages only: the moved addresses' pages stay with the growth.
    assert_eq!(sim.calls(Call::ReleasePage) - releases, 10);
    for a in [first, second] {
        free(&mut pool, a);
    }
    finish(&sim, pool, live);
}

/// When the event of a partly moved block's rest cannot be recorded, the rest is free again at
/// once (its stream's order makes it safe): it counts as taken back (`Stats::taken_back_bytes`),
/// as it counted as given back. Found by failing each acquiring call of the growth in turn.
#[test]
fn a_rest_whose_event_fails_counts_as_taken_back() {
    let mut found = false;
    for k in 1..60 {
        let (sim, mut pool) = lagging(true, 0.02);
        let small: Vec<Allocation> = (0..40).map(|_| alloc(&mut pool, MIB, S0)).collect();
        let keep = alloc(&mut pool, MIB, S0);
        for a in small {
            free(&mut pool, a);
        }
        sim.fail_call(k);
        let grown = pool.allocate(20 * MIB, S0);
        sim.clear_faults();
        check(&sim, &pool);
        let s = pool.stats();
        if let Ok(g) = grown {
            if s.pages_moved == 10 && pool.releasing_bytes() == 0 {
                found = true;
                assert_eq!(s.given_back_bytes, 40 * MIB, "call {k}");
                assert_eq!(s.taken_back_bytes, 20 * MIB, "call {k}: the rest");
            }
            free(&mut pool, g);
        }
        finish(&sim, pool, [keep]);
    }
    assert!(found, "no call failed the rest's event record");
}

/// A moved block whose unmap fails inside the out-of-memory ladder's wait holds back only its
/// own stream's releases: the pages another stream gave back are unmapped, and the growth that
/// needed them fits at once, without giving back the whole cache.
#[test]
fn a_failed_moved_unmap_in_the_ladder_keeps_the_cache() {
    let (sim, mut pool) = lagging(true, 0.02);
    let mut live = Vec::new();
    // Stream 0: 20 MiB given back, all of it moved to a growth.
    let small: Vec<Allocation> = (0..20).map(|_| alloc(&mut pool, MIB, S0)).collect();
    live.push(alloc(&mut pool, MIB, S0));
    for a in small {
        free(&mut pool, a);
    }
    live.push(alloc(&mut pool, 20 * MIB, S0));
    // Stream 1: 40 MiB given back under a cap for a growth of stream 0, which cannot take
    // them (without a cap they would be cached again: `keep_while_behind`).
    let small: Vec<Allocation> = (0..40).map(|_| alloc(&mut pool, MIB, S1)).collect();
    live.push(alloc(&mut pool, MIB, S1));
    for a in small {
        free(&mut pool, a);
    }
    pool.set_limit(Some(pool.reserved() + 24 * MIB));
    live.push(alloc(&mut pool, 20 * MIB, S0));
    check(&sim, &pool);
    assert_eq!(pool.stats().pages_moved, 10);
    assert_eq!(pool.releasing_bytes(), 40 * MIB, "stream 1's");
    pool.set_limit(Some(pool.reserved() + 4 * MIB));
    let syncs = pool.stats().num_sync_all_streams;
    // The first release call: the unmap of stream 0's moved addresses, which started
    // releasing first.
    sim.fail_release(1);
    let grown = alloc(&mut pool, 16 * MIB, StreamId(2));
    sim.clear_faults();
    check(&sim, &pool);
    assert_eq!(
        pool.stats().num_sync_all_streams,
        syncs,
        "the cache was kept"
    );
    assert_eq!(pool.releasing_bytes(), 0);
    live.push(grown);
    finish(&sim, pool, live);
}
