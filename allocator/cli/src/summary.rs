//! The summary of `cudalloc replay`: each policy (a name or a config string) over all the
//! traces replayed, as one point of the memory / driver-call frontier; with `--split`, the same
//! again over each part of the trace set (`split`), then over the traces no part names.
//!
//! Per policy: the geometric mean and the worst of peak reserved / peak live, the geometric
//! mean of min capacity / peak live (with `--min-capacity`), the driver calls of all the traces
//! together (mallocs, frees, maps and unmaps, each call counted), and on how many traces the
//! calls stay within 3 x the trace's `segment_alloc` events (PyTorch's `cudaMalloc` calls in the
//! recorded job), the reserved bytes within 1.05 x the peak live bytes (the per-trace budgets), and
//! both. Invariants: a replay that stopped at a failed allocation counts in none of the figures
//! (the counts say of how many traces); a trace with no live bytes has no ratio and counts in
//! none of the ratio figures; a trace without `segment_alloc` events (an RMM log, a snapshot
//! without them) has no call budget and counts in neither the calls nor the "both" count, and
//! neither has a snapshot whose history began after memory was allocated (allocations put
//! first): its `segment_alloc` events leave out the segments made before the history.

use crate::report::Report;
use crate::split::Split;
use crate::table::{ratio, thousands, write_table};
use std::borrow::Borrow;
use std::io::{self, Write};

/// Driver calls allowed per `segment_alloc` event of the recorded job.
pub const CALLS_PER_SEGMENT_ALLOC: u64 = 3;

/// The largest peak reserved / peak live counted as within budget.
pub const RESERVED_PER_LIVE: f64 = 1.05;

/// One configuration's figures over the traces.
#[derive(Debug, Default, PartialEq)]
pub struct Point {
    /// Traces whose replay completed, of all.
    pub completed: usize,
    pub traces: usize,
    /// Geometric mean of peak reserved / peak live over the completed replays of traces with
    /// live bytes (`measured` of them).
    pub reserved_per_live: Option<f64>,
    pub measured: usize,
    /// The largest peak reserved / peak live, and its trace.
    pub worst: Option<(f64, String)>,
    /// Geometric mean of min capacity / peak live over the `capped` replays that have one.
    pub min_capacity_per_live: Option<f64>,
    pub capped: usize,
    /// Driver calls over the completed replays.
    pub calls: u64,
    /// Completed replays within [`CALLS_PER_SEGMENT_ALLOC`], of those whose trace has
    /// `segment_alloc` events.
    pub within_calls: (usize, usize),
    /// Measured replays within [`RESERVED_PER_LIVE`].
    pub within_memory: usize,
    /// Measured replays within both budgets (of those with a call budget).
    pub within_both: usize,
}

/// The figures of configuration `i` (in the order of every report's runs).
pub fn point<R: Borrow<Report>>(reports: &[R], i: usize) -> Point {
    let mut p = Point {
        traces: reports.len(),
        ..Point::default()
    };
    let (mut ratios, mut caps) = (Vec::new(), Vec::new());
    for r in reports.iter().map(Borrow::borrow) {
        let Some(run) = r.runs.get(i).filter(|run| run.result.failure.is_none()) else {
            continue;
        };
        p.completed += 1;
        let calls = run.result.driver_calls();
        p.calls += calls;
        let budgeted = r.segment_allocs > 0 && r.before_history == 0;
        let calls_ok = calls <= CALLS_PER_SEGMENT_ALLOC * r.segment_allocs;
        if budgeted {
            p.within_calls.1 += 1;
            p.within_calls.0 += usize::from(calls_ok);
        }
        // A trace with no live bytes has no ratio: it counts in none of the ratio figures.
        let Some(x) = ratio(run.result.peak_reserved_bytes, r.peak_live) else {
            continue;
        };
        ratios.push(x);
        let memory_ok = x <= RESERVED_PER_LIVE;
        p.within_memory += usize::from(memory_ok);
        p.within_both += usize::from(memory_ok && budgeted && calls_ok);
        if p.worst.as_ref().is_none_or(|(w, _)| x > *w) {
            p.worst = Some((x, r.name.clone()));
        }
        caps.extend(run.min_capacity.and_then(|c| ratio(c, r.peak_live)));
    }
    (p.measured, p.capped) = (ratios.len(), caps.len());
    p.reserved_per_live = geometric_mean(&ratios);
    p.min_capacity_per_live = geometric_mean(&caps);
    p
}

/// Writes the summary table (nothing when there are no reports).
pub fn write(out: &mut impl Write, reports: &[Report]) -> io::Result<()> {
    write_titled(out, "", reports)
}

