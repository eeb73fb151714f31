//! Asynchronous release (`pool::releasing`): the `default` policy's budget gives pages back
//! without waiting for the device. Run with `SimDevice::set_auto_complete(false)`, so that a
//! stream's work completes only when the test says, and with `keep_while_behind` off (the
//! release goes on while the device runs behind).

use crate::common::pool;

use cudalloc::config::PolicyConfig;
use cudalloc::snapshot::BlockState;
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::StreamId;
use cudalloc_sys::{Call, SimDevice};
use pool::{alloc, check, free, past_loading, pool_with, Sim, GIB, MIB, S0, S1};

/// `default` with `extra` keys and without `keep_while_behind` and `move_pages`: these tests
/// are about the release itself, which those rules take back or move while the device runs
/// behind, as it does here (`keep_while_behind.rs` and `move_pages.rs` have the rules' tests).
fn default_with(extra: &str) -> (Sim, Pool<Sim>) {
    let cfg = Config::parse(&format!("policy:default,layout_plans:false{extra}")).unwrap();
    let PolicyConfig::Default(mut d) = cfg.policy_config().clone() else {
        unreachable!("a default config");
    };
    d.rules.keep_while_behind = false;
    d.rules.move_pages = false;
    let cfg = cfg
        .with_policy(PolicyConfig::Default(d))
        .expect("a valid config");
    pool_with(cfg, 4 * GIB)
}

/// Device waits of any kind the device has seen.
fn waits(sim: &SimDevice) -> u64 {
    sim.calls(Call::SynchronizeDevice) + sim.calls(Call::SynchronizeEvent)
}

/// The blocks of the pool in state `state`, as (address, size).
fn in_state(pool: &Pool<Sim>, state: BlockState) -> Vec<(u64, u64)> {
    let snap = pool.snapshot();
    let blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
    blocks
        .filter(|b| b.state == state)
        .map(|b| (b.addr, b.size))
        .collect()
}

/// A 30 MiB and a 6 MiB free block, each before a live 2 MiB block, on stream 0; a 34 MiB
/// growth then passes the budget by 4 MiB, so the 6 MiB block's pages go back
/// (`budget_rules.rs` has the same layout with work completing at once). Returns the addresses
/// of the two free blocks and the live ones.
fn layout_with_excess(pool: &mut Pool<Sim>) -> (u64, u64, Vec<Allocation>) {
    let large = alloc(pool, 30 * MIB, S0);
    let k1 = alloc(pool, 2 * MIB, S0);
    let small = alloc(pool, 6 * MIB, S0);
    let k2 = alloc(pool, 2 * MIB, S0);
    let (large_ptr, small_ptr) = (large.ptr(), small.ptr());
    free(pool, large);
    free(pool, small);
    (large_ptr, small_ptr, vec![k1, k2])
}

