//! What each rule of the `default` policy is worth: every trace replayed with all rules on,
//! then with each rule off alone, summed up in one markdown table (the one in
//! `docs/policies.md`):
//!
//! ```sh
//! cargo run --release -p cudalloc-cli --example rule_table -- traces/*.gz traces/h200/*.gz
//! ```
//!
//! Traces are split as `traces/split.json` says: those it lists as held out (never tuned on)
//! against the rest (the tuning set); a trace named twice (by two paths) counts once. Per rule:
//! peak reserved / peak live bytes and driver calls, as geometric means over each set with the
//! rule off (all on in the first row); how many traces the rule's absence makes worse by more
//! than 1% in reserved bytes or in calls; and a verdict: a rule pays when, without it, the
//! held-out traces reserve more or call more (geometric means), or one of them does worse by
//! more than 1%. Progress goes to stderr.

use cudalloc::policy::default::{DefaultConfig, DefaultPolicy, Rules};
use cudalloc::{Config, Policy};
use cudalloc_cli::split::Split;
use cudalloc_trace::replay::{replay_policy, ReplayOptions};
use std::collections::HashSet;
use std::error::Error;
use std::path::{Path, PathBuf};

/// A figure worse by more than this fraction counts as worse on that trace.
const WORSE: f64 = 0.01;
/// Geometric means within this fraction of all-on count as no worse (rounding of the table).
const SAME_MEMORY: f64 = 1e-4;
const SAME_CALLS: f64 = 1e-3;
/// Traces made worse are named when there are at most this many.
const NAMED: usize = 4;

/// One configuration's figures on one trace.
#[derive(Clone, Copy)]
struct Figures {
    reserved_per_live: f64,
    calls: f64,
}

/// A row: a label and the configuration it replays.
struct Variant {
    label: String,
    cfg: DefaultConfig,
}

fn variants() -> Vec<Variant> {
    let all = DefaultConfig::default();
    let mut out = vec![Variant {
        label: "(all on)".to_string(),
        cfg: all,
    }];
    out.push(Variant {
        label: "layout_plans".to_string(),
        cfg: DefaultConfig {
            layout_plans: false,
            ..all
        },
    });
    for (name, switch) in Rules::switches() {
        let mut cfg = all;
        *switch(&mut cfg.rules) = false;
        out.push(Variant {
            label: name.to_string(),
            cfg,
        });
    }
    out
}

/// `traces/split.json`: which traces are held out (its part `held_out`).
fn split() -> Result<Split, Box<dyn Error>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/split.json");
    let split = Split::read(&path)?;
    if !split.parts().any(|p| p == "held_out") {
        return Err("traces/split.json: no held_out part".into());
    }
    Ok(split)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

/// The traces named on the command line (each file name once), or the bundled ones.
fn traces() -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let mut named: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if named.is_empty() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
        for dir in [root.clone(), root.join("h200")] {
            for e in std::fs::read_dir(&dir)? {
                named.push(e?.path());
            }
        }
        named.retain(|p| p.to_string_lossy().ends_with(".trace.csv.gz"));
        named.sort();
    }
    let mut seen = HashSet::new();
    named.retain(|p| seen.insert(file_name(p)));
    Ok(named)
}

fn geo_mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}

/// Geometric means of a variant's figures over the traces `pick` selects.
fn means(rows: &[Vec<Figures>], v: usize, pick: &[bool], want: bool) -> (f64, f64) {
    let of = |f: fn(&Figures) -> f64| {
        geo_mean(
            rows.iter()
                .zip(pick)
                .filter(|p| *p.1 == want)
                .map(|(r, _)| f(&r[v])),
        )
    };
    (of(|f| f.reserved_per_live), of(|f| f.calls))
}

