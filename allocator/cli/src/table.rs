//! Human-readable output of `cudalloc replay`: a header line and a table per trace, the
//! failures of capped replays (the summary across traces is `summary`).

use crate::report::{Report, Run};
use cudalloc::fmt::bytes;
use cudalloc_trace::replay::PeakPinning;
use cudalloc_trace::{Anomalies, Position};
use std::io::{self, Write};

const HEADERS: [&str; 14] = [
    "policy",
    "ops",
    "peak live",
    "peak allocated",
    "peak reserved",
    "reserved/live",
    "min capacity",
    "mallocs",
    "frees",
    "maps",
    "unmaps",
    "OOMs",
    "ns/op",
    "Mlines/s",
];

/// Writes the header line, the table and the failures of one trace.
pub fn write_report(out: &mut impl Write, r: &Report, capacity: Option<u64>) -> io::Result<()> {
    writeln!(out, "{}", header_line(r, capacity))?;
    let rows: Vec<Vec<String>> = r.runs.iter().map(|run| row(run, r)).collect();
    write_table(out, &HEADERS, &rows)?;
    report_breakdowns(out, r)?;
    report_answers(out, r)?;
    report_failures(out, r)?;
    writeln!(out)
}

/// Writes, per replay that gave recorded answers (`--answers`), how many it gave; per replay
/// through the stream shards without them (`--shards`), that it was one.
fn report_answers(out: &mut impl Write, r: &Report) -> io::Result<()> {
    for run in &r.runs {
        if run.result.shards && run.result.answers.is_none() {
            writeln!(
                out,
                "{}: replayed through the allocator's stream shards (peak allocated: the sum of \
                 the shards' peaks)",
                run.label
            )?;
        }
        if let Some(a) = run.result.answers {
            // Fewer answers asked for than recorded: the replay is not the recorded run.
            let why = if a.used < a.recorded {
                " (the replay asks at other times than the recorded run: another policy or \
                 config, or a trace recorded with thread caches on)"
            } else {
                ""
            };
            writeln!(
                out,
                "{}: {} of the {} recorded answers to event queries given as the GPU gave them; \
                 {} queries had none left in their operation (answered done){why}",
                run.label,
                thousands(a.used),
                thousands(a.recorded),
                thousands(a.unrecorded)
            )?;
        }
    }
    Ok(())
}

/// Writes, per replay asked to (`--breakdown`), where the reserved bytes were at their peak.
fn report_breakdowns(out: &mut impl Write, r: &Report) -> io::Result<()> {
    for run in &r.runs {
        if let Some((op, e)) = run.result.peak_excess {
            writeln!(
                out,
                "{}: at peak reserved (op {}{}): {} = live {} + rounding {} + pending {} + releasable {} + pinned {} ({} of it in whole pages)",
                run.label,
                thousands(op as u64),
                r.place_of(op).map_or(String::new(), |p| format!(", {p}")),
                bytes(e.reserved),
                bytes(e.live),
                bytes(e.rounding),
                bytes(e.pending),
                bytes(e.releasable),
                bytes(e.pinned),
                bytes(e.pinned_pages)
            )?;
        }
        if let Some(p) = &run.result.peak_pinning {
            report_pinning(out, r, p)?;
        }
    }
    Ok(())
}

/// Writes what held the pinned bytes at the reserved peak: how many units, and the few that
/// held the most.
fn report_pinning(out: &mut impl Write, r: &Report, p: &PeakPinning) -> io::Result<()> {
    if p.units == 0 {
        return Ok(());
    }
    writeln!(
        out,
        "  pinned in {} chunks or segments; the most:",
        thousands(p.units as u64)
    )?;
    for (u, op) in &p.most {
        let made = op.map_or(String::new(), |op| {
            let place = r.place_of(op).map_or(String::new(), |p| format!(", {p}"));
            format!(", allocated at op {}{place}", thousands(op as u64))
        });
        writeln!(
            out,
            "    {} pinned in a {} {} beside {} block{} in use (the largest {}{made})",
            bytes(u.pinned),
            bytes(u.size),
            if u.chunk { "chunk" } else { "segment" },
            u.holders,
            if u.holders == 1 { "" } else { "s" },
            bytes(u.largest.1),
        )?;
    }
    Ok(())
}

