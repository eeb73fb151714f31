//! What `cudalloc replay` says on stderr about the traces it read, before any replay: traces
//! with nothing to replay (`cudalloc stats` says this too), and traces of several streams that
//! a `default` replay models as one pool, where a program's stream shards may reserve more.
//! Notes only: none changes a figure or the exit status.

use crate::error::say;
use cudalloc::config::PolicyConfig;
use cudalloc::Config;
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

/// Says on stderr which traces use several streams, when `configs` run the `default` policy in
/// one pool and `--shards` could replay them instead (`shardable`: on the simulated device,
/// without `--shards`, `--answers` or `--min-capacity`). One pool's budget
/// gives back the cached blocks of any stream, where a program's allocator holds a pool per
/// shard of streams, each with a budget of its own, and may reserve more (`docs/threads.md`).
/// PyTorch's rules have no budget: their figures are the same either way.
pub fn note_streams<'a>(
    traces: &[Trace],
    mut configs: impl Iterator<Item = &'a Config>,
    shardable: bool,
) {
    let budget = configs.any(|c| matches!(c.policy_config(), PolicyConfig::Default(_)));
    if !shardable || !budget {
        return;
    }
    for t in traces.iter().filter(|t| t.streams.len() > 1) {
        say!(
            "note: {} uses {} streams; replayed in one pool, where the default policy's budget \
             gives back the cached blocks of any stream, but a program's allocator has a pool per \
             shard of streams, each with its own budget, and may reserve more (--shards replays \
             those)",
            t.name,
            t.streams.len()
        );
    }
}