#[test]
fn the_budget_gives_pages_back_once_their_stream_is_done_and_never_waits() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let (_large, small, _keep) = layout_with_excess(&mut pool);
    let (unmaps, device_waits, counted) = (
        sim.calls(Call::Unmap),
        waits(&sim),
        pool.stats().device_waits,
    );
    let grown = alloc(&mut pool, 34 * MIB, S0);
    check(&sim, &pool);
    // Stream 0's work before the free has not completed: the 6 MiB are on their way back,
    // out of every free list, still mapped and reserved.
    assert_eq!(
        sim.calls(Call::Unmap),
        unmaps,
        "unmapped before its stream was done"
    );
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    assert_eq!(
        in_state(&pool, BlockState::Releasing),
        vec![(small, 6 * MIB)]
    );
    assert_eq!(sim.mapped_bytes(), 74 * MIB);
    // A request its size on the same stream gets other memory.
    let other = alloc(&mut pool, 6 * MIB, S0);
    assert!(other.ptr() >= small + 6 * MIB || other.ptr() + 6 * MIB <= small);
    check(&sim, &pool);
    sim.complete_stream(S0);
    // The next allocation polls the event and unmaps the pages.
    let tiny = alloc(&mut pool, 512, S1);
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 3);
    assert!(in_state(&pool, BlockState::Releasing).is_empty());
    assert_eq!(
        waits(&sim),
        device_waits,
        "an allocation waited for the device"
    );
    assert_eq!(pool.stats().device_waits, counted);
    for a in [grown, other, tiny] {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// A pool whose budget gave back 6 MiB for a growth on a device that has not run the work
/// queued before them (those pages on their way back), with the live allocations.
fn pages_on_their_way_back() -> (Sim, Pool<Sim>, Vec<Allocation>) {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let (_large, _small, mut live) = layout_with_excess(&mut pool);
    live.push(alloc(&mut pool, 34 * MIB, S0));
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    (sim, pool, live)
}

#[test]
fn empty_cache_waits_for_pages_on_their_way_back_and_counts_it() {
    let (sim, mut pool, live) = pages_on_their_way_back();
    let counted = pool.stats().device_waits;
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    // One wait for the releasing block's event, one for the device before the free 30 MiB
    // block's pages go.
    assert_eq!(pool.stats().device_waits, counted + 2);
    assert_eq!(sim.mapped_bytes(), 38 * MIB, "the live blocks' pages only");
    for a in live {
        free(&mut pool, a);
    }
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
}

#[test]
fn a_pool_dropped_with_pages_on_their_way_back_leaves_the_device_empty() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let (_large, _small, _keep) = layout_with_excess(&mut pool);
    let _grown = alloc(&mut pool, 34 * MIB, S0);
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    drop(pool);
    crate::common::assert_device_empty(&sim, "after drop");
}

/// Under a cap the pages on their way back still count: a growth that needs them climbs the
/// out-of-memory ladder, which waits for them, and succeeds.
#[test]
fn under_a_cap_a_growth_that_needs_releasing_pages_waits_at_the_last_rung() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 40 * MIB, S0);
    free(&mut pool, a);
    pool.set_limit(Some(48 * MIB));
    // Another stream cannot use stream 0's free block: its pages must go first.
    let b = alloc(&mut pool, 40 * MIB, S1);
    check(&sim, &pool);
    assert!(pool.reserved() <= 48 * MIB);
    assert_eq!(pool.releasing_bytes(), 0);
    assert!(pool.stats().device_waits > 0, "the last rung waited");
    free(&mut pool, b);
    check(&sim, &pool);
}

/// A failed unmap of a releasing block leaves it free and mapped (nothing lost, invariants
/// whole), and fails no allocation: the one that polled it is served.
#[test]
fn a_failed_unmap_of_a_releasing_block_leaves_it_free() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let (_large, small, keep) = layout_with_excess(&mut pool);
    let grown = alloc(&mut pool, 34 * MIB, S0);
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    sim.complete_stream(S0);
    sim.fail_release(1);
    let polled = pool.allocate(512, S1);
    check(&sim, &pool);
    sim.clear_faults();
    let polled = polled.expect("a failed release fails no allocation");
    // The pages are free again, or (the budget still passed) on their way back once more.
    let covers = |v: Vec<(u64, u64)>| {
        v.iter()
            .any(|&(p, n)| p <= small && small + 6 * MIB <= p + n)
    };
    assert!(
        covers(in_state(&pool, BlockState::Free)) || covers(in_state(&pool, BlockState::Releasing)),
        "the pages are lost: {:?}",
        pool.snapshot().segments
    );
    // Once the streams are done, the next allocation gives them back.
    sim.complete_all();
    let t = alloc(&mut pool, 512, S1);
    assert_eq!(pool.releasing_bytes(), 0);
    check(&sim, &pool);
    for a in [polled, t] {
        free(&mut pool, a);
    }
    for a in keep.into_iter().chain([grown]) {
        free(&mut pool, a);
    }
    pool.empty_cache().unwrap();
    check(&sim, &pool);
}

