//! An inference engine on cudalloc: a decoder-only transformer with random weights whose every
//! device buffer (weights, activations, the growing KV cache, the cuBLAS workspace) comes from a
//! `CachingAllocator<CudaDevice>`, next to the same engine on cudarc's own allocation
//! (`CudaStream::alloc_zeros`, i.e. `cuMemAllocAsync`).
//!
//! 1. Check: a tiny model's logits, after a prompt, a chunk of three tokens and three single
//!    tokens, against a CPU reference (largest difference over the largest reference logit,
//!    `max |got - want| / max |want|`, below 1e-3), on both backends.
//! 2. Benchmark (skipped with `--check`): a larger model (default 8 layers, hidden 1024, 16
//!    heads, vocab 32000) prefills several prompts of different lengths (an untimed pass first,
//!    then five timed ones, the median reported), then decodes the last pass's sequences
//!    round-robin, one token per sequence per step, greedily. Printed per backend: tokens per
//!    second, peak device memory (the allocator's own counters, the driver pool's counters for
//!    cudarc, and `cuMemGetInfo` sampled after every token), allocations per token, and the
//!    allocator's statistics. With `--against` and `--rounds` (`engine/rounds.rs`), the run is
//!    repeated for every backend in a rotating order and the medians compared.
//!
//! 3. CUDA graphs (`--graphs`): the decode step, batched over 1, 2, 4, 8, 16 or 32 sequences
//!    with fixed addresses (`engine/batch.rs`), captured into one graph per batch size, the six
//!    sharing one graph pool (`engine/graphs.rs`); the check runs it on the tiny model against
//!    the CPU reference, the benchmark replays it against the same step run eagerly and prints
//!    decode tokens/s, the allocators' driver calls during the captures and the pool's
//!    reserved bytes against the largest capture's alone, for each capture order.
//!
//! ```text
//! cargo run --release -p cudalloc --example engine -- --check
//! cargo run --release -p cudalloc --example engine -- --policy torch-expandable --tokens 128
//! cargo run --release -p cudalloc --example engine -- --graphs --graph-order both
//! cargo run --release -p cudalloc --example engine -- --against torch --rounds 5
//! ```

#[path = "engine/batch.rs"]
mod batch;
#[path = "engine/graphs.rs"]
mod graphs;
#[path = "engine/mem.rs"]
mod mem;
#[path = "engine/model.rs"]
mod model;
#[path = "engine/reference.rs"]
mod reference;
#[path = "engine/rounds.rs"]
mod rounds;

use clap::{Parser, ValueEnum};
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::buffer::cudarc::driver::{CudaContext, CudaStream};
use cudalloc_sys::ops::mempool;
use cudalloc_sys::CudaDevice;
use mem::{CudarcMem, Figure, Mem, PoolMem, Result};
use model::{Model, Shape, Weights};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Largest `max |got - want| / max |want|` of the logits the check accepts.
const TOLERANCE: f64 = 1e-3;

