//! Unit tests of the private pools (`pools`) on the simulated device.

use super::*;
use cudalloc_core::Config;
use cudalloc_sys::{SimConfig, SimDevice};

const GRAPH: PoolId = (0, 1);
const S: StreamId = StreamId(7);

fn open() -> Result<CachingAllocator<SimDevice>, String> {
    let cfg = Config::parse("policy:default").unwrap().for_graph_pool();
    assert_eq!(cfg.policy(), cudalloc_core::Policy::TorchExpandable);
    Ok(CachingAllocator::new(
        SimDevice::new(SimConfig::default()),
        cfg,
    ))
}

fn reserved(pools: &Pools<SimDevice>) -> i64 {
    let mut values = vec![0i64; TORCH_VALUES];
    pools.add_torch_values(&mut values);
    values[5 * 12] // reserved_bytes.all.current
}

#[test]
fn a_pool_keeps_its_memory_until_released_and_freed() {
    let pools = Pools::<SimDevice>::default();
    assert!(pools.allocate(GRAPH, 1 << 20, S).is_err(), "not in use yet");
    pools.acquire(GRAPH, open).unwrap();
    pools.acquire(GRAPH, || panic!("made twice")).unwrap();
    assert_eq!(pools.use_count(GRAPH), 2);
    let a = pools.allocate(GRAPH, 3 << 20, S).unwrap();
    let b = pools.allocate(GRAPH, 1000, S).unwrap();
    assert_eq!(pools.live_allocations(GRAPH).unwrap().len(), 2);
    pools.with_owner(b.ptr(), |p| p.free_ptr(b.ptr())).unwrap();
    assert_eq!(pools.live_allocations(GRAPH).unwrap(), vec![a.ptr()]);
    assert!(matches!(
        pools.with_owner(0xdead, |p| p.free_ptr(0xdead)),
        Err(AllocError::NotAllocated(0xdead))
    ));
    let held = reserved(&pools);
    assert!(!pools.empty_retired(None).unwrap(), "nothing retired");
    assert_eq!(
        reserved(&pools),
        held,
        "a pool in use keeps its freed memory"
    );
    pools.release(GRAPH).unwrap();
    pools.release(GRAPH).unwrap();
    assert_eq!(
        pools.counts(),
        (0, 1),
        "retired, never dropped inside release"
    );
    assert!(
        pools.allocate(GRAPH, 64, S).is_err(),
        "a retired pool serves nothing"
    );
    let mut values = vec![0i64; TORCH_VALUES];
    pools.add_torch_values(&mut values);
    assert_eq!(
        values[0], 1,
        "allocation.all.current counts the retired pool's"
    );
    assert!(
        pools.empty_retired(Some((9, 0))).is_ok_and(|any| !any),
        "another id"
    );
    assert!(pools.empty_retired(None).unwrap());
    assert_eq!(pools.counts(), (0, 1), "kept while live");
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    assert!(pools.empty_retired(Some(GRAPH)).unwrap());
    assert_eq!(pools.counts(), (0, 0), "dropped once nothing is live");
    let mut after = vec![0i64; TORCH_VALUES];
    pools.add_torch_values(&mut after);
    assert_eq!(after[0], 0);
    assert_eq!(after[1], 2, "the dropped pool's peak is kept");
    assert_eq!(after[2], 2, "and its cumulative count");
    pools.reset_peak_stats();
    let mut reset = vec![0i64; TORCH_VALUES];
    pools.add_torch_values(&mut reset);
    assert_eq!(reset[1], 0, "peaks reset to the current values");
    assert!(pools.release(GRAPH).is_err(), "not in use");
}

#[test]
fn the_driver_calls_of_every_pool_are_counted_dropped_ones_included() {
    let pools = Pools::<SimDevice>::default();
    assert_eq!(pools.figures(), PoolFigures::default());
    pools.acquire(GRAPH, open).unwrap();
    let a = pools.allocate(GRAPH, 3 << 20, S).unwrap();
    let in_use = pools.figures();
    assert_eq!((in_use.active, in_use.retired), (1, 0));
    assert!(
        in_use.driver_calls >= 1,
        "the pool mapped pages: {in_use:?}"
    );
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    pools.release(GRAPH).unwrap();
    assert!(pools.empty_retired(None).unwrap());
    assert_eq!(pools.counts(), (0, 0), "dropped");
    let dropped = pools.figures();
    assert!(
        dropped.driver_calls > in_use.driver_calls,
        "its calls kept, the unmaps of its memory going back added: {dropped:?}"
    );
}

