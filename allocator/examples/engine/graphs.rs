//! `--graphs`: the batched decode step (`batch.rs`) captured into CUDA graphs, one per batch
//! size (1, 2, 4, 8, 16, 32), all six sharing one graph pool (`CachingAllocator::graph_pool`),
//! then replayed to decode and compared with the same step run eagerly.
//!
//! Each capture follows one protocol ([`capture_one`]):
//!
//! 1. Warm-up: the step runs eagerly with its buffers from the pool, until one run makes no
//!    driver call (the pool then holds all the memory the step needs; at most
//!    [`MAX_WARMUPS`] runs).
//! 2. Capture: the eager allocator and the pool are told (`begin_capture`) before
//!    `CudaStream::begin_capture` (global mode), the step runs again with its buffers from the
//!    pool, and both are told after `end_capture`. The allocators' driver calls (malloc, free,
//!    page maps and unmaps, waits) are counted across the capture: the target is 0.
//!
//! Nothing the pool hands out outlives a step (the step's inputs, outputs and cache are the
//! static `Slots`, from the eager allocator), so the six graphs' memory is one step's memory
//! reused: the pool should reserve what the largest capture needs alone, in either order.
//! [`capture_set`] captures the six into a fresh pool in one order; the report compares the
//! pool's reserved bytes with those of a pool that captured the largest batch alone.

use super::batch::{decode_step, decode_step_probed, Linear, Probe, Slots, BATCHES, SLOTS};
use super::mem::{Mem, PoolMem, Result};
use super::model::{Model, Weights};
use super::reference;
use cudalloc::stats::StatType;
use cudalloc::CachingAllocator;
use cudalloc_sys::buffer::cudarc::driver::sys::{
    CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudalloc_sys::buffer::cudarc::driver::CudaGraph;
use cudalloc_sys::{CaptureMode, CudaDevice};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most warm-up runs before a capture.
pub const MAX_WARMUPS: usize = 3;

/// The capture mode: the strictest (any thread's forbidden call breaks the capture).
const MODE: CaptureMode = CaptureMode::Global;

/// The order in which the six batch sizes are captured into their shared pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    LargestFirst,
    SmallestFirst,
}

impl Order {
    pub fn name(self) -> &'static str {
        match self {
            Order::LargestFirst => "largest-first",
            Order::SmallestFirst => "smallest-first",
        }
    }

    pub fn batches(self) -> Vec<usize> {
        let mut b = BATCHES.to_vec();
        if self == Order::LargestFirst {
            b.reverse();
        }
        b
    }
}

/// Driver calls an allocator has made (`Stats::calls`: mallocs, frees, page maps and unmaps)
/// and its device waits.
fn driver_calls(a: &CachingAllocator<CudaDevice>) -> u64 {
    let s = a.stats();
    s.calls.total() + s.device_waits
}

/// What one capture did.
pub struct Capture {
    pub batch: usize,
    /// Warm-up runs before it.
    pub warmups: usize,
    /// Driver calls of the eager allocator and the pool between `begin_capture` and
    /// `end_capture`.
    pub calls: u64,
    /// The pool's reserved bytes after it.
    pub reserved: u64,
    /// The most bytes the step held at once from the pool during the capture.
    pub step_peak: u64,
}

/// Six graphs in one pool.
pub struct GraphSet {
    // The graphs go first: they replay into the pool's memory.
    graphs: Vec<(usize, CudaGraph)>,
    pub captures: Vec<Capture>,
    pub pool: Arc<CachingAllocator<CudaDevice>>,
}

impl GraphSet {
    pub fn graph(&self, batch: usize) -> Result<&CudaGraph> {
        self.graphs
            .iter()
            .find(|(b, _)| *b == batch)
            .map(|(_, g)| g)
            .ok_or_else(|| format!("no graph for batch {batch}").into())
    }

    /// Allocator driver calls during all its captures.
    pub fn capture_calls(&self) -> u64 {
        self.captures.iter().map(|c| c.calls).sum()
    }
}

