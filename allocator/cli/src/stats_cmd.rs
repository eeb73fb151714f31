//! `cudalloc stats`: replays one trace on the simulated device, driving the pool directly (so
//! that its statistics and a snapshot can be read at the end of the trace, before leftover
//! allocations are freed), and prints them as pretty JSON with sorted keys, with the trace's
//! odd events (`anomalies`) as `replay` reports them: the same JSON object, and a warning. A
//! trace with nothing to replay is warned of as `replay` warns of it.

use crate::args::StatsArgs;
use crate::error::{say, CliError};
use crate::table;
use cudalloc::{AllocError, Allocation, Pool};
use cudalloc_sys::{SimDevice, StreamId};
use cudalloc_trace::replay::simulated_device;
use cudalloc_trace::{Op, Trace};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

/// Said when `garbage_collection_threshold` needs a cap, which `stats` has no option for.
const STATS_CAP: &str =
    "`cudalloc stats` replays without one (compare under one with `cudalloc replay --capacity`)";

/// Runs the command; exit status 1 when an allocation failed.
pub fn run(args: &StatsArgs) -> Result<ExitCode, CliError> {
    let variant = args.variant();
    if let Some(note) = variant.note() {
        say!("{note}");
    }
    crate::replay_cmd::check_no_thread_cache_keys(&variant)?;
    crate::replay_cmd::check_garbage_collection(&variant, false, STATS_CAP)?;
    let mut read = crate::replay_cmd::read_all(std::slice::from_ref(&args.trace), args.device)?;
    crate::notes::warn_if_empty(&read);
    let t = read.pop().expect("one trace read");
    if let Some(a) = table::anomalies(&t.anomalies, t.position) {
        say!("warning: {}: anomalies: {a}", t.name);
    }
    let pool = Pool::new(simulated_device(&t), variant.cfg.clone());
    let (pool, failure) = drive(pool, &t);
    let mut doc = Map::new();
    doc.insert("trace".into(), json!(t.name));
    doc.insert("policy".into(), json!(variant.label));
    doc.insert(
        "events".into(),
        json!(failure.as_ref().map_or(t.ops.len(), |f| f.0 + 1)),
    );
    doc.insert("failure".into(), failure_json(&failure, &t));
    doc.insert("anomalies".into(), crate::json::anomalies(&t.anomalies));
    doc.insert("fragmentation_at_end".into(), fragmentation(&pool));
    doc.insert("memory_stats".into(), memory_stats(&pool));
    let text = serde_json::to_string_pretty(&Value::Object(doc))
        .map_err(|e| CliError::msg(e.to_string()))?;
    let mut out = std::io::stdout().lock();
    let written = writeln!(out, "{text}").and_then(|()| out.flush());
    let status = if failure.is_some() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    // A reader that stopped reading (a pipe closed) does not change whether the replay failed.
    match written.map_err(CliError::from) {
        Ok(()) | Err(CliError::BrokenPipe) => Ok(status),
        Err(e) => Err(e),
    }
}

type Failure = Option<(usize, AllocError)>;

/// Replays the operations (as `cudalloc_trace::replay::replay` does) and stops at the first
/// failure.
fn drive(mut pool: Pool<SimDevice>, t: &Trace) -> (Pool<SimDevice>, Failure) {
    let streams: Vec<StreamId> = t.streams.iter().map(|&s| StreamId(s)).collect();
    let mut slots: Vec<Option<Allocation>> = (0..t.slots).map(|_| None).collect();
    for (i, op) in t.ops.iter().enumerate() {
        let done = match *op {
            Op::Alloc { slot, stream, size } => pool
                .allocate(size, streams[stream as usize])
                .map(|a| slots[slot as usize] = Some(a)),
            Op::Free { slot } => match slots[slot as usize].take() {
                Some(a) => pool.free(a),
                None => Ok(()),
            },
        };
        if let Err(e) = done {
            return (pool, Some((i, e)));
        }
    }
    (pool, None)
}

fn failure_json(f: &Failure, t: &Trace) -> Value {
    match f {
        Some((op, e)) => json!({ "op": op, "line": t.line_of(*op), "error": e.to_string() }),
        None => Value::Null,
    }
}

fn fragmentation(pool: &Pool<SimDevice>) -> Value {
    let f = pool.snapshot().fragmentation();
    json!({
        "free_bytes": f.free_bytes,
        "largest_free_block": f.largest_free_block,
        "external_fragmentation": f.external_fragmentation,
        "utilisation": f.utilisation,
        "mapped_bytes": f.mapped_bytes,
        "virtual_bytes": f.virtual_bytes,
        "free_histogram": f.free_histogram.iter().map(|&(b, n, s)| json!([b, n, s])).collect::<Vec<_>>(),
    })
}

/// `torch.cuda.memory_stats()`'s keys with their values, sorted by key.
fn memory_stats(pool: &Pool<SimDevice>) -> Value {
    let sorted: BTreeMap<String, i64> = pool.stats().to_torch_dict().into_iter().collect();
    let map: Map<String, Value> = sorted.into_iter().map(|(k, v)| (k, json!(v))).collect();
    Value::Object(map)
}