fn header_line(r: &Report, capacity: Option<u64>) -> String {
    let mut line = format!(
        "{}: {} trace lines read, {} ops replayed, {} segment_alloc, peak live {}, map floor {} (2%) / {} (5%)",
        r.name,
        thousands(r.events),
        thousands(r.ops),
        thousands(r.segment_allocs),
        bytes(r.peak_live),
        thousands(r.map_floor[0]),
        thousands(r.map_floor[1])
    );
    if let Some(c) = capacity {
        line += &format!(", capacity {}", bytes(c));
    }
    if r.recorded_ooms > 0 {
        line += &format!(
            ", {} oom events recorded (failed allocations, not replayed)",
            thousands(r.recorded_ooms)
        );
    }
    if r.before_history > 0 {
        line += &format!(
            ", {} allocations live before the history began put first (no call budget: \
             segments made before the history are not among its segment_alloc events)",
            thousands(r.before_history)
        );
    }
    if let Some(a) = anomalies(&r.anomalies, r.position) {
        line += &format!("; anomalies: {a}");
    }
    line
}

/// The trace's odd events in words, with the first line (or trace entry) that has one
/// (`None`: none).
pub fn anomalies(a: &Anomalies, position: Position) -> Option<String> {
    let first = a.first_line?;
    Some(format!(
        "{} unmatched frees, {} double allocs, {} frees whose size or stream differs from their \
         alloc's (first at {} {first})",
        a.unmatched_frees,
        a.double_allocs,
        a.mismatched_frees,
        position.noun()
    ))
}

fn row(run: &Run, report: &Report) -> Vec<String> {
    let (r, peak_live) = (&run.result, report.peak_live);
    vec![
        run.label.clone(),
        thousands(r.events),
        bytes(r.peak_live_bytes),
        bytes(r.peak_allocated_bytes),
        bytes(r.peak_reserved_bytes),
        // A failed replay's peak is not the trace's: no ratio.
        ratio(r.peak_reserved_bytes, peak_live)
            .filter(|_| r.events > 0 && r.failure.is_none())
            .map_or("-".into(), |x| format!("{x:.3}")),
        run.min_capacity.map_or("-".into(), bytes),
        thousands(r.device_mallocs),
        thousands(r.device_frees),
        thousands(r.device_maps),
        thousands(r.device_unmaps),
        thousands(r.ooms),
        if r.events > 0 {
            format!("{:.0}", r.ns_per_event)
        } else {
            "-".into()
        },
        report
            .lines_per_second(run)
            .map_or("-".into(), |l| format!("{:.1}", l / 1e6)),
    ]
}

/// Peak reserved over peak live bytes (`None` when nothing was live).
pub fn ratio(reserved: u64, live: u64) -> Option<f64> {
    (live > 0).then(|| reserved as f64 / live as f64)
}

/// Writes a line per replay that stopped at a failed allocation.
pub fn report_failures(out: &mut impl Write, r: &Report) -> io::Result<()> {
    for run in &r.runs {
        if let Some(f) = &run.result.failure {
            writeln!(
                out,
                "{} / {}: failed at op {} of {}{}: {}",
                r.name,
                run.label,
                f.op,
                r.ops,
                r.place_of(f.op)
                    .map_or(String::new(), |p| format!(" ({p})")),
                f.error
            )?;
        }
    }
    Ok(())
}

/// Writes a table: the first column left-aligned, the others right-aligned.
pub fn write_table(out: &mut impl Write, headers: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    write_row(out, &header, &widths)?;
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    write_row(out, &rule, &widths)?;
    for row in rows {
        write_row(out, row, &widths)?;
    }
    Ok(())
}

fn write_row(out: &mut impl Write, cells: &[String], widths: &[usize]) -> io::Result<()> {
    let mut line = String::new();
    for (i, (cell, &w)) in cells.iter().zip(widths).enumerate() {
        if i == 0 {
            line += &format!("{cell:<w$}");
        } else {
            line += &format!("  {cell:>w$}");
        }
    }
    writeln!(out, "{}", line.trim_end())
}

/// `1234567` -> `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let (head, tail) = digits.split_at((digits.len() - 1) % 3 + 1);
    let mut out = head.to_string();
    for group in tail.as_bytes().chunks(3) {
        out.push(',');
        out.extend(group.iter().map(|&d| d as char));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