/// Writes the summary table of `reports`, its first line naming them `title` when not empty
/// (`split`: one part of a trace set).
pub fn write_titled<R: Borrow<Report>>(
    out: &mut impl Write,
    title: &str,
    reports: &[R],
) -> io::Result<()> {
    let Some(first) = reports.first().map(Borrow::borrow) else {
        return Ok(());
    };
    let of = if title.is_empty() {
        String::new()
    } else {
        format!(" of {title}")
    };
    writeln!(
        out,
        "summary over {} trace(s){of} (geo. mean: geometric mean; within calls: at most {} x \
         the trace's segment_alloc events; within {}: peak reserved at most that x peak live):",
        reports.len(),
        CALLS_PER_SEGMENT_ALLOC,
        RESERVED_PER_LIVE
    )?;
    let rows: Vec<Vec<String>> = first
        .runs
        .iter()
        .enumerate()
        .map(|(i, run)| row(&run.label, &point(reports, i)))
        .collect();
    let within = format!("within {RESERVED_PER_LIVE}");
    let headers = [
        "policy",
        "traces",
        "reserved/live: geo. mean",
        "worst",
        "min capacity/live: geo. mean",
        "driver calls",
        "within calls",
        &within,
        "both",
    ];
    write_table(out, &headers, &rows)
}

/// Writes the summary of each part of `split` over the reports it names (parts none of them is
/// in are left out), then over the reports no part names.
pub fn write_parts(out: &mut impl Write, split: &Split, reports: &[Report]) -> io::Result<()> {
    for part in split.parts() {
        let of: Vec<&Report> = reports
            .iter()
            .filter(|r| split.part_of(&r.name) == Some(part))
            .collect();
        if !of.is_empty() {
            writeln!(out)?;
            write_titled(out, &format!("split part `{part}`"), &of)?;
        }
    }
    let rest: Vec<&Report> = reports
        .iter()
        .filter(|r| split.part_of(&r.name).is_none())
        .collect();
    if !rest.is_empty() {
        writeln!(out)?;
        write_titled(out, "the traces no part names", &rest)?;
    }
    Ok(())
}

fn row(label: &str, p: &Point) -> Vec<String> {
    let fixed = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.3}"));
    // A mean over fewer traces than the others says over how many.
    let caps = match p.min_capacity_per_live {
        Some(x) if p.capped < p.measured => format!("{x:.3} ({} of {})", p.capped, p.measured),
        x => fixed(x),
    };
    let budgeted = |k: usize| match p.within_calls.1 {
        0 => "-".to_string(),
        n => format!("{k} of {n}"),
    };
    vec![
        label.to_string(),
        format!("{} of {}", p.completed, p.traces),
        fixed(p.reserved_per_live),
        p.worst
            .as_ref()
            .map_or("-".into(), |(x, name)| format!("{x:.3} ({name})")),
        caps,
        // Nothing completed: no calls were counted, which is not zero calls.
        if p.completed == 0 {
            "-".into()
        } else {
            thousands(p.calls)
        },
        budgeted(p.within_calls.0),
        match p.measured {
            0 => "-".to_string(),
            n => format!("{} of {n}", p.within_memory),
        },
        budgeted(p.within_both),
    ]
}