/// Every pool hears of a capture, one made during it included: none gives memory back
/// until the capture ends (an empty_cache would wait for the device).
#[test]
fn pools_made_during_a_capture_hear_of_it_too() {
    let pools = Pools::<SimDevice>::default();
    let device = open().unwrap();
    pools.acquire((0, 1), open).unwrap();
    pools.begin_capture(&device);
    pools.acquire((0, 2), open).unwrap();
    for id in [(0, 1), (0, 2)] {
        let a = pools.allocate(id, 1 << 20, S).unwrap();
        pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
        pools.release(id).unwrap();
    }
    let held = reserved(&pools);
    assert!(held > 0);
    for id in [(0, 1), (0, 2)] {
        assert!(
            matches!(
                pools.empty_retired(Some(id)),
                Err(AllocError::DuringCapture {
                    what: "empty_cache",
                    ..
                })
            ),
            "pool {id:?}"
        );
    }
    assert_eq!(reserved(&pools), held, "memory given back during a capture");
    pools.end_capture(&device).unwrap();
    assert!(matches!(
        pools.end_capture(&device),
        Err(AllocError::DuringCapture {
            what: "end_capture",
            ..
        })
    ));
    assert!(pools.empty_retired(None).unwrap());
    assert_eq!(reserved(&pools), 0);
}

/// An end whose deferred events cannot be recorded still ends the capture everywhere: the
/// pool then gives its memory back once retired (nothing is stranded in capture mode).
#[test]
fn a_failed_end_capture_strands_no_pool() {
    let sim = Arc::new(SimDevice::new(SimConfig::default()));
    let cfg = Config::parse("policy:default").unwrap().for_graph_pool();
    let open = || Ok(CachingAllocator::new(sim.clone(), cfg.clone()));
    let pools = Pools::<Arc<SimDevice>>::default();
    let device = open().unwrap();
    pools.acquire(GRAPH, open).unwrap();
    pools.begin_capture(&device);
    let a = pools.allocate(GRAPH, 1 << 20, S).unwrap();
    let ptr = a.ptr();
    pools
        .with_owner(ptr, |p| p.record_stream(ptr, StreamId(9)))
        .unwrap();
    pools.with_owner(ptr, |p| p.free_ptr(ptr)).unwrap();
    // The end asks stream 9's capture status, then makes the event: that fails.
    sim.fail_call(2);
    assert!(pools.end_capture(&device).is_err(), "the injected fault");
    assert!(pools.end_capture(&device).is_err(), "ended already");
    pools.release(GRAPH).unwrap();
    assert!(pools.empty_retired(Some(GRAPH)).unwrap());
    assert_eq!(pools.counts(), (0, 0), "dropped: not stuck in a capture");
    assert_eq!(
        sim.outstanding_bytes(),
        0,
        "the deferred block's memory went back"
    );
}

#[test]
fn a_released_id_comes_back_with_its_pool() {
    let pools = Pools::<SimDevice>::default();
    pools.acquire(GRAPH, open).unwrap();
    let a = pools.allocate(GRAPH, 1 << 20, S).unwrap();
    pools.release(GRAPH).unwrap();
    pools
        .acquire(GRAPH, || panic!("the retired pool comes back"))
        .unwrap();
    assert_eq!(pools.counts(), (1, 0));
    assert_eq!(pools.live_allocations(GRAPH).unwrap(), vec![a.ptr()]);
}

#[test]
fn two_pools_never_share_addresses() {
    let pools = Pools::<SimDevice>::default();
    pools.acquire((0, 1), open).unwrap();
    pools.acquire((0, 2), open).unwrap();
    let a = pools.allocate((0, 1), 1 << 20, S).unwrap();
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    let b = pools.allocate((0, 2), 1 << 20, S).unwrap();
    assert!(pools.live_allocations((0, 1)).unwrap().is_empty());
    assert_eq!(pools.live_allocations((0, 2)).unwrap(), vec![b.ptr()]);
    let c = pools.allocate((0, 1), 1 << 20, S).unwrap();
    assert_eq!(c.ptr(), a.ptr(), "a pool reuses its own freed memory");
}

#[test]
fn snapshots_name_their_pools_retired_ones_included() {
    let pools = Pools::<SimDevice>::default();
    pools.acquire((0, 1), open).unwrap();
    pools.acquire((0, 2), open).unwrap();
    let a = pools.allocate((0, 1), 1 << 20, S).unwrap();
    pools.release((0, 1)).unwrap();
    let ids = |only| {
        let mut ids: Vec<PoolId> = pools.snapshots(only).iter().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(ids(None), [(0, 1), (0, 2)]);
    assert_eq!(ids(Some((0, 2))), [(0, 2)]);
    assert!(ids(Some((9, 9))).is_empty());
    let snaps = pools.snapshots(Some((0, 1)));
    let blocks = snaps[0].1.segments.iter().flat_map(|s| &s.blocks);
    assert!(blocks
        .into_iter()
        .any(|b| b.addr == a.ptr() && b.state == BlockState::Allocated));
}

#[test]
fn the_configs_of_the_other_policies_are_kept() {
    for p in [
        "policy:torch",
        "policy:torch-expandable,max_split_size_mb:64",
    ] {
        let device = Config::parse(p).unwrap();
        let want = Config::parse_onto(device.clone(), "thread_cache:False").unwrap();
        assert_eq!(device.for_graph_pool(), want);
    }
}