/// Warms the pool up for `batch`, then captures one decode step into a graph (module docs).
pub fn capture_one(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    batch: usize,
    pool: &Arc<CachingAllocator<CudaDevice>>,
) -> Result<(CudaGraph, Capture)> {
    let (eager, st) = (model.mem.allocator(), model.mem.stream());
    let calls = || driver_calls(pool) + driver_calls(eager);
    let mut warmups = 0;
    while warmups < MAX_WARMUPS {
        slots.reset(st)?;
        let before = calls();
        decode_step(model, slots, batch, pool)?;
        warmups += 1;
        if calls() == before {
            break;
        }
    }
    st.synchronize()?;
    pool.reset_peak_stats();
    let before = calls();
    eager.begin_capture(MODE);
    pool.begin_capture(MODE);
    let captured = (|| -> Result<Option<CudaGraph>> {
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
        let step = decode_step(model, slots, batch, pool);
        let end = st.end_capture(CUgraphInstantiate_flags(0));
        step?;
        Ok(end?)
    })();
    let ended = pool.end_capture(MODE).and(eager.end_capture(MODE));
    let during = calls() - before;
    let graph = captured?.ok_or("the capture recorded nothing")?;
    ended?;
    graph.upload()?;
    let capture = Capture {
        batch,
        warmups,
        calls: during,
        reserved: pool.reserved_bytes(),
        step_peak: pool.stats().allocated_bytes.get(StatType::All).peak as u64,
    };
    Ok((graph, capture))
}

/// Captures the step for `batches`, in that order, into one fresh graph pool.
pub fn capture_set(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    batches: &[usize],
) -> Result<GraphSet> {
    let pool = Arc::new(model.mem.allocator().graph_pool());
    let (mut graphs, mut captures) = (Vec::new(), Vec::new());
    for &b in batches {
        let (g, c) = capture_one(model, slots, b, &pool)?;
        graphs.push((b, g));
        captures.push(c);
    }
    Ok(GraphSet {
        graphs,
        captures,
        pool,
    })
}

/// How a decode run takes its steps.
#[derive(Clone, Copy)]
pub enum Stepper<'a> {
    /// `decode_step` launched by the host, buffers from the eager allocator.
    Eager,
    /// The captured graph of that batch size, replayed.
    Graph(&'a CudaGraph),
}

/// Greedy decoding of the first `batch` slots for `steps` steps from the ends of their prompts
/// (after one untimed step): each sequence's tokens (the prefill's choice first) and the
/// seconds the steps took, one copy of the chosen tokens to the host per step included.
pub fn decode(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    batch: usize,
    steps: usize,
    how: Stepper<'_>,
) -> Result<(Vec<Vec<u32>>, f64)> {
    let st = model.mem.stream().clone();
    let eager = model.mem.allocator().clone();
    let step = |slots: &mut Slots| -> Result<()> {
        match how {
            Stepper::Eager => decode_step(model, slots, batch, &eager),
            Stepper::Graph(g) => Ok(g.launch()?),
        }
    };
    slots.reset(&st)?;
    step(slots)?;
    slots.reset(&st)?;
    st.synchronize()?;
    let mut tokens: Vec<Vec<u32>> = slots.first[..batch].iter().map(|&t| vec![t]).collect();
    let t = Instant::now();
    for _ in 0..steps {
        step(slots)?;
        for (seq, id) in tokens.iter_mut().zip(slots.chosen(&st, batch)?) {
            seq.push(id);
        }
    }
    Ok((tokens, t.elapsed().as_secs_f64()))
}

/// The CPU reference's greedy continuation of `prompt`: `count` tokens.
fn reference_tokens(
    model: &Model<PoolMem>,
    host: &Weights<Vec<f32>>,
    prompt: &[u32],
    count: usize,
) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let next = reference::argmax(&reference::logits(&model.shape, host, &seq));
        out.push(next);
        seq.push(next);
    }
    out
}

