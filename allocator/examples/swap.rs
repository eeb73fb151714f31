//! Two models on one GPU whose weights together do not fit under the allocator's cap, served
//! in turns by sleeping one and waking the other (`CachingAllocator::sleep` and `wake`).
//!
//! The models are the example engine's (`engine/model.rs`: a Llama-shaped transformer in
//! `f32` with random weights, cuBLAS and NVRTC kernels), two of one shape with different seeds.
//!
//! 1. Alone: each model on an allocator of its own, without a cap, answers its requests
//!    (greedy generation of `--tokens` tokens after a prompt); the tokens are kept.
//! 2. Swapped: one allocator capped at `--cap` times one model's weights (less than both
//!    models' weights: checked), each model's weights in a tag of their own
//!    (`PoolMem::tag_weights`: `tagged_buffer_from`). Model A is loaded and put to sleep
//!    (offloaded); model B is loaded. Then `--rounds` rounds, each serving one request of each
//!    model: before each request the model not needed sleeps (`sleep([its tag], [its tag])`)
//!    and the needed one wakes (`wake([its tag], stream)`); the KV caches and activations are
//!    untagged, freed after each request, and go back to the device when a wake needs the room.
//!
//! Printed: the weights of each model and the cap, every swap's time (sleep, wake and the
//! stream's wait, ending when the woken weights are in place) with the GB/s of the weights
//! moved, and whether every request's tokens equal those of the model alone. Exit status 1 if
//! any differ.
//!
//! ```text
//! cargo run --release -p cudalloc --example swap
//! cargo run --release -p cudalloc --example swap -- --layers 16 --rounds 4 --policy torch-expandable
//! ```

#[path = "engine/mem.rs"]
#[allow(dead_code)] // the engine's report functions
mod mem;
#[path = "engine/model.rs"]
#[allow(dead_code)] // the engine's accessors
mod model;

use clap::Parser;
use cudalloc::interop::stream_id;
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::buffer::cudarc::driver::CudaContext;
use cudalloc_sys::CudaDevice;
use mem::{Mem, PoolMem, Result};
use model::{Model, Shape, Weights};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Two models under one cap, swapped by sleep and wake.
#[derive(Parser, Debug)]
#[command(name = "swap")]
struct Args {
    /// cudalloc policy: default or torch-expandable (sleep needs expandable segments).
    #[arg(long, default_value = "default")]
    policy: String,
    /// Transformer layers of each model.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// MLP size.
    #[arg(long, default_value_t = 5632)]
    ffn: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Prompt length of every request.
    #[arg(long, default_value_t = 48)]
    prompt: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 24)]
    tokens: usize,
    /// Rounds (one request of each model per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The allocator's cap, in multiples of one model's weights (below 2: both do not fit).
    #[arg(long, default_value_t = 1.5)]
    cap: f64,
}

const TAGS: [&str; 2] = ["model-a", "model-b"];

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("swap: {e}");
            ExitCode::FAILURE
        }
    }
}

fn shape(a: &Args) -> Shape {
    Shape {
        vocab: a.vocab,
        hidden: a.hidden,
        heads: a.heads,
        layers: a.layers,
        ffn: a.ffn,
        eps: 1e-5,
        theta: 10000.0,
    }
}

/// The prompt of request `r` of model `m`.
fn prompt(a: &Args, m: usize, r: usize) -> Vec<u32> {
    (0..a.prompt as u64)
        .map(|i| ((i * 7919 + r as u64 * 104_729 + m as u64 * 31) % a.vocab as u64) as u32)
        .collect()
}

/// Greedy generation of `tokens` tokens after `prompt`.
fn generate<M: Mem>(model: &Model<M>, prompt: &[u32], tokens: usize) -> Result<Vec<u32>> {
    let mut seq = model.new_seq();
    let mut logits = model.forward(&mut seq, prompt)?;
    let mut out = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let next = model.argmax(&logits)?;
        out.push(next);
        logits = model.forward(&mut seq, &[next])?;
    }
    Ok(out)
}