/// Timed passes over the prompts; the prefill figure is the median pass.
const PREFILL_PASSES: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StreamKind {
    /// A stream from `CudaContext::new_stream` (non-blocking; cudarc then tracks events).
    New,
    /// The legacy default stream.
    Default,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum GraphOrder {
    /// Batch 32 first, down to 1.
    LargestFirst,
    /// Batch 1 first, up to 32.
    SmallestFirst,
    /// Both, each into a pool of its own.
    Both,
}

impl GraphOrder {
    fn orders(self) -> Vec<graphs::Order> {
        use graphs::Order::{LargestFirst, SmallestFirst};
        match self {
            GraphOrder::LargestFirst => vec![LargestFirst],
            GraphOrder::SmallestFirst => vec![SmallestFirst],
            GraphOrder::Both => vec![LargestFirst, SmallestFirst],
        }
    }
}

/// A decoder-only transformer on cudalloc vs cudarc's allocation.
#[derive(Parser, Debug)]
#[command(name = "engine")]
struct Args {
    /// Only run the tiny reference check.
    #[arg(long)]
    check: bool,
    /// cudalloc policy: torch, torch-expandable or default.
    #[arg(long, default_value = "default")]
    policy: String,
    /// Also run the per-sequence benchmark on cudalloc with these policies (comma-separated)
    /// in the same process, and report each backend's median over the rounds.
    #[arg(long, value_delimiter = ',')]
    against: Vec<String>,
    /// Runs of every backend of the per-sequence benchmark, in a rotating order (none always
    /// first); above 1, or with --against, a table of the median tokens/s follows the report.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// More cudalloc configuration on top of the policy (PYTORCH_CUDA_ALLOC_CONF syntax plus
    /// cudalloc's keys, e.g. `max_split_size_mb:128`).
    #[arg(long)]
    conf: Option<String>,
    /// Transformer layers of the benchmark model.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// MLP size.
    #[arg(long, default_value_t = 2816)]
    ffn: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Prompt lengths, comma-separated (one sequence each).
    #[arg(long, default_value = "7,33,100,250,511")]
    prompts: String,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Which stream the engines run on.
    #[arg(long, value_enum, default_value_t = StreamKind::New)]
    stream: StreamKind,
    /// cudalloc: do not zero activation buffers (cudarc's `alloc_zeros` always does).
    #[arg(long)]
    uninit: bool,
    /// cudarc: let the driver's pool keep freed memory (release threshold at its maximum).
    #[arg(long)]
    retain: bool,
    /// Seed of the random weights and prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also capture the batched decode step into CUDA graphs (batch 1 to 32, one shared graph
    /// pool), check them on the tiny model and benchmark them against eager decoding (32
    /// prompts, lengths cycling through --prompts, --tokens tokens each). Needs --stream new.
    #[arg(long)]
    graphs: bool,
    /// With --graphs: the order in which the six batch sizes are captured into their pool.
    #[arg(long, value_enum, default_value_t = GraphOrder::Both)]
    graph_order: GraphOrder,
    /// With --graphs: also time each kind of op of the eager batched step, per batch size
    /// (events between the ops), paced by the host and then by the device (each step queued
    /// behind a wait on the device), and print the two tables.
    #[arg(long)]
    step_profile: bool,
    /// With --graphs: how the batched step computes its linear layers (eager and captured
    /// alike).
    #[arg(long, value_enum, default_value_t = batch::Linear::Rows)]
    step_linear: batch::Linear,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<ExitCode> {
    let policy = Policy::parse(&args.policy)?;
    if !args.graphs && (args.step_profile || args.step_linear != batch::Linear::Rows) {
        return Err("--step-profile and --step-linear apply to --graphs: add --graphs".into());
    }
    if args.graphs && args.stream != StreamKind::New {
        return Err(
            "--graphs needs --stream new (the legacy default stream cannot be captured)".into(),
        );
    }
    let ctx = CudaDevice::new(0)?.context().clone();
    let (major, minor) = ctx.compute_capability()?;
    println!(
        "device: {} (compute capability {major}.{minor}), {:.1} GiB",
        ctx.name()?,
        ctx.total_mem()? as f64 / (1u64 << 30) as f64
    );
    let passed = check(args, policy, &ctx)?;
    if args.check || !passed {
        return Ok(if passed {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    bench(args, policy, &ctx)?;
    if args.graphs && !bench_graphs(args, policy, &ctx)? {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn new_stream(ctx: &Arc<CudaContext>, kind: StreamKind) -> Result<Arc<CudaStream>> {
    Ok(match kind {
        StreamKind::New => ctx.new_stream()?,
        StreamKind::Default => ctx.default_stream(),
    })
}

fn pool_mem(args: &Args, policy: Policy, ctx: &Arc<CudaContext>) -> Result<PoolMem> {
    let mut cfg = Config::for_policy(policy);
    let mut label = policy.name().to_string();
    if let Some(extra) = &args.conf {
        cfg = Config::parse_onto(cfg, extra)?;
        label = format!("{label}, {extra}");
    }
    let alloc = Arc::new(CachingAllocator::new(CudaDevice::new(0)?, cfg));
    PoolMem::new(alloc, new_stream(ctx, args.stream)?, &label, args.uninit)
}

fn cudarc_mem(args: &Args, ctx: &Arc<CudaContext>) -> Result<CudarcMem> {
    CudarcMem::new(new_stream(ctx, args.stream)?, args.retain)
}

// ---------------------------------------------------------------------------------------------
// The reference check.

fn tiny() -> Shape {
    Shape {
        vocab: 97,
        hidden: 64,
        heads: 4,
        layers: 2,
        ffn: 96,
        eps: 1e-5,
        theta: 10000.0,
    }
}

/// Prefill 7 tokens, a chunk of 3, then 3 single tokens; every step's logits against the CPU.
fn check_one<M: Mem>(mem: M, host: &Weights<Vec<f32>>) -> Result<bool> {
    let shape = tiny();
    let model = Model::new(mem, shape, host)?;
    let label = model.mem.label();
    let mut seq = model.new_seq();
    let mut feed: Vec<u32> = vec![3, 14, 15, 92, 65, 35, 89];
    let (mut worst, mut greedy_agree, mut steps) = (0f64, 0, 0);
    for step in 0..5 {
        let logits = model.forward(&mut seq, &feed)?;
        let got = model.to_host(&logits)?;
        let want = reference::logits(&shape, host, &seq.tokens);
        worst = worst.max(reference::rel_err(&got, &want));
        let next = reference::argmax(&want);
        greedy_agree += usize::from(model.argmax(&logits)? == next);
        steps += 1;
        feed = if step == 0 {
            vec![next, 5, 17]
        } else {
            vec![next]
        };
    }
    model.mem.stream().synchronize()?;
    let ok = worst < TOLERANCE;
    println!(
        "check {label:<42} max rel err {worst:.2e} over {steps} steps (7, 3, 1, 1, 1 tokens; cache {}), greedy agrees {greedy_agree}/{steps}: {}",
        seq.len(),
        if ok { "ok" } else { "FAILED" }
    );
    Ok(ok)
}

fn check(args: &Args, policy: Policy, ctx: &Arc<CudaContext>) -> Result<bool> {
    let host = Weights::random(&tiny(), args.seed);
    let a = check_one(pool_mem(args, policy, ctx)?, &host)?;
    let b = check_one(cudarc_mem(args, ctx)?, &host)?;
    let c = !args.graphs || {
        // 32 short prompts, 4 decode steps: every batch size against the CPU reference.
        let lens: Vec<usize> = (0..batch::SLOTS).map(|r| [3, 7, 5, 11][r % 4]).collect();
        let model = Model::new(pool_mem(args, policy, ctx)?, tiny(), &host)?;
        graphs::check(&model, &host, &prompts(&lens, tiny().vocab, args.seed), 4)?
    };
    Ok(a && b && c)
}

// ---------------------------------------------------------------------------------------------
// The benchmark.

struct Run {
    label: String,
    prefill_tokens: usize,
    prefill_s: f64,
    decode_tokens: usize,
    decode_s: f64,
    peak_reserved: u64,
    peak_requested: u64,
    meminfo_peak: u64,
    allocs_per_token: f64,
    generated: Vec<Vec<u32>>,
    figures: Vec<Figure>,
}

/// Random prompts of the given lengths.
fn prompts(lens: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Prefills every prompt, then decodes them round-robin; `free0` is the device's free memory
/// before the model was built.
fn generate<M: Mem>(model: &Model<M>, prompts: &[Vec<u32>], new: usize, free0: u64) -> Result<Run> {
    let (m, ctx) = (&model.mem, model.mem.stream().context().clone());
    // Warm-up: one untimed pass over the prompts, each followed by one token: cuBLAS
    // heuristics and the kernels of every shape the timed part launches (the driver loads a
    // kernel on its first launch, so the backend measured first paid for both before), and the
    // pool's first segments. The timed prefill is what a server sees after its first requests.
    for p in prompts {
        let mut s = model.new_seq();
        let l = model.forward(&mut s, p)?;
        let t = model.argmax(&l)?;
        let l = model.forward(&mut s, &[t])?;
        model.argmax(&l)?;
    }
    m.stream().synchronize()?;
    m.reset_peaks()?;
    let mut min_free = ctx.mem_get_info()?.0 as u64;
    let sample = |min_free: &mut u64| -> Result<()> {
        *min_free = (*min_free).min(ctx.mem_get_info()?.0 as u64);
        Ok(())
    };

    // One pass over the prompts takes about 15 ms on the H200: the median of several is the figure.
    // The sequences of the last pass are decoded; allocations are counted from its start.
    let (mut seqs, mut last) = (Vec::new(), Vec::new());
    let (mut passes, mut allocs0) = (Vec::new(), 0);
    for _ in 0..PREFILL_PASSES {
        seqs.clear();
        last.clear();
        allocs0 = m.allocations();
        let t = Instant::now();
        for p in prompts {
            let mut s = model.new_seq();
            let l = model.forward(&mut s, p)?;
            last.push(model.argmax(&l)?);
            seqs.push(s);
            sample(&mut min_free)?;
        }
        passes.push(t.elapsed().as_secs_f64());
    }
    passes.sort_by(f64::total_cmp);
    let prefill_s = passes[passes.len() / 2];

    let t = Instant::now();
    for _ in 1..new {
        for (s, tok) in seqs.iter_mut().zip(last.iter_mut()) {
            let l = model.forward(s, &[*tok])?;
            *tok = model.argmax(&l)?;
            sample(&mut min_free)?;
        }
    }
    m.stream().synchronize()?;
    let decode_s = t.elapsed().as_secs_f64();

    let generated = seqs
        .iter()
        .zip(prompts)
        .zip(&last)
        .map(|((s, p), t)| {
            let mut g = s.tokens[p.len()..].to_vec();
            g.push(*t);
            g
        })
        .collect::<Vec<_>>();
    let total: usize = generated.iter().map(Vec::len).sum();
    let run = Run {
        label: m.label(),
        prefill_tokens: prompts.iter().map(Vec::len).sum(),
        prefill_s,
        decode_tokens: prompts.len() * new.saturating_sub(1),
        decode_s,
        peak_reserved: m.peak_reserved()?,
        peak_requested: m.peak_requested(),
        meminfo_peak: free0.saturating_sub(min_free),
        allocs_per_token: (m.allocations() - allocs0) as f64 / total.max(1) as f64,
        generated,
        figures: m.figures()?,
    };
    Ok(run)
}

fn bench_shape(args: &Args) -> Shape {
    Shape {
        vocab: args.vocab,
        hidden: args.hidden,
        heads: args.heads,
        layers: args.layers,
        ffn: args.ffn,
        eps: 1e-5,
        theta: 10000.0,
    }
}

/// `--prompts`, checked.
fn prompt_lens(args: &Args) -> Result<Vec<usize>> {
    let lens = args
        .prompts
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|e| format!("--prompts `{s}`: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if lens.is_empty() || lens.contains(&0) || args.tokens == 0 {
        return Err("need non-empty prompts and --tokens >= 1".into());
    }
    Ok(lens)
}

fn bench(args: &Args, policy: Policy, ctx: &Arc<CudaContext>) -> Result<()> {
    let shape = bench_shape(args);
    shape.check()?;
    let lens = prompt_lens(args)?;
    let params = shape.params();
    println!(
        "\nmodel: {} layers, hidden {}, {} heads, ffn {}, vocab {}: {:.1} M parameters ({:.0} MiB in f32)",
        shape.layers, shape.hidden, shape.heads, shape.ffn, shape.vocab,
        params as f64 / 1e6,
        params as f64 * 4.0 / (1u64 << 20) as f64
    );
    println!(
        "workload: prompts of {lens:?} tokens, {} new tokens each (greedy, round-robin), stream: {:?}",
        args.tokens, args.stream
    );
    let host = Weights::random(&shape, args.seed);
    let prompts = prompts(&lens, shape.vocab, args.seed);
    // Nothing of the check may linger in the driver's pool and skew cuMemGetInfo.
    ctx.synchronize()?;
    mempool::trim(ctx)?;

    let pooled = run_pooled(args, policy, ctx, (shape, &host), &prompts)?;
    let cudarc = run_cudarc(args, ctx, (shape, &host), &prompts)?;
    report(&pooled, &cudarc);
    if args.rounds > 1 || !args.against.is_empty() {
        let mut policies = vec![policy];
        for p in &args.against {
            policies.push(Policy::parse(p)?);
        }
        rounds::compare(args, &policies, ctx, (shape, &host), &prompts)?;
    }
    Ok(())
}

/// The benchmark model's shape and its weights on the host.
type Host<'a> = (Shape, &'a Weights<Vec<f32>>);

/// One benchmark run on a fresh cudalloc allocator of `policy`, its cache emptied after.
fn run_pooled(
    args: &Args,
    policy: Policy,
    ctx: &Arc<CudaContext>,
    (shape, host): Host<'_>,
    prompts: &[Vec<u32>],
) -> Result<Run> {
    let free0 = ctx.mem_get_info()?.0 as u64;
    let mem = pool_mem(args, policy, ctx)?;
    let alloc = mem.allocator().clone();
    let model = Model::new(mem, shape, host)?;
    let run = generate(&model, prompts, args.tokens, free0)?;
    let stream = model.mem.stream().clone();
    drop(model);
    stream.synchronize()?;
    alloc.empty_cache()?;
    Ok(run)
}

/// One benchmark run on cudarc's allocation, the driver's pool trimmed before and after.
fn run_cudarc(
    args: &Args,
    ctx: &Arc<CudaContext>,
    (shape, host): Host<'_>,
    prompts: &[Vec<u32>],
) -> Result<Run> {
    mempool::trim(ctx)?;
    let free0 = ctx.mem_get_info()?.0 as u64;
    let model = Model::new(cudarc_mem(args, ctx)?, shape, host)?;
    let run = generate(&model, prompts, args.tokens, free0)?;
    let stream = model.mem.stream().clone();
    drop(model);
    stream.synchronize()?;
    mempool::set_release_threshold(ctx, 0)?;
    mempool::trim(ctx)?;
    Ok(run)
}

/// The `--graphs` benchmark on the benchmark model, with a fresh cudalloc allocator; true if
/// the replayed tokens equal the eager ones.
fn bench_graphs(args: &Args, policy: Policy, ctx: &Arc<CudaContext>) -> Result<bool> {
    let shape = bench_shape(args);
    let lens = prompt_lens(args)?;
    let lens: Vec<usize> = (0..batch::SLOTS).map(|r| lens[r % lens.len()]).collect();
    let host = Weights::random(&shape, args.seed);
    let model = Model::new(pool_mem(args, policy, ctx)?, shape, &host)?;
    let steps = args.tokens.saturating_sub(1).max(1);
    println!(
        "\ngraphs: {} sequences (prompt lengths cycling through {}), {steps} decode steps per batch size, policy {}, linear layers {}",
        lens.len(),
        args.prompts,
        model.mem.label(),
        args.step_linear.name()
    );
    let prompts = prompts(&lens, shape.vocab, args.seed);
    let ok = graphs::bench(
        &model,
        &prompts,
        steps,
        &args.graph_order.orders(),
        args.step_profile,
        args.step_linear,
    )?;
    let (alloc, stream) = (model.mem.allocator().clone(), model.mem.stream().clone());
    drop(model);
    stream.synchronize()?;
    alloc.empty_cache()?;
    Ok(ok)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Tokens per second, or `-` when nothing was timed.
fn rate(tokens: usize, secs: f64) -> String {
    if tokens == 0 || secs <= 0.0 {
        "-".to_string()
    } else {
        format!("{:.1}", tokens as f64 / secs)
    }
}

fn report(a: &Run, b: &Run) {
    let rows: Vec<(&str, String, String)> = vec![
        (
            "decode tokens/s",
            rate(a.decode_tokens, a.decode_s),
            rate(b.decode_tokens, b.decode_s),
        ),
        (
            "prefill tokens/s (median pass)",
            rate(a.prefill_tokens, a.prefill_s),
            rate(b.prefill_tokens, b.prefill_s),
        ),
        (
            "peak reserved (allocator / driver pool)",
            mib(a.peak_reserved),
            mib(b.peak_reserved),
        ),
        (
            "peak requested (live buffers)",
            mib(a.peak_requested),
            mib(b.peak_requested),
        ),
        (
            "peak used by cuMemGetInfo (sampled per token)",
            mib(a.meminfo_peak),
            mib(b.meminfo_peak),
        ),
        (
            "allocations per generated token",
            format!("{:.1}", a.allocs_per_token),
            format!("{:.1}", b.allocs_per_token),
        ),
    ];
    println!();
    for run in [a, b] {
        println!("{}:", run.label);
        for (k, v) in &run.figures {
            println!("  {k:<42} {v}");
        }
    }
    let same = a.generated == b.generated;
    println!(
        "\ngenerated tokens identical on both backends: {}",
        if same {
            "yes"
        } else {
            "no (near-tied logits can flip with cuBLAS algorithm choice)"
        }
    );
    println!("\n| figure | {} | {} |", a.label, b.label);
    println!("| --- | --- | --- |");
    for (k, x, y) in rows {
        println!("| {k} | {x} | {y} |");
    }
}