/// The tiny model through the whole graph path: 32 prompts prefilled, six graphs captured
/// largest first into one pool, every batch size decoded eagerly and by replay; both must
/// give the CPU reference's greedy tokens. Prints one line; true if all agree.
pub fn check(
    model: &Model<PoolMem>,
    host: &Weights<Vec<f32>>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<bool> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut slots = Slots::new(model, longest + steps + 1)?;
    batch_prefill(model, &mut slots, prompts)?;
    let set = capture_set(model, &mut slots, &Order::LargestFirst.batches())?;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference_tokens(model, host, p, steps + 1))
        .collect();
    let (mut eager_ok, mut graph_ok, mut tokens) = (true, true, 0);
    for b in BATCHES {
        let (eager, _) = decode(model, &mut slots, b, steps, Stepper::Eager)?;
        let (graph, _) = decode(model, &mut slots, b, steps, Stepper::Graph(set.graph(b)?))?;
        for (r, ((e, g), w)) in eager.iter().zip(&graph).zip(&want).enumerate() {
            if e != w || g != w {
                println!("  batch {b}, sequence {r}: eager {e:?}, graphs {g:?}, CPU {w:?}");
            }
            eager_ok &= e == w;
            graph_ok &= g == w;
            tokens += g.len();
        }
    }
    let calls = set.capture_calls();
    let yes = |ok: bool| if ok { "yes" } else { "NO" };
    println!(
        "check graphs {:<35} 6 graphs in one pool; {tokens} tokens equal to the CPU reference's: eager {}, graphs {}; driver calls during captures {calls}: {}",
        model.mem.label(),
        yes(eager_ok),
        yes(graph_ok),
        if eager_ok && graph_ok && calls == 0 { "ok" } else { "FAILED" }
    );
    drop(set);
    Ok(eager_ok && graph_ok && calls == 0)
}

/// [`batch::prefill`](super::batch::prefill), then every slot back to the end of its prompt.
fn batch_prefill(model: &Model<PoolMem>, slots: &mut Slots, prompts: &[Vec<u32>]) -> Result<()> {
    super::batch::prefill(model, slots, prompts)?;
    slots.reset(model.mem.stream())
}

/// Per batch size: eager and replayed decoding, timed, with the tokens compared.
pub struct Row {
    pub batch: usize,
    pub tokens: usize,
    pub eager_s: f64,
    /// Seconds per graph set (one per order), in the order of the sets.
    pub graph_s: Vec<f64>,
    /// Replayed tokens equal to the eager ones, per set.
    pub same: Vec<bool>,
}

/// `--step-profile`: per batch size, the time between each kind of op of the eager step and
/// the op before it (events recorded between the ops of `steps` steps, after one untimed step;
/// the stream is waited for after each step, as the decode loop does), in microseconds per
/// step, twice: paced by the host (each op launched when the host gets to it: where the device
/// keeps up with the launches, an op's time is theirs, not its own work) and paced by the
/// device (each step queued behind a [`QUEUE_WAIT`] wait on the device, so that the host has
/// launched the whole step before the device starts it: each op's time on the device,
/// launch gaps included, as in a graph's replay).
fn profile(model: &Model<PoolMem>, slots: &mut Slots, steps: usize) -> Result<()> {
    let eager = model.mem.allocator().clone();
    let st = model.mem.stream();
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (from, to) = (
        st.context().new_event(timed)?,
        st.context().new_event(timed)?,
    );
    from.record(st)?;
    model.kernels().spin(st, QUEUE_WAIT)?;
    to.record(st)?;
    st.synchronize()?;
    println!(
        "\ngraphs: a {} ms wait on the device took {:.2} ms between events",
        QUEUE_WAIT.as_millis(),
        from.elapsed_ms(&to)?
    );
    for queued in [false, true] {
        let before = eager.stats();
        let cols = profile_pass(model, slots, steps, queued)?;
        let after = eager.stats();
        let how = if queued {
            format!(
                "paced by the device (each step queued behind a {} ms wait)",
                QUEUE_WAIT.as_millis()
            )
        } else {
            "paced by the host".to_string()
        };
        println!("\ngraphs: eager step profile {how}, microseconds per step between each op and the one before ({steps} steps each)");
        print_profile(&cols, steps);
        if queued {
            let mut cells = Vec::new();
            for b in BATCHES {
                cells.push(format!(
                    "{:.0}",
                    queued_step_ms(model, slots, b, steps)? * 1e3
                ));
            }
            println!(
                "| whole step, marks only at its ends | {} |",
                cells.join(" | ")
            );
        }
        println!(
            "graphs: the step's allocator during this profile: {} driver calls, {} device waits",
            after.calls.total() - before.calls.total(),
            after.device_waits - before.device_waits
        );
    }
    Ok(())
}

