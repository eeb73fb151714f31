//! Graph pools (`CachingAllocator::graph_pool`): a graph's memory is never handed to eager
//! work, several graphs share one pool, and dropping it gives the memory back.

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// A stream the simulated device can capture.
const CAP: StreamId = StreamId(5);

fn allocator(cfg: &str) -> (Arc<SimDevice>, CachingAllocator<Arc<SimDevice>>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    (
        sim.clone(),
        CachingAllocator::new(sim, Config::parse(cfg).unwrap()),
    )
}

/// A decode step of batch `b` as a graph captures it: per layer, an activation and an MLP
/// intermediate (freed within the step), the activation of the layer before freed; the step's
/// output is returned, live as long as the graph.
fn decode_step(pool: &CachingAllocator<Arc<SimDevice>>, b: u64) -> cudalloc::Allocation {
    let hidden = b * 2 * MIB;
    let mut x = pool.allocate(hidden, CAP).unwrap();
    for _ in 0..8 {
        let up = pool.allocate(4 * hidden, CAP).unwrap();
        let out = pool.allocate(hidden, CAP).unwrap();
        pool.free(up).unwrap();
        pool.free(x).unwrap();
        x = out;
    }
    x
}

/// Captures `decode_step` for each batch size in `order` into one pool (a capture on the
/// simulated device too, so any call a capture forbids fails the test); returns the pool's
/// peak reserved bytes.
fn capture_all(order: &[u64]) -> u64 {
    let (sim, eager) = allocator("policy:default");
    let pool = eager.graph_pool();
    let mut outputs = Vec::new();
    for &b in order {
        eager.begin_capture(CaptureMode::Global);
        pool.begin_capture(CaptureMode::Global);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        outputs.push(decode_step(&pool, b));
        sim.end_capture(CAP).unwrap();
        pool.end_capture(CaptureMode::Global).unwrap();
        eager.end_capture(CaptureMode::Global).unwrap();
    }
    pool.check_invariants().unwrap();
    let peak = pool.stats().reserved_bytes.0[0].peak as u64;
    for o in outputs {
        pool.free(o).unwrap();
    }
    peak
}

#[test]
fn a_graph_pools_memory_is_never_handed_to_eager_work() {
    let (sim, eager) = allocator("policy:default");
    let pool = eager.graph_pool();
    assert_eq!(pool.config().policy(), Policy::TorchExpandable);
    let out = decode_step(&pool, 4);
    let held = pool.reserved_bytes();
    assert!(held > 0);
    // Eager work on the same stream, between replays: none of it lands in the pool's memory.
    let eager_blocks: Vec<_> = (0..16)
        .map(|_| eager.allocate(8 * MIB, CAP).unwrap())
        .collect();
    let pool_ranges: Vec<(u64, u64)> = pool
        .snapshot()
        .segments
        .iter()
        .map(|s| (s.addr, s.addr + s.size))
        .collect();
    for a in &eager_blocks {
        assert!(
            pool_ranges
                .iter()
                .all(|&(lo, hi)| a.ptr() + a.size() <= lo || a.ptr() >= hi),
            "an eager block inside the graph pool's range"
        );
    }
    // Emptying the eager allocator's cache leaves the pool's memory mapped.
    for a in eager_blocks {
        eager.free(a).unwrap();
    }
    eager.empty_cache().unwrap();
    assert_eq!(pool.reserved_bytes(), held);
    pool.free(out).unwrap();
    drop(pool);
    eager.check_invariants().unwrap();
    assert_eq!(
        sim.outstanding_bytes(),
        0,
        "the dropped pool gave its memory back"
    );
}

/// Six graphs (batch sizes 1 to 32) share one pool, captured largest first and smallest first;
/// the pool's peak is compared with the largest single capture's. Largest first, the smaller
/// graphs fit in what the largest freed (1.000x when written); smallest first, the earlier
/// graphs' outputs sit between the pages a larger capture wants to grow into (1.200x when
/// written: issue 30's target of 1.05x is met only largest first).
#[test]
fn six_graphs_share_one_pool_in_either_order() {
    let sizes = [1, 2, 4, 8, 16, 32];
    let largest_alone = capture_all(&[32]);
    let largest_first = capture_all(&[32, 16, 8, 4, 2, 1]);
    let smallest_first = capture_all(&sizes);
    let (a, b) = (
        largest_first as f64 / largest_alone as f64,
        smallest_first as f64 / largest_alone as f64,
    );
    println!("largest alone {largest_alone}, largest first {a:.3}x, smallest first {b:.3}x");
    // The outputs of the other five graphs live on: 62 MiB beside the largest step's 400 MiB.
    assert!(
        a <= 1.05,
        "largest first: {a:.3}x the largest capture alone"
    );
    assert!(
        b <= 1.25,
        "smallest first: {b:.3}x the largest capture alone"
    );
}

