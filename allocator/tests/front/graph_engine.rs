//! The example engine's graph protocol (`examples/engine/graphs.rs`) on the simulated device
//! that captures: the batched decode step's buffers (`examples/engine/batch.rs`,
//! `decode_step`, for the benchmark model: hidden 1024, 16 heads, ffn 2816, vocab 32000, 8
//! layers, 576 cache rows) captured for batch 1 to 32 into one graph pool, each capture after
//! warm-up runs of its batch in the pool until one makes no device call. Checked: no device
//! call of any kind during any capture, and the pool's reserved bytes after the six within
//! 1.05x of the largest capture alone, captured largest first and smallest first.
//!
//! The step's inputs, outputs and cache are static buffers outside the pool, so nothing the
//! pool hands out outlives a step; that is what lets both orders share one step's memory
//! (compare `graph_pool.rs`, whose steps leave their outputs in the pool).

use cudalloc::{CachingAllocator, Config};
use cudalloc_sys::{CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const GIB: u64 = 1 << 30;
/// A stream the simulated device can capture.
const CAP: StreamId = StreamId(5);

/// The benchmark model's sizes (the engine's defaults) and cache rows (longest prompt 511
/// plus 64 tokens plus 1).
const HIDDEN: u64 = 1024;
const HEADS: u64 = 16;
const FFN: u64 = 2816;
const VOCAB: u64 = 32000;
const LAYERS: usize = 8;
const MAX_LEN: u64 = 576;

type Pool = CachingAllocator<Arc<SimDevice>>;

/// The allocations and frees of one `decode_step` of batch `n`, in its order (keep in step
/// with `examples/engine/batch.rs`): `f32` buffers, freed where the step drops them.
fn decode_step(pool: &Pool, n: u64) {
    let buf = |floats: u64| pool.allocate(4 * floats, CAP).unwrap();
    let free = |a| pool.free(a).unwrap();
    let (d, f) = (HIDDEN, FFN);
    let x = buf(n * d);
    for _ in 0..LAYERS {
        // attention
        let hn = buf(n * d);
        let (q, k, v) = (buf(n * d), buf(n * d), buf(n * d));
        free(hn);
        free(k);
        free(v);
        let scores = buf(n * HEADS * MAX_LEN);
        let att = buf(n * d);
        free(q);
        free(scores);
        free(att);
        // MLP
        let hn = buf(n * d);
        let (g, u) = (buf(n * f), buf(n * f));
        free(hn);
        let a = buf(n * f);
        free(g);
        free(u);
        free(a);
    }
    let normed = buf(n * d);
    free(x);
    let logits = buf(n * VOCAB);
    free(normed);
    free(logits);
}

/// Captures the step for each batch in `order` into one graph pool, with the engine's
/// warm-up; returns the pool's reserved bytes after all and the device calls made during the
/// captures.
fn capture(order: &[u64]) -> (u64, u64) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    let eager = CachingAllocator::new(sim.clone(), Config::parse("policy:default").unwrap());
    let pool = eager.graph_pool();
    let mut during = 0;
    for &b in order {
        for _ in 0..3 {
            let before = sim.total_calls();
            decode_step(&pool, b);
            if sim.total_calls() == before {
                break;
            }
        }
        let before = sim.total_calls();
        eager.begin_capture(CaptureMode::Global);
        pool.begin_capture(CaptureMode::Global);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        decode_step(&pool, b);
        sim.end_capture(CAP).unwrap();
        pool.end_capture(CaptureMode::Global).unwrap();
        eager.end_capture(CaptureMode::Global).unwrap();
        during += sim.total_calls() - before;
    }
    pool.check_invariants().unwrap();
    (pool.reserved_bytes(), during)
}

#[test]
fn the_engines_six_graphs_share_one_steps_memory_in_either_order() {
    let (alone, calls) = capture(&[32]);
    assert_eq!(calls, 0, "device calls while capturing batch 32 alone");
    for order in [[32, 16, 8, 4, 2, 1], [1, 2, 4, 8, 16, 32]] {
        let (reserved, calls) = capture(&order);
        let ratio = reserved as f64 / alone as f64;
        println!("{order:?}: {reserved} bytes reserved, {ratio:.3}x batch 32 alone ({alone}), {calls} calls during captures");
        assert_eq!(calls, 0, "{order:?}: device calls during the captures");
        assert!(
            ratio <= 1.05,
            "{order:?}: {ratio:.3}x the largest capture alone"
        );
    }
}
