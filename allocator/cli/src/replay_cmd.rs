//! `cudalloc replay`: every trace under every configuration, reported as tables, JSON lines
//! and optionally a plot.

use crate::args::{ReplayArgs, Variant};
use crate::error::{say, CliError};
use crate::progress::{Progress, LONG_OPS};
use crate::report::{Report, Run};
use crate::split::Split;
use crate::sweep::GARBAGE_COLLECTION_KEY;
use crate::{bundled, calls, json, notes, plot, summary, table};
use cudalloc::fmt::bytes;
use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{
    min_capacity, replay, search_pages, ReplayOptions, ReplayResult, DEVICE_CAPACITY,
};
use cudalloc_trace::{self as trace, Trace};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Timeline samples per replay when plotting.
const PLOT_SAMPLES: usize = 2000;

/// What a replay is asked to do besides measuring.
struct Plan {
    capacity: Option<u64>,
    min_capacity: bool,
    samples: usize,
    cuda: bool,
    breakdown: bool,
    calls: bool,
    device_lag: Option<u64>,
    answers: bool,
    shards: bool,
}

/// Runs the command; exit status 1 when a replay failed.
pub fn run(args: &ReplayArgs) -> Result<ExitCode, CliError> {
    let variants = args.variants().map_err(CliError::msg)?;
    variants
        .iter()
        .filter_map(Variant::note)
        .for_each(|n| say!("{n}"));
    check_distinct(&variants)?;
    variants.iter().try_for_each(check_no_thread_cache_keys)?;
    let capped = args.capacity.is_some() || args.min_capacity;
    for v in &variants {
        check_garbage_collection(v, capped, REPLAY_CAP)?;
        if args.capacity.is_none() && !fraction_capped(v) && garbage_collected(v) {
            warn_probes_only(v);
        }
    }
    check_capacity(args)?;
    check_device_lag(args)?;
    check_answers_flags(args)?;
    if let Some(path) = &args.plot {
        check_plot_path(path)?;
    }
    if args.cuda {
        check_cuda()?;
    }
    let paths = if args.traces.is_empty() {
        bundled::find()?
    } else {
        args.traces.clone()
    };
    check_distinct_paths(&paths)?;
    if let Some(path) = &args.calls {
        calls::check_path(path, &paths)?;
    }
    let split = args.split.as_deref().map(Split::read).transpose();
    let split = split.map_err(CliError::msg)?;
    let mut traces = read_all(&paths, args.device)?;
    name_apart(&mut traces, &paths);
    notes::warn_if_empty(&traces);
    let shardable = !(args.cuda || args.shards || args.answers || args.min_capacity);
    notes::note_streams(&traces, variants.iter().map(|v| &v.cfg), shardable);
    if args.answers {
        check_answers_recorded(&traces, &paths)?;
    }
    let plan = Plan {
        capacity: args.capacity,
        min_capacity: args.min_capacity,
        samples: if args.plot.is_some() { PLOT_SAMPLES } else { 0 },
        cuda: args.cuda,
        breakdown: args.breakdown,
        calls: args.calls.is_some(),
        device_lag: args.device_lag,
        answers: args.answers,
        shards: args.shards,
    };
    let long = traces.iter().any(|t| t.ops.len() as u64 > LONG_OPS);
    let steps = (traces.len() * variants.len()) as u64;
    let progress = Progress::new(steps, args.min_capacity || long);
    let mut reports = Vec::with_capacity(traces.len());
    let printed = replay_and_print(
        &traces,
        &variants,
        &plan,
        args,
        &progress,
        &mut reports,
        split.as_ref(),
    );
    progress.finish();
    match printed {
        // The reader stopped reading (a pipe closed): no more replays, and the status says
        // whether one of those made failed.
        Err(CliError::BrokenPipe) => return Ok(status(&reports)),
        other => other?,
    }
    if let Some(path) = &args.plot {
        write_plot(path, &reports)?;
    }
    if let Some(path) = &args.calls {
        calls::write(path, &reports)?;
    }
    Ok(status(&reports))
}