/// Under a cap, a growth that needs the pages it just sent back waits for those pages only:
/// the other cached blocks stay (the ladder's last rung, which gives back every cached block,
/// is not reached).
#[test]
fn under_a_cap_the_ladder_waits_for_releasing_pages_before_emptying_the_cache() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:1.0");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 20 * MIB, S0);
    let k1 = alloc(&mut pool, 2 * MIB, S0);
    let b = alloc(&mut pool, 10 * MIB, S0);
    let k2 = alloc(&mut pool, 2 * MIB, S0);
    let c = alloc(&mut pool, 30 * MIB, S1);
    let c_ptr = c.ptr();
    for x in [a, b, c] {
        free(&mut pool, x);
    }
    assert_eq!(pool.reserved(), 64 * MIB);
    pool.set_limit(Some(100 * MIB));
    let (retries, waits) = (pool.stats().num_alloc_retries, pool.stats().device_waits);
    let grown = alloc(&mut pool, 40 * MIB, S0);
    check(&sim, &pool);
    assert!(pool.reserved() <= 100 * MIB);
    assert_eq!(pool.stats().num_alloc_retries, retries, "the last rung ran");
    assert_eq!(
        pool.stats().device_waits,
        waits + 1,
        "one wait, for the releasing pages"
    );
    // Stream 1's block is still cached.
    let again = alloc(&mut pool, 30 * MIB, S1);
    assert_eq!(again.ptr(), c_ptr);
    for x in [grown, again, k1, k2] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
}

/// While the device never catches up, no allocation waits for it, and reserved bytes stay
/// within the streams' working sets together: each stream takes back its own pages on their way
/// back, or finds them cached (the next test checks the rule that keeps them cached). Once the
/// device catches up, the next growth gives the excess back. With work completing at once, the
/// same job stays near twice the budget.
#[test]
fn while_the_device_runs_behind_nothing_waits_and_the_pages_on_their_way_back_stay_bounded() {
    for behind in [true, false] {
        let (sim, mut pool) = default_with(",fragmentation_budget:0.25");
        past_loading(&mut pool);
        sim.set_auto_complete(!behind);
        let (waits_before, mut most, mut maps) = (pool.stats().device_waits, 0, 0);
        // Each round frees a working set on one stream and builds a larger one on another, so
        // that the budget gives back the first one's pages.
        for round in 0..24u64 {
            let s = StreamId(2 + round % 3);
            let set: Vec<Allocation> = (0..4)
                .map(|i| alloc(&mut pool, (16 + 4 * ((round + i) % 5)) * MIB, s))
                .collect();
            most = most.max(pool.reserved());
            if round == 15 {
                maps = sim.calls(Call::Map);
            }
            for a in set {
                free(&mut pool, a);
            }
            check(&sim, &pool);
        }
        assert_eq!(pool.stats().device_waits, waits_before, "behind {behind}");
        assert_eq!(sim.calls(Call::SynchronizeEvent), 0, "behind {behind}");
        // The largest working set is under 4 x 32 MiB; three streams keep one each, and while
        // behind, after a few rounds every stream's set fits in what it holds (nothing more is
        // mapped; with work completing at once, the budget gives pages back and maps again).
        if behind {
            assert_eq!(sim.calls(Call::Map), maps, "still mapping");
        }
        let bound = if behind {
            3 * 128 * MIB
        } else {
            128 * MIB * 3 / 2 + 32 * MIB
        };
        assert!(most <= bound, "behind {behind}: {most} reserved");
        if behind {
            // Caught up: the pages go back, and a growth gives the cached excess back too.
            sim.set_auto_complete(true);
            sim.complete_all();
            let a = alloc(&mut pool, 100 * MIB, StreamId(9));
            assert!(
                pool.reserved() <= 128 * MIB * 3 / 2 + 100 * MIB,
                "{} reserved",
                pool.reserved()
            );
            free(&mut pool, a);
            check(&sim, &pool);
        }
    }
}