/// An allocator's memory limit caps its graph pools too (PyTorch's memory fraction caps its
/// private pools): what a pool holds leaves that much less for eager work, and the other way
/// round; dropping the pool's memory gives the room back.
#[test]
fn the_memory_limit_caps_an_allocator_and_its_graph_pools_together() {
    for policy in ["policy:default", "policy:torch", "policy:torch-expandable"] {
        let (_sim, eager) = allocator(policy);
        eager.set_memory_limit(Some(GIB));
        let pool = eager.graph_pool();
        assert_eq!(
            pool.memory_limit(),
            Some(GIB),
            "{policy}: the pool starts capped"
        );
        let graph = pool.allocate(600 * MIB, CAP).unwrap();
        let e = eager.allocate(600 * MIB, StreamId(1)).unwrap_err();
        assert!(e.is_out_of_memory(), "{policy}: {e}");
        let small = eager.allocate(200 * MIB, StreamId(1)).unwrap();
        let e = pool.allocate(600 * MIB, CAP).unwrap_err();
        assert!(
            e.is_out_of_memory(),
            "{policy}: the pool is capped too: {e}"
        );
        pool.free(graph).unwrap();
        pool.empty_cache().unwrap();
        let big = eager.allocate(600 * MIB, StreamId(1)).unwrap();
        assert!(
            eager.reserved_bytes() + pool.reserved_bytes() <= GIB,
            "{policy}: within the limit together"
        );
        let peak = eager.group_reserved_peak();
        assert!(
            (800 * MIB..=GIB).contains(&peak),
            "{policy}: the group's peak {peak} is that of the sum, not the sum of the peaks"
        );
        assert_eq!(pool.group_reserved_peak(), peak, "{policy}: one group");
        eager.free(big).unwrap();
        eager.free(small).unwrap();
        eager.check_invariants().unwrap();
        pool.check_invariants().unwrap();
    }
}

/// Unmaps and segment frees the device has seen.
fn gives_back(sim: &SimDevice) -> u64 {
    sim.calls(cudalloc_sys::Call::Free) + sim.calls(cudalloc_sys::Call::Unmap)
}

/// Runs `oom` on a graph pool under a 1 GiB limit after two 300 MiB intermediates of a capture,
/// on two streams, the first freed within it (`setup` makes more first): `oom` must fail out of
/// memory and give nothing back. Then `after` runs on the pool with the first block's address.
fn out_of_memory_in_a_graph_pool(
    setup: impl Fn(&CachingAllocator<Arc<SimDevice>>),
    oom: impl Fn(
        &CachingAllocator<Arc<SimDevice>>,
    ) -> Result<cudalloc::Allocation, cudalloc::AllocError>,
    after: impl Fn(&CachingAllocator<Arc<SimDevice>>, u64, &str),
) {
    for policy in ["policy:default", "policy:torch", "policy:torch-expandable"] {
        let (sim, eager) = allocator(policy);
        eager.set_memory_limit(Some(GIB));
        let pool = eager.graph_pool();
        let first = pool.allocate(300 * MIB, CAP).unwrap();
        let kept = pool.allocate(300 * MIB, StreamId(6)).unwrap();
        setup(&pool);
        let at = first.ptr();
        pool.free(first).unwrap();
        let (held, calls) = (pool.reserved_bytes(), gives_back(&sim));
        let e = oom(&pool).unwrap_err();
        assert!(e.is_out_of_memory(), "{policy}: {e}");
        assert_eq!(pool.reserved_bytes(), held, "{policy}: nothing given back");
        assert_eq!(
            gives_back(&sim),
            calls,
            "{policy}: no unmap, no segment freed"
        );
        after(&pool, at, policy);
        pool.free(kept).unwrap();
        pool.check_invariants().unwrap();
    }
}

