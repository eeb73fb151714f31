//! `cudalloc replay --json`: one JSON object per (trace, configuration) per line.

use crate::report::{Report, Run};
use cudalloc_trace::replay::PeakPinning;
use cudalloc_trace::Anomalies;
use serde_json::{json, Value};
use std::io::{self, Write};

/// The object of one replay, with exactly the documented keys (`peak_breakdown` only with
/// `--breakdown`, once an operation has completed; in it, `pinned_units` and `pinned_by`: how
/// many chunks or segments held pinned bytes, and the five that held the most). `events` and
/// `ns_per_event` count replayed operations (`alloc` and `free_completed`), as the table's `ops`
/// and `ns/op` do; the keys keep their first names so that scripts reading them keep working.
/// `trace_lines` counts every action of the trace (the header line's "trace lines read") and
/// `trace_lines_per_s` spreads the replay time over them (the table's `Mlines/s`; null for a
/// failed replay).
/// `completed` is false when an allocation failed; `failure` then says at which operation (its
/// index among those replayed, and the trace line or snapshot entry it comes from) and why
/// (null otherwise), and the peaks are those reached before it. `anomalies` are the trace's odd
/// events (frees of addresses not live, allocations of live ones);
/// `allocations_before_history` the allocations a snapshot's reader put first for memory live
/// before its history began; `recorded_ooms` the trace's `oom` events (allocations that failed
/// when it was recorded; not replayed); `device_lag` the lag of `--device-lag` (0 without it);
/// `driver_time` each kind of driver call's count and time with `--cuda`; `shards` whether the
/// replay drove `CachingAllocator`'s stream shards (`--shards`, `--answers`); `answers`, with
/// `--answers`, the trace's recorded answers to event queries (`recorded`), those the replay
/// gave (`used`) and its queries that had none left in their operation (`unrecorded`).
pub fn object(report: &Report, run: &Run) -> Value {
    let r = &run.result;
    let mut v = json!({
        "trace": report.name,
        "policy": run.label,
        "completed": r.failure.is_none(),
        "failure": r.failure.as_ref().map(|f| json!({
            "op": f.op,
            "line": report.line_of(f.op),
            "error": f.error.to_string(),
        })),
        "anomalies": anomalies(&report.anomalies),
        "events": r.events,
        "peak_live_bytes": r.peak_live_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "min_capacity_bytes": run.min_capacity,
        "device_lag": run.device_lag,
        "device_mallocs": r.device_mallocs,
        "device_frees": r.device_frees,
        "device_maps": r.device_maps,
        "device_unmaps": r.device_unmaps,
        "device_waits": r.device_waits,
        "pages_moved": r.pages_moved,
        "given_back_bytes": r.given_back_bytes,
        "taken_back_bytes": r.taken_back_bytes,
        "driver_waits": r.driver_waits,
        "driver_time": driver_time(r),
        "shards": r.shards,
        "answers": r.answers.map(|a| json!({
            "recorded": a.recorded,
            "used": a.used,
            "unrecorded": a.unrecorded,
        })),
        "ooms": r.ooms,
        "ns_per_event": (r.events > 0).then(|| (r.ns_per_event * 10.0).round() / 10.0),
        "trace_lines": report.events,
        "trace_lines_per_s": report.lines_per_second(run).map(f64::round),
        "segment_alloc_events": report.segment_allocs,
        "map_floor_2pct": report.map_floor[0],
        "map_floor_5pct": report.map_floor[1],
        "allocations_before_history": report.before_history,
        "recorded_ooms": report.recorded_ooms,
    });
    if let Some((op, e)) = r.peak_excess {
        v["peak_breakdown"] = json!({
            "op": op,
            "line": report.line_of(op),
            "reserved_bytes": e.reserved,
            "live_bytes": e.live,
            "rounding_bytes": e.rounding,
            "pending_bytes": e.pending,
            "releasable_bytes": e.releasable,
            "pinned_bytes": e.pinned,
            "pinned_page_bytes": e.pinned_pages,
        });
        if let Some(p) = &r.peak_pinning {
            v["peak_breakdown"]["pinned_units"] = json!(p.units);
            v["peak_breakdown"]["pinned_by"] = pinned_by(report, p);
        }
    }
    v
}

/// With `--cuda`, `{kind: {calls, ns}}` for each kind of driver call the replay made (the
/// `Call` names: `create_page`, `map`, `set_access`, `unmap`, `release_page`, ...); `null` on
/// the simulated device.
fn driver_time(r: &cudalloc_trace::replay::ReplayResult) -> Value {
    let Some(kinds) = &r.driver_time else {
        return Value::Null;
    };
    let kinds = kinds.iter().map(|(call, t)| {
        let time = json!({"calls": t.calls, "ns": t.ns});
        (call.name().to_string(), time)
    });
    Value::Object(kinds.collect())
}

/// The trace's odd events: `unmatched_frees`, `double_allocs`, `mismatched_frees` and
/// `first_line` (null when there are none), as `replay --json` and `stats` give them.
pub fn anomalies(a: &Anomalies) -> Value {
    json!({
        "unmatched_frees": a.unmatched_frees,
        "double_allocs": a.double_allocs,
        "mismatched_frees": a.mismatched_frees,
        "first_line": a.first_line,
    })
}

/// The units that held the most pinned bytes at the reserved peak, each as `kind` (`chunk` or
/// `segment`), `addr`, `unit_bytes`, `pinned_bytes`, `holding_blocks` (blocks in use in it),
/// `largest_holding_block_bytes`, `largest_holding_block_op` (the operation that allocated
/// it; null when it is waiting for events) and `largest_holding_block_line` (that operation's
/// line or trace entry; null as the op is, or for an allocation put before the history).
fn pinned_by(report: &Report, p: &PeakPinning) -> Value {
    p.most
        .iter()
        .map(|(u, op)| {
            json!({
                "kind": if u.chunk { "chunk" } else { "segment" },
                "addr": u.addr,
                "unit_bytes": u.size,
                "pinned_bytes": u.pinned,
                "holding_blocks": u.holders,
                "largest_holding_block_bytes": u.largest.1,
                "largest_holding_block_op": op,
                "largest_holding_block_line": op.and_then(|op| report.line_of(op)),
            })
        })
        .collect()
}

/// Writes the lines of one trace; with `--split`, each with `split_part`: the part of the split
/// the trace is in (`part`: `Some(None)` for none, written as `null`).
pub fn write_lines(
    out: &mut impl Write,
    report: &Report,
    part: Option<Option<&str>>,
) -> io::Result<()> {
    for run in &report.runs {
        let mut v = object(report, run);
        if let (Some(part), Value::Object(map)) = (part, &mut v) {
            map.insert("split_part".into(), json!(part));
        }
        writeln!(out, "{v}")?;
    }
    Ok(())
}