/// Replays each trace under every configuration and prints its report as it completes (each
/// report is kept in `reports` before it is printed), then the summary, and with a split one
/// summary per part.
fn replay_and_print(
    traces: &[Trace],
    variants: &[Variant],
    plan: &Plan,
    args: &ReplayArgs,
    progress: &Progress,
    reports: &mut Vec<Report>,
    split: Option<&Split>,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    for t in traces {
        reports.push(replay_trace(t, variants, plan, progress));
        let report = reports.last().expect("just pushed");
        progress.suspend(|| print_report(&mut out, report, args, split))?;
    }
    // One trace under one configuration: its report says it all.
    if !args.json && (variants.len() > 1 || reports.len() > 1) {
        summary::write(&mut out, reports)?;
        if let Some(split) = split {
            summary::write_parts(&mut out, split, reports)?;
        }
    }
    Ok(out.flush()?)
}

/// 1 when a replay failed, else 0.
fn status(reports: &[Report]) -> ExitCode {
    let mut runs = reports.iter().flat_map(|r| &r.runs);
    if runs.any(|r| r.result.failure.is_some()) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Reads the traces, with a bar while that takes long ([`Progress::reading`]).
pub fn read_all(paths: &[PathBuf], device: Option<usize>) -> Result<Vec<Trace>, CliError> {
    let bytes = paths
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum();
    let progress = Progress::reading(paths.len() as u64, bytes);
    let read = paths
        .iter()
        .map(|p| {
            progress.message(p.display().to_string());
            let t = trace::read_device(p, device).map_err(|e| CliError::msg(e.to_string()));
            progress.step();
            t
        })
        .collect();
    progress.finish();
    read
}

fn print_report(
    out: &mut impl Write,
    report: &Report,
    args: &ReplayArgs,
    split: Option<&Split>,
) -> Result<(), CliError> {
    if args.json {
        json::write_lines(out, report, split.map(|s| s.part_of(&report.name)))?;
        // Said on stderr as `say!` says things: a stderr that cannot be written stops nothing.
        let _ = table::report_failures(&mut std::io::stderr(), report);
    } else {
        table::write_report(out, report, args.capacity)?;
    }
    Ok(())
}

/// Refuses a configuration asked for twice under one label (`--policy torch --policy torch`);
/// says so on stderr when two labels give the same rules (`--policy torch --config
/// policy:torch`, or a sweep through the default's own value), which then count twice in the
/// summary.
fn check_distinct(variants: &[Variant]) -> Result<(), CliError> {
    for (i, v) in variants.iter().enumerate() {
        if let Some(w) = variants[..i].iter().find(|w| w.label == v.label) {
            return Err(CliError::msg(format!(
                "`{}` is asked for twice; give each policy, --config and --sweep value once",
                w.label
            )));
        }
        if let Some(w) = variants[..i].iter().find(|w| w.cfg == v.cfg) {
            say!(
                "warning: `{}` and `{}` are the same configuration (both are replayed, and both \
                 count in the summary)",
                w.label,
                v.label
            );
        }
    }
    Ok(())
}

/// Refuses the thread-cache keys: a replay (and `cudalloc stats`) drives the pool on one
/// thread, without the thread caches of `CachingAllocator`, so they would change nothing.
pub fn check_no_thread_cache_keys(v: &Variant) -> Result<(), CliError> {
    let plain = Config::for_policy(v.cfg.policy());
    let c = &v.cfg;
    let keys = [
        ("thread_cache", c.front().thread_cache.is_some()),
        (
            "thread_cache_mb",
            c.front().thread_cache_bytes != plain.front().thread_cache_bytes,
        ),
        (
            "thread_cache_block_mb",
            c.front().thread_cache_block != plain.front().thread_cache_block,
        ),
        (
            "thread_cache_large",
            c.front().thread_cache_large != plain.front().thread_cache_large,
        ),
    ];
    match keys.iter().find(|k| k.1) {
        Some((key, _)) => Err(CliError::msg(format!(
            "`{}`: `{key}` has no effect here: the pool is driven on one thread, without the \
             thread caches of CachingAllocator and the C library",
            v.label
        ))),
        None => Ok(()),
    }
}

/// How `cudalloc replay` caps its replays, said when `garbage_collection_threshold` needs a cap.
const REPLAY_CAP: &str = "give --capacity or per_process_memory_fraction (or --min-capacity, \
                          whose capped probes it changes)";

/// True when `v` sets `garbage_collection_threshold` (0, the key's absence, is refused by the
/// config parser as a value).
fn garbage_collected(v: &Variant) -> bool {
    v.cfg.pool().garbage_collection_threshold > 0.0
}

/// Refuses `garbage_collection_threshold` where the replay would ignore it: the pool collects
/// garbage only under a memory cap (`capped`; `remedy` says how to get one), and then frees only
/// whole cached segments of the `torch` policy, never the expandable policies' blocks (see
/// `policy::torch::garbage_collect_cached_blocks`).
pub fn check_garbage_collection(v: &Variant, capped: bool, remedy: &str) -> Result<(), CliError> {
    if !garbage_collected(v) {
        return Ok(());
    }
    let capped = capped || fraction_capped(v);
    let why = if v.cfg.policy() != Policy::Torch {
        format!(
            "only the `torch` policy collects garbage (it frees whole cached segments, under a \
             memory cap); the policy here is `{}`, whose expandable segments it never frees",
            v.cfg.policy().name()
        )
    } else if !capped {
        format!("the pool collects garbage only under a memory cap; {remedy}")
    } else {
        return Ok(());
    };
    Err(CliError::msg(format!(
        "`{}`: `{GARBAGE_COLLECTION_KEY}` has no effect here: {why}",
        v.label
    )))
}

/// True when the configuration caps the pool itself (`per_process_memory_fraction` below 1).
fn fraction_capped(v: &Variant) -> bool {
    v.cfg.pool().memory_fraction.is_some_and(|f| f < 1.0)
}

/// Says that `garbage_collection_threshold` changes only the min capacity of a replay with
/// --min-capacity and no --capacity (its other figures come from a replay without a cap).
fn warn_probes_only(v: &Variant) {
    say!(
        "warning: `{}`: `{GARBAGE_COLLECTION_KEY}` changes only the min capacity here: the other \
         figures come from a replay without a cap (give --capacity to cap them too)",
        v.label
    );
}

/// Refuses a trace given twice (by the same path or another path to the same file): it would
/// count twice in the summary.
fn check_distinct_paths(paths: &[PathBuf]) -> Result<(), CliError> {
    let key = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
    for (i, p) in paths.iter().enumerate() {
        if let Some(q) = paths[..i].iter().find(|q| key(q) == key(p)) {
            return Err(CliError::msg(format!(
                "the trace {} is given twice ({} and {})",
                p.display(),
                q.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// Names traces whose file names collide (`a/x.csv` and `b/x.csv`) by their paths, so that the
/// tables and the JSON tell them apart.
fn name_apart(traces: &mut [Trace], paths: &[PathBuf]) {
    let names: Vec<String> = traces.iter().map(|t| t.name.clone()).collect();
    for (t, p) in traces.iter_mut().zip(paths) {
        if names.iter().filter(|n| **n == t.name).count() > 1 {
            t.name = p.display().to_string();
        }
    }
}

/// Refuses `--cuda` before any replay when there is no GPU 0 to replay on (each replay would
/// otherwise fail alike at its first operation).
fn check_cuda() -> Result<(), CliError> {
    cudalloc_sys::CudaDevice::new(0)
        .map(drop)
        .map_err(|e| CliError::msg(format!("--cuda: {e}")))
}

/// Refuses --device-lag where it cannot hold: through the driver (the GPU's own pace decides
/// there) and with --min-capacity (whose probes run with the device keeping up).
fn check_device_lag(args: &ReplayArgs) -> Result<(), CliError> {
    let Some(lag) = args.device_lag else {
        return Ok(());
    };
    let with = if args.cuda {
        "--cuda (the GPU runs at its own pace there)"
    } else if args.min_capacity {
        "--min-capacity (its probes run with the device keeping up)"
    } else {
        return Ok(());
    };
    Err(CliError::msg(format!(
        "--device-lag {lag} cannot be used with {with}"
    )))
}

/// Refuses --answers and --shards where they cannot hold: through the driver (the GPU answers
/// there; the shards replay on the simulated device), --answers with --device-lag (another
/// model of the device's pace; --shards takes it) and with --min-capacity (its probes replay
/// one pool).
fn check_answers_flags(args: &ReplayArgs) -> Result<(), CliError> {
    let flag = match (args.answers, args.shards) {
        (false, false) => return Ok(()),
        (true, _) => "--answers",
        (false, true) => "--shards",
    };
    let with = if args.cuda && args.answers {
        "--cuda (the GPU answers there)"
    } else if args.cuda {
        "--cuda (the shards replay on the simulated device)"
    } else if let Some(lag) = args.device_lag.filter(|_| args.answers) {
        &format!("--device-lag {lag} (another model of how far the device runs behind)")
    } else if args.min_capacity {
        "--min-capacity (its probes replay one pool, the device keeping up)"
    } else {
        return Ok(());
    };
    Err(CliError::msg(format!("{flag} cannot be used with {with}")))
}

/// Refuses --answers for a trace that holds no recorded answer.
fn check_answers_recorded(traces: &[Trace], paths: &[PathBuf]) -> Result<(), CliError> {
    match traces.iter().zip(paths).find(|(t, _)| t.answers.is_empty()) {
        Some((_, path)) => Err(CliError::msg(format!(
            "--answers: {} records no answer to an event query (no `event_done` or \
             `event_pending` line): only traces the C library writes (cudalloc_trace_start) \
             hold them, and only when the allocator asked",
            path.display()
        ))),
        None => Ok(()),
    }
}

/// Refuses a cap the simulated device could never reach (it has an H200's memory); through
/// the driver the device itself says what it has.
fn check_capacity(args: &ReplayArgs) -> Result<(), CliError> {
    match args.capacity {
        Some(0) => Err(CliError::msg(
            "--capacity 0 leaves no room for any allocation: every replay would fail at its first",
        )),
        Some(c) if !args.cuda && c > DEVICE_CAPACITY => Err(CliError::msg(format!(
            "--capacity {} is more than the simulated H200 has ({}); replays are capped by the \
             device anyway",
            bytes(c),
            bytes(DEVICE_CAPACITY)
        ))),
        _ => Ok(()),
    }
}

/// Refuses a plot path that does not end in `.html` or `.htm` (`--plot` takes a value, so
/// `--plot trace.csv.gz` would otherwise overwrite the trace with the page), or whose folder
/// does not exist (found before the replays, not after them).
fn check_plot_path(path: &std::path::Path) -> Result<(), CliError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase());
    let name = name.unwrap_or_default();
    let html = [".html", ".htm"]
        .iter()
        .find(|e| name.ends_with(*e))
        .map(|e| name.len() > e.len());
    match html {
        Some(true) => {}
        Some(false) => {
            return Err(CliError::msg(format!(
                "--plot needs a file name before the extension, not {}",
                path.display()
            )))
        }
        None => {
            return Err(CliError::msg(format!(
                "--plot writes an HTML page; give it a file ending in .html, not {}",
                path.display()
            )))
        }
    }
    check_output(path, "the plot")
}

/// Refuses an output file (`what`: "the plot") whose folder does not exist or that cannot be
/// opened for writing; opening it changes nothing (a file this made is removed again), so that
/// an output that cannot be written is refused before the replays, not after them.
pub(crate) fn check_output(path: &std::path::Path, what: &str) -> Result<(), CliError> {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !folder.is_dir() {
        return Err(CliError::msg(format!(
            "cannot write {what} to {}: there is no folder {}",
            path.display(),
            folder.display()
        )));
    }
    let existed = path.exists();
    let opened = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path);
    if let Err(e) = opened {
        return Err(CliError::msg(format!(
            "cannot write {what} to {}: {e}",
            path.display()
        )));
    }
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

fn write_plot(path: &std::path::Path, reports: &[Report]) -> Result<(), CliError> {
    let html = plot::html(reports);
    std::fs::write(path, html)
        .map_err(|e| CliError::msg(format!("cannot write the plot to {}: {e}", path.display())))?;
    say!("plot written to {}", path.display());
    Ok(())
}

fn replay_trace(t: &Trace, variants: &[Variant], plan: &Plan, progress: &Progress) -> Report {
    let runs: Vec<Run> = variants
        .iter()
        .map(|v| replay_variant(t, v, plan, progress))
        .collect();
    Report::new(t, runs)
}

fn replay_variant(t: &Trace, v: &Variant, plan: &Plan, progress: &Progress) -> Run {
    progress.message(format!("{} / {}", t.name, v.label));
    let opts = ReplayOptions {
        capacity: plan.capacity,
        samples: plan.samples,
        cuda: plan.cuda,
        breakdown: plan.breakdown,
        calls: plan.calls,
        device_lag: plan.device_lag,
        answers: plan.answers,
        shards: plan.shards,
    };
    let mut result = replay(t, &v.cfg, &opts);
    if !plan.cuda && result.failure.is_none() {
        // The first replay's time counts only when it did nothing but replay.
        let plain = plan.samples == 0 && !plan.breakdown && !plan.calls;
        let first = plain.then_some(result.ns_per_event);
        result.ns_per_event = median_ns_per_event(t, &v.cfg, plan, first);
    }
    progress.step();
    let min_capacity = if plan.min_capacity {
        find_min_capacity(t, v, &result, plan.capacity, progress)
    } else {
        None
    };
    Run {
        label: v.label.clone(),
        result,
        min_capacity,
        device_lag: plan.device_lag.unwrap_or(0),
    }
}

/// Fewest and most replays [`median_ns_per_event`] times, and the time after which it stops
/// adding more.
const TIMED_RUNS: (usize, usize) = (5, 101);
const TIMED_FOR: Duration = Duration::from_millis(100);

/// The replay speed of `t` under `cfg`: the median ns per operation of an odd number of timed
/// replays on the simulated device, made after the replay that gave the figures (`first`, its
/// time when it did nothing but replay): five or more, up to 101 while they took less than
/// 100 ms together; a single replay when one takes 100 ms or more (`first` when it did nothing
/// but replay, else the next). The first replay in a process runs on cold caches and a fresh
/// heap, and a few milliseconds of replays of a short trace land inside whatever else the
/// machine does at the time (docs/policies.md, *Replay speed*). Its figures (bytes, calls) are
/// the same every time.
fn median_ns_per_event(t: &Trace, cfg: &Config, plan: &Plan, first: Option<f64>) -> f64 {
    let opts = ReplayOptions {
        capacity: plan.capacity,
        device_lag: plan.device_lag,
        answers: plan.answers,
        shards: plan.shards,
        ..ReplayOptions::default()
    };
    let start = Instant::now();
    let long = |ns: f64| ns * t.ops.len() as f64 >= TIMED_FOR.as_nanos() as f64;
    median_of_runs(
        first,
        long,
        || replay(t, cfg, &opts).ns_per_event,
        || start.elapsed(),
    )
}

/// The median of further `run`s, as [`median_ns_per_event`] counts them (`first` only when
/// `long`): `long` says whether a run took [`TIMED_FOR`] or more, `elapsed` how long the
/// further runs took.
fn median_of_runs(
    first: Option<f64>,
    long: impl Fn(f64) -> bool,
    mut run: impl FnMut() -> f64,
    elapsed: impl Fn() -> Duration,
) -> f64 {
    if let Some(ns) = first.filter(|&ns| long(ns)) {
        return ns;
    }
    let mut times: Vec<f64> = Vec::new();
    loop {
        let n = times.len();
        let more = n < TIMED_RUNS.0 || (n < TIMED_RUNS.1 && elapsed() < TIMED_FOR);
        if !more && n % 2 == 1 {
            break;
        }
        times.push(run());
        if n == 0 && long(times[0]) {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Bisects for the smallest completing cap, starting from the peak reserved bytes of an uncapped
/// replay; `None` when even the uncapped replay does not fit on the simulated device.
fn find_min_capacity(
    t: &Trace,
    v: &Variant,
    measured: &ReplayResult,
    capacity: Option<u64>,
    progress: &Progress,
) -> Option<u64> {
    let uncapped;
    let upper_run = match capacity {
        None => measured,
        Some(_) => {
            progress.add(1);
            uncapped = replay(t, &v.cfg, &ReplayOptions::default());
            progress.step();
            &uncapped
        }
    };
    if upper_run.failure.is_some() {
        return None;
    }
    let upper = upper_run.peak_reserved_bytes;
    progress.message(format!("{} / {}: min capacity", t.name, v.label));
    let most = most_probes(t.peak_live, upper);
    progress.add(most);
    let made = std::cell::Cell::new(0u64);
    let cap = min_capacity(t, &v.cfg, upper, |_, _| {
        made.set(made.get() + 1);
        progress.step();
    });
    // The bisection may stop a probe early: the bar still ends full.
    for _ in made.get()..most {
        progress.step();
    }
    Some(cap)
}

/// The most probes `min_capacity` makes between the peak live bytes and `upper`: a bisection
/// over the pages from the most that cannot hold the live peak to the fewest that hold `upper`.
fn most_probes(peak_live: u64, upper: u64) -> u64 {
    let (lo, hi) = search_pages(peak_live, upper);
    u64::from(64 - (hi - lo).saturating_sub(1).leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudalloc_trace::bound::PAGE;

    /// Runs `median_of_runs` with runs that return 1, 2, 3, ... ns (long from `long_from` on)
    /// and a clock that passes the time limit after `fast` runs; (median, runs made).
    fn timed(first: Option<f64>, long_from: f64, fast: usize) -> (f64, usize) {
        let runs = std::cell::Cell::new(0usize);
        let median = median_of_runs(
            first,
            |ns| ns >= long_from,
            || {
                runs.set(runs.get() + 1);
                runs.get() as f64
            },
            || {
                if runs.get() < fast {
                    Duration::ZERO
                } else {
                    TIMED_FOR
                }
            },
        );
        (median, runs.get())
    }

    /// `most_probes` bounds the probes of a bisection over pages, whatever the outcomes, and
    /// some outcome reaches it.
    #[test]
    fn most_probes_bounds_the_bisection() {
        for (live_pages, hi) in [(0u64, 0u64), (0, 1), (1, 1), (3, 4), (10, 17), (100, 164)] {
            let (lo, _) = search_pages(live_pages * PAGE, hi * PAGE);
            let most = most_probes(live_pages * PAGE, hi * PAGE);
            let mut seen = 0;
            // Every answer the bisection could reach: the probes it takes to find it.
            for answer in lo + 1..=hi.max(lo + 1) {
                let (mut a, mut b, mut probes) = (lo, hi, 0);
                while b - a > 1 {
                    let mid = a + (b - a) / 2;
                    probes += 1;
                    if mid >= answer {
                        b = mid;
                    } else {
                        a = mid;
                    }
                }
                assert!(probes <= most, "{live_pages}/{hi}: {probes} > {most}");
                seen = seen.max(probes);
            }
            assert_eq!(seen, most, "{live_pages}/{hi}");
        }
    }

    #[test]
    fn replay_speed_is_the_median_of_an_odd_number_of_warm_runs() {
        // Fast runs: 101 in all after the first, which is not counted (median of 1..101).
        assert_eq!(timed(Some(0.5), f64::MAX, usize::MAX), (51.0, 101));
        // Slow runs after the first six: seven in all (an odd count).
        assert_eq!(timed(Some(9.0), f64::MAX, 6), (4.0, 7));
        // The clock passes the limit at once: five runs, the fewest.
        assert_eq!(timed(None, f64::MAX, 0), (3.0, 5));
        // A first replay that took the limit or more is timed alone; so is a long first run.
        assert_eq!(timed(Some(140.0), 100.0, usize::MAX), (140.0, 0));
        assert_eq!(timed(None, 1.0, usize::MAX), (1.0, 1));
    }
}
