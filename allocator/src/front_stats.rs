//! [`crate::CachingAllocator`]'s views of itself: statistics, snapshot, the breakdown of reserved
//! bytes and the invariant scan, made from its stream shards, its tags' pools and its thread
//! caches. Statistics are the shards' [`Stats`] summed (the exact reserved peak from [`crate::stats::SharedPeak`],
//! the other peaks sums of the shards', an upper bound), then the blocks held in thread caches
//! taken out of the callers' allocations.
//!
//! Invariant: each counted quantity keeps `current == allocated - freed` after both steps.

use crate::allocator::CachingAllocator;
use crate::error::{Invariant, InvariantError};
use crate::ladder::Pool;
use crate::live::CacheTotals;
use crate::sizes::PoolKind;
use crate::snapshot::{Excess, PinnedUnit, SegmentInfo, Snapshot};
use crate::stats::{Stats, ThreadCacheStats};
use crate::sync::{Arc, MutexGuard, Ordering};
use crate::tags::TagSet;
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

/// The pools' statistics, summed over the shards and the tags' pools, with the exact peak of
/// their reserved bytes together (`reserved_peak`) for `reserved_bytes.all.peak`; the other
/// peaks are sums of the pools' peaks, an upper bound.
pub(crate) fn sum_stats<'a, D: Device + 'a>(
    mut pools: impl Iterator<Item = &'a Pool<Arc<D>>>,
    reserved_peak: u64,
) -> Stats {
    let mut total = pools.next().expect("a shard").stats().clone();
    for p in pools {
        total.add(p.stats());
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

/// The shards' pools (`guards`, locked) and then the tags' (`tags`, locked).
fn every_pool<'a, D: Device>(
    guards: &'a [MutexGuard<'_, Pool<Arc<D>>>],
    tags: &'a TagSet<D>,
) -> impl Iterator<Item = &'a Pool<Arc<D>>> {
    let shards = guards.iter().map(|g| &**g);
    shards.chain(tags.pools.iter().map(|t| &t.pool))
}

impl<D: Device> CachingAllocator<D> {
    /// The statistics, summed over stream shards, as the callers see them: a block held in a
    /// thread cache is not allocated, a cache hit is an allocation and a free into a cache is a
    /// free (as PyTorch counts every `malloc` and `free`), and [`Stats::thread_cache`] says how
    /// many hits there were and what the caches hold. Peaks are the pools' (a cached block
    /// counts in them until it leaves the caches).
    ///
    /// Every shard stays locked until the cached blocks are counted, so no block moves between a
    /// pool and a thread cache through a pool meanwhile. A thread cache hit or a free into a
    /// cache takes no shard lock, so while other threads allocate the counts may still be off by
    /// one block per such thread at that instant.
    pub fn stats(&self) -> Stats {
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let tags = self.tags.lock();
        let pools = every_pool(&guards, &tags);
        let mut total = sum_stats(pools, self.reserved_peak.peak());
        if self.caches.is_some() {
            count_thread_caches(&mut total, &self.live.cache_totals());
        }
        total
    }

    /// Resets peak statistics. Every shard stays locked until the shared reserved peak is set
    /// to the reserved bytes, so no growth runs meanwhile and the peak is never below them.
    pub fn reset_peak_stats(&self) {
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        for g in &mut guards {
            g.reset_peak_stats();
        }
        for t in self.tags.lock().pools.iter_mut() {
            t.pool.reset_peak_stats();
        }
        self.reserved_peak.reset();
        self.group.peak.reset();
    }

    /// Segments, blocks and statistics of every shard, as the callers see them: a block held
    /// in a thread cache is [`crate::snapshot::BlockState::ThreadCached`], not allocated, as
    /// in [`CachingAllocator::stats`]. Every shard stays locked while its blocks, the
    /// statistics and the cached blocks are read, so [`Snapshot::recompute`] equals
    /// [`Snapshot::recorded`] even while other threads allocate.
    pub fn snapshot(&self) -> Snapshot {
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let tags = self.tags.lock();
        let pools = || every_pool(&guards, &tags);
        let mut segments: Vec<SegmentInfo> =
            guards.iter().flat_map(|p| p.snapshot().segments).collect();
        for t in tags.pools.iter() {
            segments.extend(t.pool.snapshot().segments.into_iter().map(|s| SegmentInfo {
                tag: Some(t.name.clone()),
                ..s
            }));
        }
        let mut snap = Snapshot {
            segments,
            stats: sum_stats(pools(), self.reserved_peak.peak()),
        };
        snap.segments.sort_by_key(|s| s.addr);
        if self.caches.is_some() {
            let (cached, totals) = self.live.cached_with_totals();
            snap.mark_thread_cached(&cached);
            count_thread_caches(&mut snap.stats, &totals);
        }
        snap
    }

    /// Where the reserved bytes of every shard are now ([`Excess`]). Blocks held in thread
    /// caches count as live: the pools have handed them out.
    pub fn excess(&self) -> Excess {
        let mut total = Excess::default();
        for s in self.shards.iter() {
            total += s.lock().excess();
        }
        for t in self.tags.lock().pools.iter() {
            total += t.pool.excess();
        }
        total
    }

    /// The chunks and segments of every shard that pin free bytes, the most pinned first
    /// ([`Core::pinning`](crate::pool::Core::pinning)): what to look at when [`CachingAllocator::excess`] shows many pinned
    /// bytes.
    pub fn pinning(&self) -> Vec<PinnedUnit> {
        let mut units: Vec<PinnedUnit> = self
            .shards
            .iter()
            .flat_map(|s| s.lock().pinning())
            .collect();
        units.extend(self.tags.lock().pools.iter().flat_map(|t| t.pool.pinning()));
        PinnedUnit::sort_most_pinned(&mut units);
        units
    }

    /// Runs the full invariant scan of every shard and tag, and checks the live table against
    /// them. Holds every shard's lock (in shard order), then the tags', so that the counts agree with each other even
    /// while other threads allocate.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let tags = self.tags.lock();
        let pools = every_pool(&guards, &tags);
        let mut reserved = 0;
        let mut allocations = 0;
        for pool in pools {
            pool.check_invariants()?;
            allocations += pool.stats().allocation.0[0].current as usize;
            // The shared counter holds pages a failed release left too (`Core::strays`).
            reserved += pool.reserved() + pool.strays;
        }
        self.live.check_invariants()?;
        // Allocations freed while their tag slept are no longer in the live table; their
        // blocks are freed at the wake.
        let live = self.live.len() + tags.pools.iter().map(|t| t.deferred.len()).sum::<usize>();
        if allocations != live {
            return Err(InvariantError::new(
                Invariant::LiveTable,
                format!("{live} pointers in the live table but {allocations} allocations"),
            ));
        }
        let shared = self.reserved.load(Ordering::Acquire);
        if shared != reserved {
            return Err(InvariantError::new(
                Invariant::SharedReserved,
                format!("shared reserved counter {shared} != sum of shards {reserved}"),
            ));
        }
        Ok(())
    }
}