/// Traces where variant `v` does worse than all-on by more than [`WORSE`]: how many of the
/// held-out ones, and the indexes of all.
fn worse_than_all_on(rows: &[Vec<Figures>], v: usize, held: &[bool]) -> (usize, Vec<usize>) {
    let worse = |r: &Vec<Figures>| {
        let (on, off) = (r[0], r[v]);
        off.reserved_per_live > on.reserved_per_live * (1.0 + WORSE)
            || off.calls > on.calls * (1.0 + WORSE)
    };
    let all: Vec<usize> = (0..rows.len()).filter(|&i| worse(&rows[i])).collect();
    (all.iter().filter(|&&i| held[i]).count(), all)
}

/// The names of traces `which`, when there are at most [`NAMED`] of them.
fn named(names: &[String], which: &[usize]) -> String {
    if which.is_empty() || which.len() > NAMED {
        return String::new();
    }
    let short = |i: &usize| names[*i].trim_end_matches(".trace.csv").to_string();
    which.iter().map(short).collect::<Vec<_>>().join(", ")
}

/// What a rule saves on a set of traces, given its geometric means with all rules on and with
/// the rule off: (memory, calls), each +1 (saved), -1 (cost) or 0.
fn saves(on: (f64, f64), off: (f64, f64)) -> (i8, i8) {
    let sign = |on: f64, off: f64, same: f64| {
        if off > on * (1.0 + same) {
            1
        } else if off < on * (1.0 - same) {
            -1
        } else {
            0
        }
    };
    (
        sign(on.0, off.0, SAME_MEMORY),
        sign(on.1, off.1, SAME_CALLS),
    )
}

/// The verdict on a rule: it pays when it saves memory or calls on the held-out traces (or
/// keeps one of them from doing worse by more than [`WORSE`]).
fn judge(held: (i8, i8), worse_held: usize, tuning: (i8, i8)) -> String {
    let (memory, calls) = held;
    if memory > 0 || calls > 0 || worse_held > 0 {
        let what = match (memory > 0, calls > 0) {
            (true, true) => "memory and calls",
            (true, false) => "memory",
            (false, true) => "calls",
            (false, false) => "some traces",
        };
        let cost = match (memory < 0, calls < 0) {
            (true, _) => " (costs memory)",
            (_, true) => " (costs calls)",
            _ => "",
        };
        format!("pays: {what}{cost}")
    } else if tuning.0 > 0 || tuning.1 > 0 {
        "pays on the tuning set only".to_string()
    } else {
        "does not pay".to_string()
    }
}

/// Every trace's figures under every variant: `rows[trace][variant]`. Progress on stderr.
fn measure(paths: &[PathBuf], variants: &[Variant]) -> Result<Vec<Vec<Figures>>, Box<dyn Error>> {
    let opts = ReplayOptions::default();
    let base = Config::for_policy(Policy::Default);
    let mut rows = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let trace = cudalloc_trace::read(path)?;
        let live = trace.peak_live.max(1) as f64;
        let mut row = Vec::with_capacity(variants.len());
        for (j, v) in variants.iter().enumerate() {
            eprint!(
                "\r[{}/{}] {}: {}/{} {:<40}",
                i + 1,
                paths.len(),
                trace.name,
                j + 1,
                variants.len(),
                v.label
            );
            let r = replay_policy(DefaultPolicy::new(v.cfg), &trace, &base, &opts);
            if let Some(f) = &r.failure {
                eprintln!("\n{}: {} failed: {f:?}", trace.name, v.label);
            }
            row.push(Figures {
                reserved_per_live: r.peak_reserved_bytes as f64 / live,
                calls: r.driver_calls() as f64,
            });
        }
        rows.push(row);
    }
    eprintln!();
    Ok(rows)
}

/// All-on with the rules of `off` (variants, by index) off together.
fn together(variants: &[Variant], off: &[usize], label: &str) -> Variant {
    let mut cfg = variants[0].cfg;
    for &v in off {
        let mut one = variants[v].cfg;
        cfg.layout_plans &= one.layout_plans;
        for (_, switch) in Rules::switches() {
            if !*switch(&mut one.rules) {
                *switch(&mut cfg.rules) = false;
            }
        }
    }
    Variant {
        label: label.to_string(),
        cfg,
    }
}

