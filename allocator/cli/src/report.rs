//! What `cudalloc replay` measured: a [`Report`] per trace, holding a [`Run`] per
//! configuration. The table, JSON, summary and plot writers read these; `replay_cmd` fills them.

use cudalloc_trace::bound::{map_floor, PAGE};
use cudalloc_trace::replay::ReplayResult;
use cudalloc_trace::{Anomalies, Position, Trace};
use std::collections::BTreeMap;

/// The slacks the map floor is reported for (the `default` policy's budget and the per-trace
/// memory target, 1.05 x the live peak).
pub const FLOOR_SLACKS: [f64; 2] = [0.02, 0.05];

/// One replay of a trace under one configuration.
pub struct Run {
    /// The configuration's label.
    pub label: String,
    /// What the replay measured.
    pub result: ReplayResult,
    /// The smallest cap the replay completes under, when asked for and found.
    pub min_capacity: Option<u64>,
    /// The device's lag in operations (`--device-lag`; 0: it keeps up).
    pub device_lag: u64,
}

/// A trace and its replays.
pub struct Report {
    /// The trace's name (file name without directory and `.gz`).
    pub name: String,
    /// Lines (records) of the trace read, of every action; the table's "trace lines" (not the
    /// JSON's `events`, which counts the operations replayed).
    pub events: u64,
    /// Operations to replay.
    pub ops: u64,
    /// `segment_alloc` events (PyTorch's `cudaMalloc` calls).
    pub segment_allocs: u64,
    /// Peak of the summed requested bytes of live allocations.
    pub peak_live: u64,
    /// The map floor within 2% and 5% of the live peak ([`cudalloc_trace::bound`]).
    pub map_floor: [u64; 2],
    /// Odd events of the trace.
    pub anomalies: Anomalies,
    /// Allocations put first because they were live before a snapshot's history began.
    pub before_history: u64,
    /// `oom` events of the trace (allocations that failed when it was recorded; not replayed).
    pub recorded_ooms: u64,
    /// What the trace's line numbers count (lines, or a snapshot's trace entries).
    pub position: Position,
    /// The line (or trace entry) of each operation a report names: where a replay failed, the
    /// reserved peak and the allocations pinning the most at it ([`Trace::line_of`]).
    pub lines: BTreeMap<usize, u64>,
    /// The replays, in the order of the configurations.
    pub runs: Vec<Run>,
}

impl Report {
    /// The report of trace `t` and its replays `runs` (the trace's figures, its map floor and
    /// the lines the runs' reports name).
    pub fn new(t: &Trace, runs: Vec<Run>) -> Report {
        Report {
            name: t.name.clone(),
            events: t.events,
            ops: t.ops.len() as u64,
            segment_allocs: t.segment_allocs,
            peak_live: t.peak_live,
            map_floor: FLOOR_SLACKS.map(|slack| map_floor(t, slack, PAGE)),
            anomalies: t.anomalies.clone(),
            before_history: t.before_history,
            recorded_ooms: t.recorded_ooms,
            position: t.position,
            lines: named_lines(t, &runs),
            runs,
        }
    }

    /// Trace lines (every action, as the header line counts them) per second of `run`'s
    /// replay: its replay time spread over the whole trace, the measure of the replayer's
    /// speed target ("events per second"). `None` for a replay that failed or replayed nothing.
    pub fn lines_per_second(&self, run: &Run) -> Option<f64> {
        let r = &run.result;
        let ns = r.ns_per_event * r.events as f64;
        (r.failure.is_none() && r.events > 0 && ns > 0.0).then(|| self.events as f64 / ns * 1e9)
    }

    /// The line (or trace entry) operation `op` comes from, in words: `line 312`; `None` for an
    /// allocation put before the history.
    pub fn place_of(&self, op: usize) -> Option<String> {
        let line = self.line_of(op)?;
        Some(format!("{} {line}", self.position.noun()))
    }

    /// The line (or trace entry) operation `op` comes from, as a number.
    pub fn line_of(&self, op: usize) -> Option<u64> {
        self.lines.get(&op).copied()
    }
}

/// The lines of the operations the reports of `runs` name: a failure's (not one that failed
/// before any operation, as a missing GPU does), the reserved peak's and its pinning units'.
fn named_lines(t: &Trace, runs: &[Run]) -> BTreeMap<usize, u64> {
    let mut ops = Vec::new();
    for r in runs.iter().map(|r| &r.result) {
        ops.extend(
            r.failure
                .as_ref()
                .map(|f| f.op)
                .filter(|&op| op < r.events as usize),
        );
        ops.extend(r.peak_excess.map(|(op, _)| op));
        let pinning = r.peak_pinning.iter().flat_map(|p| p.most.iter());
        ops.extend(pinning.filter_map(|(_, op)| *op));
    }
    ops.into_iter()
        .filter_map(|op| Some((op, t.line_of(op)?)))
        .collect()
}