/// Out of memory, a graph pool gives nothing back: the blocks it holds free are a graph's
/// intermediates, which its replays write (PyTorch's allocator keeps a private pool in use
/// whole too). The allocation that does not fit fails; the free block keeps its pages, and
/// serves the pool again; once its graphs are gone, the pool's own `empty_cache` gives its
/// memory back.
#[test]
fn out_of_memory_a_graph_pool_keeps_the_blocks_it_holds_free() {
    out_of_memory_in_a_graph_pool(
        |_| {},
        |pool| pool.allocate(600 * MIB, CAP),
        |pool, at, policy| {
            let again = pool.allocate(300 * MIB, CAP).unwrap();
            assert_eq!(again.ptr(), at, "{policy}: the free block serves the pool");
            pool.free(again).unwrap();
        },
    );
    let (_sim, eager) = allocator("policy:torch-expandable");
    let pool = eager.graph_pool();
    let a = pool.allocate(300 * MIB, CAP).unwrap();
    pool.free(a).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved_bytes(), 0);
}

/// A graph pool's tagged allocation that runs out of memory gives nothing back either: not the
/// free blocks of the pool's shards, not those of its tags.
#[test]
fn a_graph_pools_tagged_allocation_out_of_memory_keeps_its_free_blocks() {
    out_of_memory_in_a_graph_pool(
        |pool| {
            let tagged = pool.allocate_tagged(100 * MIB, CAP, "t").unwrap();
            pool.free(tagged).unwrap();
        },
        |pool| pool.allocate_tagged(700 * MIB, CAP, "t"),
        |_, _, _| {},
    );
}

/// A graph pool made from a `default` allocator maps each growth in one chunk (it gives nothing
/// back while it lives, so pages mapped one call each would buy nothing); one made from a
/// `torch-expandable` allocator maps PyTorch's 20 MiB pages one call each. Both hold the same
/// bytes, and the pool's `empty_cache` gives them all back once its blocks are free.
#[test]
fn a_default_allocators_graph_pool_maps_each_growth_in_one_chunk() {
    for (policy, most_maps) in [("policy:default", 1), ("policy:torch-expandable", 39)] {
        let (sim, eager) = allocator(policy);
        let pool = eager.graph_pool();
        let before = sim.calls(cudalloc_sys::Call::Map);
        let a = pool.allocate(768 * MIB, CAP).unwrap();
        let maps = sim.calls(cudalloc_sys::Call::Map) - before;
        assert!(maps <= most_maps, "{policy}: {maps} maps for 768 MiB");
        assert_eq!(pool.reserved_bytes(), 780 * MIB, "{policy}: 20 MiB pages");
        let b = pool.allocate(100 * MIB, CAP).unwrap();
        pool.free(a).unwrap();
        pool.free(b).unwrap();
        pool.check_invariants().unwrap();
        pool.empty_cache().unwrap();
        assert_eq!(pool.reserved_bytes(), 0, "{policy}: all given back");
    }
}

/// The price of whole growths: a block that lives on keeps the whole growth it lies in mapped
/// through the pool's `empty_cache` (a live block of a PyTorch private pool keeps its whole
/// `cudaMalloc` segment the same way); with PyTorch's 20 MiB pages, only its own pages stay.
#[test]
fn a_live_block_keeps_its_whole_growth_mapped() {
    for (policy, kept) in [("policy:default", 780), ("policy:torch-expandable", 40)] {
        let (_sim, eager) = allocator(policy);
        let pool = eager.graph_pool();
        let a = pool.allocate(768 * MIB, CAP).unwrap();
        pool.free(a).unwrap();
        let output = pool.allocate(30 * MIB, CAP).unwrap();
        pool.empty_cache().unwrap();
        assert_eq!(pool.reserved_bytes(), kept * MIB, "{policy}");
        pool.free(output).unwrap();
        pool.empty_cache().unwrap();
        assert_eq!(
            pool.reserved_bytes(),
            0,
            "{policy}: all given back once free"
        );
    }
}

/// `whole_growths` is read by `torch-expandable`'s rules only: a configuration of another policy
/// refuses it, naming the field and the policy; a graph pool's configuration keeps it.
#[test]
fn whole_growths_is_refused_with_a_policy_that_would_ignore_it() {
    let graph = Config::parse("policy:default").unwrap().for_graph_pool();
    assert!(graph.pool().whole_growths);
    for policy in [Policy::Default, Policy::Torch] {
        let e = graph
            .clone()
            .with_policy(cudalloc::config::PolicyConfig::for_policy(policy))
            .unwrap_err();
        assert_eq!(e.key, "whole_growths", "{policy:?}");
        assert!(e.to_string().contains(policy.name()), "{e}");
    }
    let plain = Config::parse("policy:torch-expandable")
        .unwrap()
        .for_graph_pool();
    assert!(!plain.pool().whole_growths, "PyTorch's pages, as its own");
}
