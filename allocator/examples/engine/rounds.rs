//! `--rounds N` and `--against P,...`: the per-sequence benchmark run `N` times on every
//! backend (cudalloc with `--policy`, then with each policy of `--against`, then cudarc) in
//! one process, the backends in a rotating order so that none always runs first (the first
//! run of a process is often slower, and the device's clocks and the driver's pool differ from
//! one process to the next, so backends are compared within a process). Printed: prefill and
//! decode tokens/s of every run and their medians, and the `--policy` backend's medians against
//! the best of the others (issue 30's targets: prefill within 2% of the best of cudarc and
//! `torch`; decode at least as fast as `torch`).

use super::mem::Result;
use super::{run_cudarc, run_pooled, Args, Host, Run};
use cudalloc::Policy;
use cudalloc_sys::buffer::cudarc::driver::CudaContext;
use std::sync::Arc;

/// A backend of the comparison.
#[derive(Clone, Copy)]
enum Backend {
    Pool(Policy),
    Cudarc,
}

/// Tokens/s of each run of one backend.
#[derive(Default)]
struct Figures {
    label: String,
    prefill: Vec<f64>,
    decode: Vec<f64>,
}

/// Runs every backend `args.rounds` times (at least once), rotating the order, and prints the
/// table; `policies[0]` is the one compared with the others.
pub fn compare(
    args: &Args,
    policies: &[Policy],
    ctx: &Arc<CudaContext>,
    model: Host<'_>,
    prompts: &[Vec<u32>],
) -> Result<()> {
    let mut backends: Vec<Backend> = policies.iter().map(|&p| Backend::Pool(p)).collect();
    backends.push(Backend::Cudarc);
    let mut figures: Vec<Figures> = backends.iter().map(|_| Figures::default()).collect();
    let rounds = args.rounds.max(1);
    for round in 0..rounds {
        for k in 0..backends.len() {
            let i = (k + round) % backends.len();
            let run = match backends[i] {
                Backend::Pool(p) => run_pooled(args, p, ctx, model, prompts)?,
                Backend::Cudarc => run_cudarc(args, ctx, model, prompts)?,
            };
            record(&mut figures[i], &run);
        }
    }
    print(&figures, rounds);
    Ok(())
}

fn record(f: &mut Figures, run: &Run) {
    f.label = run.label.clone();
    f.prefill.push(run.prefill_tokens as f64 / run.prefill_s);
    f.decode.push(run.decode_tokens as f64 / run.decode_s);
}

/// The median of `xs` (the lower middle one of an even count); 0 for none.
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

fn print(figures: &[Figures], rounds: usize) {
    println!("\nrounds: {rounds} runs of every backend in one process, the order rotating by one each round");
    println!("| backend | prefill tokens/s per run | median | decode tokens/s per run | median |");
    println!("| --- | --- | --- | --- | --- |");
    let list = |xs: &[f64]| {
        let v: Vec<String> = xs.iter().map(|x| format!("{x:.0}")).collect();
        v.join(", ")
    };
    for f in figures {
        println!(
            "| {} | {} | {:.0} | {} | {:.0} |",
            f.label,
            list(&f.prefill),
            median(&f.prefill),
            list(&f.decode),
            median(&f.decode)
        );
    }
    let (first, others) = figures.split_first().expect("at least one backend");
    for (what, pick) in [("prefill", 0), ("decode", 1)] {
        let of = |f: &Figures| median(if pick == 0 { &f.prefill } else { &f.decode });
        let best = others.iter().max_by(|a, b| of(a).total_cmp(&of(b)));
        if let Some(b) = best {
            println!(
                "rounds summary: {what} median, {} against the best of the others ({}): {:+.1}%",
                first.label,
                b.label,
                (of(first) / of(b) - 1.0) * 100.0
            );
        }
    }
}