fn new_alloc(policy: Policy) -> Result<Arc<CachingAllocator<CudaDevice>>> {
    Ok(Arc::new(CachingAllocator::new(
        CudaDevice::new(0)?,
        Config::for_policy(policy),
    )))
}

fn run(a: &Args) -> Result<bool> {
    let policy = Policy::parse(&a.policy)?;
    let ctx: Arc<CudaContext> = CudaDevice::new(0)?.context().clone();
    let s = shape(a);
    let hosts = [Weights::random(&s, 1), Weights::random(&s, 2)];
    let weight_bytes = s.params() as u64 * 4;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;

    // 1. Each model alone, no cap.
    let mut alone = Vec::new();
    for (m, host) in hosts.iter().enumerate() {
        let mem = PoolMem::new(new_alloc(policy)?, ctx.new_stream()?, &a.policy, false)?;
        let model = Model::new(mem, s, host)?;
        let answers: Vec<Vec<u32>> = (0..a.rounds)
            .map(|r| generate(&model, &prompt(a, m, r), a.tokens))
            .collect::<Result<_>>()?;
        alone.push(answers);
    }

    // 2. Both under one cap, swapped.
    let alloc = new_alloc(policy)?;
    let cap = (a.cap * weight_bytes as f64) as u64;
    if cap >= 2 * weight_bytes {
        return Err(format!(
            "--cap {} lets both models' weights fit: use less than 2",
            a.cap
        )
        .into());
    }
    alloc.set_memory_limit(Some(cap));
    println!(
        "policy {}, two models of {:.2} GiB of weights each ({} layers, hidden {}), cap {:.2} GiB",
        policy.name(),
        gib(weight_bytes),
        s.layers,
        s.hidden,
        gib(cap)
    );
    let stream = ctx.new_stream()?;
    let sid = stream_id(&stream);
    let load = |m: usize| -> Result<Model<PoolMem>> {
        let mem = PoolMem::new(alloc.clone(), stream.clone(), &a.policy, false)?;
        Model::new(mem.tag_weights(TAGS[m]), s, &hosts[m])
    };
    let model_a = load(0)?;
    alloc.sleep(&[TAGS[0]], &[TAGS[0]])?;
    let model_b = load(1)?;
    let models = [&model_a, &model_b];
    let mut awake = 1;
    let (mut same, mut swaps) = (true, Vec::<Duration>::new());
    for r in 0..a.rounds {
        for (m, model) in models.iter().enumerate() {
            if awake != m {
                let t = Instant::now();
                alloc.sleep(&[TAGS[awake]], &[TAGS[awake]])?;
                alloc.wake(&[TAGS[m]], sid)?;
                stream.synchronize()?;
                swaps.push(t.elapsed());
                awake = m;
            }
            let got = generate(model, &prompt(a, m, r), a.tokens)?;
            let ok = alone[m].get(r) == Some(&got);
            same &= ok;
            println!(
                "round {r} model {}: {} tokens {}",
                TAGS[m],
                got.len(),
                if ok {
                    "identical to the model alone"
                } else {
                    "DIFFER from the model alone"
                }
            );
        }
    }
    for (i, d) in swaps.iter().enumerate() {
        println!(
            "swap {}: {:.1} ms ({:.1} GB/s of weights out and in)",
            i + 1,
            d.as_secs_f64() * 1e3,
            2.0 * weight_bytes as f64 / d.as_secs_f64() / 1e9
        );
    }
    if let Some(best) = swaps.iter().min() {
        let mean = swaps.iter().sum::<Duration>() / swaps.len() as u32;
        println!(
            "swaps: {}, best {:.1} ms, mean {:.1} ms; peak reserved {:.2} GiB under the cap of {:.2} GiB",
            swaps.len(),
            best.as_secs_f64() * 1e3,
            mean.as_secs_f64() * 1e3,
            gib(alloc.stats().reserved_bytes.0[0].peak as u64),
            gib(cap)
        );
    }
    println!(
        "tokens: {}",
        if same { "all identical" } else { "SOME DIFFER" }
    );
    // The sleeping model's weights are freed as they are dropped (their blocks would go back
    // at a wake; both models do not fit under the cap together, so none is woken).
    stream.synchronize()?;
    Ok(same)
}
