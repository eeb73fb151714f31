//! What `cudalloc replay` and `cudalloc stats` say on stderr about the traces read, before any
//! replay: traces with nothing to replay, and traces of several streams replayed in one pool
//! (whose figures a program's stream shards may not reach). Notes only: none changes a figure
//! or the exit status.

use crate::error::say;
use cudalloc_trace::Trace;

/// Says on stderr which traces hold no allocation to replay (an empty file, a header alone).
pub fn warn_if_empty(traces: &[Trace]) {
    for t in traces.iter().filter(|t| t.ops.is_empty()) {
        say!(
            "warning: {} holds no allocation or free to replay ({} trace lines read)",
            t.name,
            t.events
        );
    }
}

/// Says on stderr which traces use several streams when they replay in one pool (`shards`
/// false): one pool's budget gives back the cache of any stream, where a program's allocator
/// holds a pool per shard of streams, each with a budget of its own, and may reserve more
/// (`--shards` replays those; `docs/threads.md`).
pub fn note_streams(traces: &[Trace], shards: bool) {
    if shards {
        return;
    }
    for t in traces.iter().filter(|t| t.streams.len() > 1) {
        say!(
            "note: {} uses {} streams; replayed in one pool, whose budget gives back any \
             stream's cache: a program's stream shards may reserve more (--shards replays them)",
            t.name,
            t.streams.len()
        );
    }
}