/// How long the device waits before each step of the device-paced profile: longer than the
/// host takes to launch a step.
const QUEUE_WAIT: Duration = Duration::from_millis(5);

/// Per batch size: the milliseconds of each op over `steps` steps.
type Profile = Vec<(usize, Vec<(&'static str, f64)>)>;

/// An error if the host took [`QUEUE_WAIT`] or longer to launch a step queued at `since`: the
/// device may then have started it before it was all queued, and the pass would not be paced
/// by the device.
fn check_queued(since: Instant) -> Result<()> {
    let took = since.elapsed();
    if took >= QUEUE_WAIT {
        return Err(format!(
            "the host took {took:?} to launch a step queued behind a {QUEUE_WAIT:?} wait: the profile would not be paced by the device"
        )
        .into());
    }
    Ok(())
}

/// Milliseconds per step of batch `b` on the device over `steps` steps (after one untimed
/// step), each queued behind a [`QUEUE_WAIT`] wait, timed by events at the step's two ends
/// only.
fn queued_step_ms(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    b: usize,
    steps: usize,
) -> Result<f64> {
    let (st, eager) = (model.mem.stream(), model.mem.allocator());
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (from, to) = (
        st.context().new_event(timed)?,
        st.context().new_event(timed)?,
    );
    slots.reset(st)?;
    decode_step(model, slots, b, eager)?;
    st.synchronize()?;
    let mut ms = 0.0;
    for _ in 0..steps {
        model.kernels().spin(st, QUEUE_WAIT)?;
        let queued = Instant::now();
        from.record(st)?;
        decode_step(model, slots, b, eager)?;
        to.record(st)?;
        check_queued(queued)?;
        st.synchronize()?;
        ms += from.elapsed_ms(&to)? as f64;
    }
    Ok(ms / steps as f64)
}

/// One pass of [`profile`] over every batch size.
fn profile_pass(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    steps: usize,
    queued: bool,
) -> Result<Profile> {
    let (st, eager) = (model.mem.stream().clone(), model.mem.allocator().clone());
    let mut cols = Profile::new();
    let mut probe = Probe::default();
    for b in BATCHES {
        slots.reset(&st)?;
        decode_step(model, slots, b, &eager)?;
        st.synchronize()?;
        let mut sums: Vec<(&'static str, f64)> = Vec::new();
        for _ in 0..steps {
            if queued {
                model.kernels().spin(&st, QUEUE_WAIT)?;
            }
            let launched = Instant::now();
            decode_step_probed(model, slots, b, &eager, Some(&mut probe))?;
            if queued {
                check_queued(launched)?;
            }
            st.synchronize()?;
            for (label, ms) in probe.take()? {
                match sums.iter_mut().find(|(l, _)| *l == label) {
                    Some((_, sum)) => *sum += ms,
                    None => sums.push((label, ms)),
                }
            }
        }
        cols.push((b, sums));
    }
    Ok(cols)
}

/// The table of one profile pass, microseconds per step.
fn print_profile(cols: &Profile, steps: usize) {
    let per_step = |ms: f64| format!("{:.0}", ms * 1e3 / steps as f64);
    let head: Vec<String> = cols.iter().map(|(b, _)| format!("batch {b}")).collect();
    println!("| op | {} |", head.join(" | "));
    println!("| --- |{}", " --- |".repeat(cols.len()));
    for (label, _) in &cols[0].1 {
        let cells: Vec<String> = cols
            .iter()
            .map(|(_, sums)| {
                let ms = sums.iter().find(|(l, _)| l == label).map_or(0.0, |s| s.1);
                per_step(ms)
            })
            .collect();
        println!("| {label} | {} |", cells.join(" | "));
    }
    let sum: Vec<String> = cols
        .iter()
        .map(|(_, s)| per_step(s.iter().map(|x| x.1).sum()))
        .collect();
    println!("| all ops | {} |", sum.join(" | "));
}

/// The `--graphs` benchmark: prefill [`SLOTS`] prompts, capture the graphs in each of
/// `orders` (and the largest batch alone in a pool of its own, for the reference peak),
/// decode every batch size `steps` steps eagerly and by each set's replay, and print the
/// report.
pub fn bench(
    model: &Model<PoolMem>,
    prompts: &[Vec<u32>],
    steps: usize,
    orders: &[Order],
    step_profile: bool,
    linear: Linear,
) -> Result<bool> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut slots = Slots::new(model, longest + steps + 1)?;
    slots.linear = linear;
    let t = Instant::now();
    batch_prefill(model, &mut slots, prompts)?;
    println!(
        "\ngraphs: {} prompts prefilled in {:.2} s; static KV cache {:.1} MiB ({SLOTS} slots x {} rows x {} layers)",
        prompts.len(),
        t.elapsed().as_secs_f64(),
        (slots.cache.len() * 2 * SLOTS * slots.max_len * model.shape.hidden * 4) as f64
            / (1u64 << 20) as f64,
        slots.max_len,
        model.shape.layers
    );
    if step_profile {
        profile(model, &mut slots, steps)?;
    }
    let alone = {
        let set = capture_set(model, &mut slots, &[SLOTS])?;
        set.captures[0].reserved
    };
    let sets = orders
        .iter()
        .map(|o| capture_set(model, &mut slots, &o.batches()))
        .collect::<Result<Vec<_>>>()?;
    let (mut rows, mut widest) = (Vec::new(), Vec::new());
    for b in BATCHES {
        let (eager, eager_s) = decode(model, &mut slots, b, steps, Stepper::Eager)?;
        let mut row = Row {
            batch: b,
            tokens: b * steps,
            eager_s,
            graph_s: Vec::new(),
            same: Vec::new(),
        };
        for set in &sets {
            let (got, s) = decode(model, &mut slots, b, steps, Stepper::Graph(set.graph(b)?))?;
            row.graph_s.push(s);
            row.same.push(got == eager);
        }
        rows.push(row);
        widest = eager;
    }
    let ok = report(orders, &sets, alone, &rows);
    drop(sets);
    // The same sequences on the per-sequence engine (informational: its attention sums in
    // another order, so a near tie may go the other way).
    let per_seq = per_seq_tokens(model, &prompts[..widest.len()], steps)?;
    let agree = widest.iter().zip(&per_seq).filter(|(a, b)| a == b).count();
    println!(
        "graphs: batch {}: {agree} of {} sequences decode the same tokens as the per-sequence engine (Model::forward)",
        widest.len(),
        widest.len()
    );
    Ok(ok)
}

/// Greedy decoding of each prompt alone with `Model::forward`: the prefill's token, then
/// `steps` more.
fn per_seq_tokens(
    model: &Model<PoolMem>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<Vec<Vec<u32>>> {
    prompts
        .iter()
        .map(|p| {
            let mut seq = model.new_seq();
            let logits = model.forward(&mut seq, p)?;
            let mut out = vec![model.argmax(&logits)?];
            for _ in 0..steps {
                let logits = model.forward(&mut seq, &out[out.len() - 1..])?;
                out.push(model.argmax(&logits)?);
            }
            Ok(out)
        })
        .collect()
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Tokens per second.
fn rate(tokens: usize, secs: f64) -> f64 {
    tokens as f64 / secs.max(1e-12)
}

/// Prints the captures, the decode table and the summary lines (`graphs summary:`, one per
/// target); true if every replay gave the eager tokens.
fn report(orders: &[Order], sets: &[GraphSet], alone: u64, rows: &[Row]) -> bool {
    println!(
        "
graphs: captures (global mode, each after warm-up runs of its batch in the pool)"
    );
    println!("| order | batch | warm-up runs | allocator driver calls during capture | pool reserved after | step peak in pool |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (o, set) in orders.iter().zip(sets) {
        for c in &set.captures {
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                o.name(),
                c.batch,
                c.warmups,
                c.calls,
                mib(c.reserved),
                mib(c.step_peak)
            );
        }
    }
    println!(
        "graphs: batch {SLOTS} captured alone into a pool of its own: {} reserved",
        mib(alone)
    );

    let mut head = "| batch | tokens | eager tok/s |".to_string();
    for o in orders {
        head += &format!(" graphs {} tok/s | speedup |", o.name());
    }
    println!(
        "
{head} replayed tokens identical to eager |"
    );
    println!("|{}", " --- |".repeat(3 + 2 * orders.len() + 1));
    let (mut tokens, mut eager_s, mut graph_s) = (0, 0.0, vec![0.0; orders.len()]);
    for r in rows {
        let mut line = format!(
            "| {} | {} | {:.0} |",
            r.batch,
            r.tokens,
            rate(r.tokens, r.eager_s)
        );
        for (i, s) in r.graph_s.iter().enumerate() {
            line += &format!(
                " {:.0} | {:.2}x |",
                rate(r.tokens, *s),
                r.eager_s / s.max(1e-12)
            );
            graph_s[i] += s;
        }
        let same = r.same.iter().all(|&x| x);
        println!("{line} {} |", if same { "yes" } else { "NO" });
        tokens += r.tokens;
        eager_s += r.eager_s;
    }
    let mut line = format!("| all | {tokens} | {:.0} |", rate(tokens, eager_s));
    for s in &graph_s {
        line += &format!(
            " {:.0} | {:.2}x |",
            rate(tokens, *s),
            eager_s / s.max(1e-12)
        );
    }
    println!("{line} |");

    println!();
    for (o, s) in orders.iter().zip(&graph_s) {
        println!(
            "graphs summary: decode tokens/s, all batch sizes: eager {:.0}, graphs {} {:.0}: {:.2}x (target >= 1.5x)",
            rate(tokens, eager_s),
            o.name(),
            rate(tokens, *s),
            eager_s / s.max(1e-12)
        );
    }
    let calls: u64 = sets.iter().map(GraphSet::capture_calls).sum();
    let captures: usize = sets.iter().map(|s| s.captures.len()).sum();
    println!(
        "graphs summary: allocator driver calls during the {captures} captures after warm-up: {calls} (target 0)"
    );
    for (o, set) in orders.iter().zip(sets) {
        let reserved = set.pool.reserved_bytes();
        println!(
            "graphs summary: pool reserved after six captures {}: {} / {} for batch {SLOTS} alone = {:.3}x (target <= 1.05x)",
            o.name(),
            mib(reserved),
            mib(alone),
            reserved as f64 / alone.max(1) as f64
        );
    }
    let same = rows.iter().all(|r| r.same.iter().all(|&x| x));
    println!(
        "graphs summary: replayed tokens identical to eager: {} ({} batch sizes x {} orders)",
        if same { "yes" } else { "NO" },
        rows.len(),
        orders.len()
    );
    same
}
