//! How [`crate::CachingAllocator`]'s statistics are made from its stream shards' and its thread
//! caches': the shards' [`Stats`] summed (the exact reserved peak from [`crate::stats::SharedPeak`],
//! the other peaks sums of the shards', an upper bound), then the blocks held in thread caches
//! taken out of the callers' allocations.
//!
//! Invariant: each counted quantity keeps `current == allocated - freed` after both steps.

use crate::ladder::Pool;
use crate::live::CacheTotals;
use crate::sizes::PoolKind;
use crate::stats::{Stats, ThreadCacheStats};
use crate::sync::{Arc, MutexGuard};
use cudalloc_sys::Device;

/// Turns the pools' statistics into the callers': a block in a thread cache is not allocated
/// (`current` less what is cached), and each cache hit is an allocation and, earlier, a free
/// that the pools never saw. With `hits` served and `cached` held now, the callers' frees are
/// the pools' frees plus `hits + cached` (each block freed into a cache was claimed, is still
/// cached, or went back to its pool, whose free counted it), so `current == allocated - freed`
/// still holds. Peaks stay the pools' (a block counts until it leaves the caches).
pub(crate) fn count_thread_caches(t: &mut Stats, c: &CacheTotals) {
    for (i, pool) in [PoolKind::Small, PoolKind::Large].into_iter().enumerate() {
        let (cached, hits) = (&c.cached, &c.hits);
        for (a, now, served) in [
            (&mut t.allocation, cached.blocks[i], hits.blocks[i]),
            (&mut t.active, cached.blocks[i], hits.blocks[i]),
            (&mut t.allocated_bytes, cached.bytes[i], hits.bytes[i]),
            (&mut t.active_bytes, cached.bytes[i], hits.bytes[i]),
            (
                &mut t.requested_bytes,
                cached.requested[i],
                hits.requested[i],
            ),
        ] {
            for k in [0, if pool == PoolKind::Small { 1 } else { 2 }] {
                let s = &mut a.0[k];
                s.current -= now as i64;
                s.allocated += served as i64;
                s.freed += (served + now) as i64;
            }
        }
    }
    let sum = |v: [u64; 2]| v[0] + v[1];
    t.thread_cache = ThreadCacheStats {
        hits: sum(c.hits.blocks),
        blocks: sum(c.cached.blocks),
        bytes: sum(c.cached.bytes),
    };
}

/// The pools' statistics, summed over the shards, with the exact peak of their reserved bytes
/// together (`reserved_peak`) for `reserved_bytes.all.peak`; the other peaks are sums of the
/// shards' peaks, an upper bound.
pub(crate) fn sum_stats<D: Device>(
    pools: &[MutexGuard<'_, Pool<Arc<D>>>],
    reserved_peak: u64,
) -> Stats {
    let mut total = pools[0].stats().clone();
    for g in &pools[1..] {
        total.add(g.stats());
    }
    // Each pool's peak is at most the peak of all of them together (PyTorch's `all` is never
    // below a pool's), and still bounds the pool's own.
    let all = reserved_peak as i64;
    for s in &mut total.reserved_bytes.0 {
        s.peak = s.peak.min(all);
    }
    total.reserved_bytes.0[0].peak = all;
    total
}