/// The rule itself, where no stream can take its own pages back: once more than the budget's
/// slack is on its way back, a growth past the budget gives nothing more back (the pool passes
/// its budget instead of waiting); once the device has caught up, the next growth does.
#[test]
fn past_the_slack_nothing_more_is_given_back_until_the_device_catches_up() {
    // A 10% budget over 136 MiB live: a slack of 13.6 MiB.
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.1");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    // Four free 32 MiB blocks on stream 0, kept apart by live 2 MiB blocks.
    let mut live = Vec::new();
    let mut cached = Vec::new();
    for _ in 0..4 {
        cached.push(alloc(&mut pool, 32 * MIB, S0));
        live.push(alloc(&mut pool, 2 * MIB, S0));
    }
    for a in cached {
        free(&mut pool, a);
    }
    // Past the budget by about 50 MiB: two of them start going back.
    live.push(alloc(&mut pool, 64 * MIB, S1));
    let going = pool.releasing_bytes();
    assert_eq!(going, 64 * MIB);
    let events = sim.calls(Call::RecordEvent);
    // Past it again, on a third stream, while more than the slack is on its way back.
    live.push(alloc(&mut pool, 64 * MIB, StreamId(7)));
    check(&sim, &pool);
    assert_eq!(
        pool.releasing_bytes(),
        going,
        "gave more back while piled up"
    );
    assert_eq!(sim.calls(Call::RecordEvent), events);
    assert_eq!(
        pool.stats().device_waits,
        1,
        "only past_loading's empty_cache waited"
    );
    let passed = pool.reserved();
    assert!(passed > 136 * MIB * 11 / 10 + 64 * MIB, "{passed}");
    // Caught up: the next growth unmaps what went back and gives the rest of the excess back.
    sim.set_auto_complete(true);
    sim.complete_all();
    live.push(alloc(&mut pool, 2 * MIB, StreamId(8)));
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    assert!(
        pool.reserved() < passed - 64 * MIB,
        "{} reserved",
        pool.reserved()
    );
    for a in live {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// Pages on their way back serve a later request of their own stream before anything is mapped
/// or waited for: the work queued before their release precedes the new use in stream order.
/// Another stream's request never takes them.
#[test]
fn a_request_takes_back_its_own_streams_pages_on_their_way_back() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let (_large, small, mut live) = layout_with_excess(&mut pool);
    live.push(alloc(&mut pool, 34 * MIB, S0));
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    let theirs = alloc(&mut pool, 6 * MIB, S1);
    assert_ne!(theirs.ptr(), small);
    assert_eq!(pool.releasing_bytes(), 6 * MIB);
    live.push(theirs);
    // Requests of stream 0 use its cached blocks, then the pages on their way back.
    let taken = (0..8).find_map(|_| {
        let (maps, device_waits) = (sim.calls(Call::Map), waits(&sim));
        let a = alloc(&mut pool, 6 * MIB, S0);
        let grew = sim.calls(Call::Map) > maps || waits(&sim) > device_waits;
        let found = (a.ptr() == small || grew).then_some((a.ptr(), grew));
        live.push(a);
        found
    });
    check(&sim, &pool);
    assert_eq!(taken, Some((small, false)), "mapped or waited instead");
    assert_eq!(pool.releasing_bytes(), 0);
    sim.complete_all();
    for a in live {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// `empty_cache` waits for the device only when it has a whole chunk to unmap: a free block
/// inside a chunk a live block also uses gives nothing back, and no wait is made for it (work
/// queued on the device stays pending); once a whole chunk is free, the device is waited for
/// before it goes.
#[test]
fn empty_cache_waits_only_when_a_whole_chunk_can_go() {
    use cudalloc_sys::Device;
    let (sim, mut pool) = default_with(",max_chunk_mb:8");
    past_loading(&mut pool);
    let maps = sim.calls(Call::Map);
    let whole = alloc(&mut pool, 6 * MIB, S0);
    assert_eq!(sim.calls(Call::Map) - maps, 1, "one chunk");
    let mapped = sim.mapped_bytes();
    free(&mut pool, whole);
    // Half of the chunk's free block is handed out again; the other half stays free in it.
    let a = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(sim.calls(Call::Map) - maps, 1, "no growth");
    // Work queued on the block's stream, still running.
    sim.set_auto_complete(false);
    let work = sim.create_event().unwrap();
    sim.record_event(work, S0).unwrap();
    let (syncs, counted) = (
        sim.calls(Call::SynchronizeDevice),
        pool.stats().device_waits,
    );
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(
        sim.mapped_bytes(),
        mapped,
        "the chunk stays: a live block uses it"
    );
    assert_eq!(
        sim.calls(Call::SynchronizeDevice),
        syncs,
        "a wait with nothing to give back"
    );
    assert_eq!(pool.stats().device_waits, counted);
    assert!(
        !sim.query_event(work).unwrap(),
        "the queued work was waited for"
    );
    free(&mut pool, a);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(
        sim.calls(Call::SynchronizeDevice),
        syncs + 1,
        "one wait before the chunk goes"
    );
    assert_eq!(pool.stats().device_waits, counted + 1);
    assert!(
        sim.query_event(work).unwrap(),
        "the chunk went before the work completed"
    );
    sim.destroy_event(work).unwrap();
}

/// `empty_cache` waits only for the events of blocks used on other streams whose work has not
/// completed: one the device reports done is not waited for, nor counted in `device_waits`.
#[test]
fn empty_cache_waits_only_for_events_not_yet_completed() {
    let (sim, mut pool) = default_with("");
    past_loading(&mut pool);
    let keep = alloc(&mut pool, 4 * MIB, S0);
    sim.set_auto_complete(false);
    let [done, running] = [0, 1].map(|_| {
        let a = alloc(&mut pool, 4 * MIB, S0);
        pool.record_stream(&a, S1).unwrap();
        a
    });
    free(&mut pool, done);
    sim.complete_all(); // the first block's event completes
    free(&mut pool, running);
    assert_eq!(pool.pending_events(), 2);
    let (before, counted) = (sim.calls(Call::SynchronizeEvent), pool.stats().device_waits);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(pool.pending_events(), 0);
    assert_eq!(
        sim.calls(Call::SynchronizeEvent) - before,
        1,
        "a wait for an event already completed"
    );
    // The running block's event, and the device before the free chunk's pages go.
    assert_eq!(pool.stats().device_waits - counted, 2);
    free(&mut pool, keep);
    check(&sim, &pool);
}

/// Pages on their way back whose stream's work has completed are unmapped without a wait:
/// `empty_cache` waits only for the device before the free block's pages go.
#[test]
fn empty_cache_does_not_wait_for_pages_whose_work_completed() {
    let (sim, mut pool, live) = pages_on_their_way_back();
    sim.complete_all();
    let (events, counted) = (sim.calls(Call::SynchronizeEvent), pool.stats().device_waits);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(pool.releasing_bytes(), 0);
    assert_eq!(
        sim.calls(Call::SynchronizeEvent),
        events,
        "a wait for pages whose work had completed"
    );
    assert_eq!(pool.stats().device_waits, counted + 1, "the device, once");
    assert_eq!(sim.mapped_bytes(), 38 * MIB, "the live blocks' pages only");
    for a in live {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// A query the device fails leads to the wait: the event of a block used on another stream is
/// waited for even when its work has completed.
#[test]
fn a_failed_query_still_leads_to_the_wait() {
    let (sim, mut pool) = default_with("");
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 4 * MIB, S0);
    pool.record_stream(&a, S1).unwrap();
    free(&mut pool, a);
    sim.complete_all();
    sim.fail_always(Call::QueryEvent);
    let (before, counted) = (sim.calls(Call::SynchronizeEvent), pool.stats().device_waits);
    pool.empty_cache().unwrap();
    sim.clear_faults();
    check(&sim, &pool);
    assert_eq!(pool.pending_events(), 0);
    assert_eq!(sim.calls(Call::SynchronizeEvent) - before, 1, "no wait");
    // The event, and the device before the free chunk's pages go.
    assert_eq!(pool.stats().device_waits - counted, 2);
    assert_eq!(sim.mapped_bytes(), 0);
}