/// The geometric mean (`None` of nothing).
pub fn geometric_mean(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let log_sum: f64 = xs.iter().map(|x| x.ln()).sum();
    Some((log_sum / xs.len() as f64).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Run;
    use cudalloc::AllocError;
    use cudalloc_trace::replay::{Failure, ReplayResult};

    const MIB: u64 = 1 << 20;

    fn run(reserved_mib: u64, maps: u64, min_capacity_mib: Option<u64>) -> Run {
        Run {
            label: "c".into(),
            result: ReplayResult {
                events: 0,
                peak_live_bytes: 0,
                peak_allocated_bytes: 0,
                peak_reserved_bytes: reserved_mib * MIB,
                device_mallocs: 0,
                device_frees: 0,
                device_maps: maps,
                device_unmaps: 1,
                device_waits: 0,
                pages_moved: 0,
                given_back_bytes: 0,
                taken_back_bytes: 0,
                driver_waits: None,
                driver_time: None,
                ooms: 0,
                ns_per_event: 0.0,
                failure: None,
                timeline: Vec::new(),
                peak_excess: None,
                peak_pinning: None,
                calls: Vec::new(),
                answers: None,
                shards: false,
            },
            min_capacity: min_capacity_mib.map(|m| m * MIB),
            device_lag: 0,
        }
    }

    fn report(name: &str, live_mib: u64, segment_allocs: u64, run: Run) -> Report {
        Report {
            name: name.into(),
            events: 0,
            ops: 0,
            segment_allocs,
            peak_live: live_mib * MIB,
            map_floor: [0, 0],
            anomalies: Default::default(),
            before_history: 0,
            recorded_ooms: 0,
            position: Default::default(),
            lines: Default::default(),
            runs: vec![run],
        }
    }

    #[test]
    fn a_point_counts_each_budget_and_the_worst_trace() {
        let reports = [
            // 1.02 x live, 10 calls of 3 x 4 allowed.
            report("a", 100, 4, run(102, 9, Some(101))),
            // 1.08 x live, 13 calls of 3 x 4.
            report("b", 100, 4, run(108, 12, Some(104))),
            // No segment_alloc events: no call budget, so not in "both" though it has 0 calls.
            report("c", 200, 0, no_calls(run(200, 0, Some(200)))),
            // A history that began late: its segment_alloc events are not its budget.
            Report {
                before_history: 3,
                ..report("d", 100, 4, run(101, 9, Some(101)))
            },
        ];
        let p = point(&reports, 0);
        assert_eq!((p.completed, p.traces), (4, 4));
        assert_eq!(p.calls, 10 + 13 + 10);
        assert_eq!(p.within_calls, (1, 2));
        assert_eq!(p.within_memory, 3);
        // "a" meets both; "c" and "d" have no call budget, so they count in neither.
        assert_eq!(p.within_both, 1);
        let (worst, name) = p.worst.clone().unwrap();
        assert!((worst - 1.08).abs() < 1e-9 && name == "b", "{worst} {name}");
        let geo = (1.02f64 * 1.08 * 1.01).powf(0.25);
        assert!((p.reserved_per_live.unwrap() - geo).abs() < 1e-9);
        let caps = (1.01f64 * 1.04 * 1.01).powf(0.25);
        assert!((p.min_capacity_per_live.unwrap() - caps).abs() < 1e-9);
    }

    fn rendered(reports: &[Report]) -> String {
        let mut out = Vec::new();
        write(&mut out, reports).unwrap();
        String::from_utf8(out).unwrap()
    }

    fn no_calls(mut r: Run) -> Run {
        r.result.device_unmaps = 0;
        r
    }

    #[test]
    fn a_trace_with_no_live_bytes_counts_in_no_ratio_and_a_missing_cap_is_said() {
        let reports = [
            report("a", 100, 4, run(104, 2, Some(102))),
            report("b", 100, 4, run(102, 2, None)),
            // Nothing live: no ratio, no min capacity, but its calls count.
            report("empty", 0, 4, run(0, 0, Some(0))),
        ];
        let p = point(&reports, 0);
        assert_eq!((p.completed, p.measured, p.capped), (3, 2, 1));
        assert_eq!((p.within_memory, p.within_both), (2, 2));
        assert_eq!(p.within_calls, (3, 3));
        assert!((p.min_capacity_per_live.unwrap() - 1.02).abs() < 1e-9);
        let text = rendered(&reports);
        assert!(text.contains("1.020 (1 of 2)"), "{text}");
        assert!(text.contains("within 1.05"), "{text}");
    }

    #[test]
    fn a_failed_replay_counts_in_no_figure_and_a_missing_cap_in_no_mean() {
        let mut failed = run(500, 50, None);
        failed.result.failure = Some(Failure {
            op: 3,
            error: AllocError::TooLarge {
                requested: u64::MAX,
                limit: cudalloc::sizes::MAX_REQUEST,
            },
        });
        let reports = [
            report("a", 100, 4, run(103, 2, None)),
            report("b", 100, 4, failed),
        ];
        let p = point(&reports, 0);
        assert_eq!((p.completed, p.traces), (1, 2));
        assert_eq!((p.calls, p.within_calls, p.within_memory), (3, (1, 1), 1));
        assert_eq!(p.min_capacity_per_live, None);
        let text = rendered(&reports);
        assert!(text.contains("1 of 2"), "{text}");
        assert!(text.contains("1.030 (a)"), "{text}");
    }

    #[test]
    fn when_every_replay_fails_the_row_has_no_figures() {
        let mut failed = run(500, 50, None);
        failed.result.failure = Some(Failure {
            op: 0,
            error: AllocError::BadFraction(2.0),
        });
        let reports = [report("a", 100, 4, failed)];
        let p = point(&reports, 0);
        assert_eq!((p.completed, p.measured), (0, 0));
        let cells = row("x", &p);
        assert_eq!(cells[1], "0 of 1");
        assert!(
            cells[2..].iter().all(|c| c == "-"),
            "a row of no completed replay shows no figure: {cells:?}"
        );
    }

    #[test]
    fn geometric_mean_of_ratios() {
        assert_eq!(geometric_mean(&[]), None);
        let g = geometric_mean(&[1.0, 4.0]).unwrap();
        assert!((g - 2.0).abs() < 1e-12);
    }
}
