//! What `cudalloc replay` measured: a [`Report`] per trace, holding a [`Run`] per
//! configuration. The table, JSON, summary and plot writers read these; `replay_cmd` fills them.

use cudalloc_trace::replay::ReplayResult;
use cudalloc_trace::{Anomalies, Position};
use std::collections::BTreeMap;

/// One replay of a trace under one configuration.
pub struct Run {
    /// The configuration's label.
    pub label: String,
    /// What the replay measured.
    pub result: ReplayResult,
    /// The smallest cap the replay completes under, when asked for and found.
    pub min_capacity: Option<u64>,
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