/// The verdict on each variant but the first (all on), which gets none.
fn verdicts(rows: &[Vec<Figures>], variants: usize, held: &[bool]) -> Vec<String> {
    let (on_held, on_tuning) = (means(rows, 0, held, true), means(rows, 0, held, false));
    let mut out = vec![String::new()];
    out.extend((1..variants).map(|v| {
        let (w_held, _) = worse_than_all_on(rows, v, held);
        let out = saves(on_held, means(rows, v, held, true));
        judge(out, w_held, saves(on_tuning, means(rows, v, held, false)))
    }));
    out
}

/// The table's rows for `variants` from `skip` on, over traces named `names`.
fn print_rows(
    rows: &[Vec<Figures>],
    variants: &[Variant],
    verdicts: &[String],
    skip: usize,
    held: &[bool],
    names: &[String],
) {
    for v in skip..variants.len() {
        let tuning = means(rows, v, held, false);
        let out = means(rows, v, held, true);
        let (w_held, w_all) = worse_than_all_on(rows, v, held);
        println!(
            "| {} | {:.4} | {:.4} | {:.1} | {:.1} | {} / {} | {} | {} |",
            variants[v].label,
            tuning.0,
            out.0,
            tuning.1,
            out.1,
            w_held,
            w_all.len(),
            named(names, &w_all),
            verdicts[v]
        );
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let split = split()?;
    let paths = traces()?;
    let held: Vec<bool> = paths
        .iter()
        .map(|p| split.part_of(&file_name(p)) == Some("held_out"))
        .collect();
    let names: Vec<String> = paths
        .iter()
        .map(|p| file_name(p).trim_end_matches(".gz").to_string())
        .collect();
    let variants = variants();
    let rows = measure(&paths, &variants)?;
    let mut verdict = verdicts(&rows, variants.len(), &held);
    // The rules that do not pay, and those that pay on the tuning set only, off together: rules
    // that back each other up (either one does the job) each look idle alone.
    let pick = |what: &[&str]| -> Vec<usize> {
        (1..variants.len())
            .filter(|&v| what.contains(&verdict[v].as_str()))
            .collect()
    };
    let idle = pick(&["does not pay"]);
    let tuned = pick(&["does not pay", "pays on the tuning set only"]);
    let mut combined = vec![together(&variants, &[], "(all on)")];
    if !idle.is_empty() {
        combined.push(together(
            &variants,
            &idle,
            "(every rule that does not pay alone)",
        ));
    }
    if tuned.len() > idle.len() {
        let label = "(and those that pay on the tuning set only)";
        combined.push(together(&variants, &tuned, label));
    }
    let (mut rows2, mut verdict2) = (Vec::new(), Vec::new());
    if combined.len() > 1 {
        rows2 = measure(&paths, &combined)?;
        verdict2 = verdicts(&rows2, combined.len(), &held);
    }
    if idle.len() > 1 && verdict2[1] != "does not pay" {
        for &v in &idle {
            let others: Vec<&str> = idle
                .iter()
                .filter(|&&o| o != v)
                .map(|&o| variants[o].label.as_str())
                .collect();
            verdict[v] = format!(
                "not alone: with {} off too, {}",
                others.join(", "),
                verdict2[1]
            );
        }
    }
    let n_held = held.iter().filter(|h| **h).count();
    println!(
        "| rule off | reserved/live, tuning ({}) | reserved/live, held out ({n_held}) | driver \
         calls, tuning | driver calls, held out | traces worse by >1%: held out / all | which | \
         verdict |",
        held.len() - n_held
    );
    println!("|---|---|---|---|---|---|---|---|");
    print_rows(&rows, &variants, &verdict, 0, &held, &names);
    if combined.len() > 1 {
        print_rows(&rows2, &combined, &verdict2, 1, &held, &names);
    }
    Ok(())
}
