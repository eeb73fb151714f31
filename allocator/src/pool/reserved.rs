//! Counting the bytes the device holds for a pool: claims checked against the memory limit
//! (one atomic step when pools share a limit, as `CachingAllocator`'s shards do, and as an
//! allocator and its graph pools do through their group's counter), the
//! `reserved_bytes` statistic and the shared peak, pages whose release failed (*strays*), and
//! the limit a memory fraction sets.
//!
//! Invariants: `reserved` is what the pool claimed and holds mapped or allocated; `strays` the
//! pages unmapped whose release failed; `reserved_bytes.all.current` equals their sum, and so
//! does this pool's share of the shared counter and of the group's.

use super::Core;
use crate::error::AllocError;
use crate::sizes::PoolKind;
use crate::stats::SharedPeak;
use crate::sync::{Arc, AtomicBool, AtomicU64, Ordering};
use cudalloc_sys::Device;

impl<D: Device> Core<D> {
    /// Caps the pool at `fraction` of the device's total memory, as PyTorch's
    /// `set_per_process_memory_fraction` does; 1.0 removes the cap (since PyTorch 2.10 a
    /// fraction of 1 sets none, so garbage collection stays off and `default` keeps its uncapped
    /// rules; before, it capped at the whole device).
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        self.set_limit(fraction_limit(&self.device, fraction)?);
        Ok(())
    }

    /// Turns the config's memory fraction ([`crate::PoolConfig::memory_fraction`]) into the limit,
    /// once; on an error (the device could not say how much memory it has) it stays pending.
    pub fn apply_fraction(&mut self) -> Result<(), AllocError> {
        if let Some(f) = self.fraction {
            self.set_limit(fraction_limit(&self.device, f)?);
        }
        Ok(())
    }

    /// Counts `n` more bytes as held from the device, before asking the device for them. When
    /// pools share a limit (`CachingAllocator`'s shards), the check and the count are one
    /// atomic step, so concurrent pools cannot pass the limit together; false (and nothing
    /// counted) when `n` would pass it. A pool alone checks its limit against the request's
    /// size before this, as PyTorch does, and always gets true here: under expandable segments
    /// it can then map up to one page (20 MiB under `torch-expandable`) past its limit, where
    /// `CachingAllocator` refuses (docs/fidelity.md).
    pub(crate) fn claim(&mut self, n: u64) -> bool {
        if !self.claim_shared(n) {
            return false;
        }
        self.reserved += n;
        true
    }

    /// [`Core::claim`] in the shared counters: the first (the limit's) checked and counted in
    /// one atomic step, then the other.
    fn claim_shared(&self, n: u64) -> bool {
        let mut counters = self.counters();
        if let Some(first) = counters.next() {
            match self.limit {
                Some(l) => {
                    let fits = |t: u64| t.checked_add(n).filter(|&t| t <= l);
                    if first
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, fits)
                        .is_err()
                    {
                        return false;
                    }
                }
                None => {
                    first.fetch_add(n, Ordering::AcqRel);
                }
            }
            for c in counters {
                c.fetch_add(n, Ordering::AcqRel);
            }
        }
        true
    }

    /// The shared counters this pool's bytes count in, the one its limit applies to first (the
    /// group's, else its allocator's).
    fn counters(&self) -> impl DoubleEndedIterator<Item = &Arc<AtomicU64>> {
        self.group.iter().chain(self.shared.iter())
    }

    /// Counts `n` bytes the device now holds for `pool`, once the call that got them succeeded
    /// (a claim that the device then refused counts in no statistic, no peak included).
    pub(crate) fn reserved_grew(&mut self, pool: PoolKind, n: u64) {
        self.stats.reserved_bytes.increase(pool, n);
        for p in self.shared_peak.iter().chain(&self.group_peak) {
            p.grew(n);
        }
    }

    /// Counts `n` bytes of `pool` given back to the device.
    pub(crate) fn reserved_shrank(&mut self, pool: PoolKind, n: u64) {
        self.stats.reserved_bytes.decrease(pool, n);
        for p in self.shared_peak.iter().chain(&self.group_peak) {
            p.shrank(n);
        }
    }

    /// Gives back bytes counted by [`Core::claim`].
    pub(crate) fn sub_reserved(&mut self, n: u64) {
        self.reserved -= n;
        // The allocator's counter first, then the group's (a claim counts them the other way
        // round): the allocator's never shows more than the group's, whose total the limit caps.
        for c in self.counters().rev() {
            c.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Bytes held from the device by this pool and every pool sharing its limit.
    pub(crate) fn total_reserved(&self) -> u64 {
        self.counters()
            .next()
            .map_or(self.reserved + self.strays, |c| c.load(Ordering::Relaxed))
    }

    /// Counts against the limit, and in the reserved bytes' statistic (the device still holds
    /// them), the stray pages segment `seg` holds now, given what it held before a call
    /// (`before`, [`super::segment::ExpSegment::stray_bytes`]).
    pub(crate) fn track_strays(&mut self, seg: usize, before: u64) {
        let Some(s) = self.segments[seg].as_ref() else {
            return;
        };
        let (now, pool) = (s.stray_bytes(), s.pool);
        if now >= before {
            let n = now - before;
            self.strays += n;
            for c in self.counters() {
                c.fetch_add(n, Ordering::AcqRel);
            }
            self.reserved_grew(pool, n);
        } else {
            let n = before - now;
            self.strays -= n;
            for c in self.counters().rev() {
                c.fetch_sub(n, Ordering::AcqRel);
            }
            self.reserved_shrank(pool, n);
        }
    }

    /// Makes this pool count its reserved bytes into `counter`, which pools sharing one device
    /// and one memory limit have in common; the limit applies to the counter's total.
    pub fn share_reserved(&mut self, counter: Arc<AtomicU64>) {
        counter.fetch_add(self.reserved, Ordering::Relaxed);
        self.shared = Some(counter);
    }

    /// Makes this pool count its reserved bytes into `counter` and `peak` too, which an
    /// allocator and its graph pools have in common: the memory limit then applies to the
    /// counter's total, and `peak` has the most they held at once.
    pub(crate) fn share_group(&mut self, counter: Arc<AtomicU64>, peak: Arc<SharedPeak>) {
        counter.fetch_add(self.reserved + self.strays, Ordering::Relaxed);
        peak.grew(self.stats.reserved_bytes.0[0].current as u64);
        self.group = Some(counter);
        self.group_peak = Some(peak);
    }

    /// Makes this pool count the bytes it holds into `peak` too, which then has the highest
    /// total the pools sharing it held at once (the sum of their own peaks is only a bound).
    pub(crate) fn share_reserved_peak(&mut self, peak: Arc<SharedPeak>) {
        self.shared_peak = Some(peak);
    }

    /// Makes this pool's "nothing freed yet" ([`Core::nothing_freed`]) end when `flag`'s does:
    /// the pools and thread caches of one `CachingAllocator` share it, so that a free anywhere
    /// ends it for every shard.
    pub(crate) fn share_unfreed(&mut self, flag: Arc<AtomicBool>) {
        self.unfreed = flag;
    }

    /// True when `extra` more bytes would pass the limit.
    pub fn over_limit(&self, extra: u64) -> bool {
        self.limit
            .is_some_and(|l| self.total_reserved() + extra > l)
    }
}

/// The cap `fraction` of `device`'s total memory sets ([`Core::set_memory_fraction`]): `None`
/// for 1.0, as PyTorch since 2.10.
pub(crate) fn fraction_limit<D: Device>(
    device: &D,
    fraction: f64,
) -> Result<Option<u64>, AllocError> {
    if !(0.0..=1.0).contains(&fraction) || fraction.is_nan() {
        return Err(AllocError::BadFraction(fraction));
    }
    if fraction == 1.0 {
        return Ok(None);
    }
    let (_, total) = device.mem_info()?;
    Ok(Some((fraction * total as f64) as u64))
}
