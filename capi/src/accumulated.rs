//! PyTorch's `torch.cuda.reset_accumulated_memory_stats()` for `cudalloc_device_stats`: the
//! accumulated entries (every stat's `allocated` and `freed`, and the counters `num_alloc_retries`,
//! `num_ooms`, `num_sync_all_streams`, `num_device_alloc`, `num_device_free`) count from zero
//! again, as PyTorch's allocator resets them; `current` and `peak` values are untouched.
//!
//! The allocator's own statistics keep `current == allocated - freed` (`cudalloc_core::stats`),
//! so the reset is a view: [`AccumulatedBase`] keeps the accumulated values at the last reset
//! and [`AccumulatedBase::rebased`] takes them off what is read later. Invariant: the base holds
//! zeros everywhere but at the accumulated entries, and each read runs under the base's lock,
//! after the reset that set it, so (the raw values never going backwards) a rebased value is
//! never negative.

use crate::json::TORCH_VALUES;
use parking_lot::Mutex;
use std::sync::OnceLock;

/// The accumulated values of `cudalloc_device_stats` at the last reset (zeros before any).
#[derive(Debug)]
pub(crate) struct AccumulatedBase(Mutex<Vec<i64>>);

impl Default for AccumulatedBase {
    fn default() -> Self {
        Self(Mutex::new(vec![0; TORCH_VALUES]))
    }
}

impl AccumulatedBase {
    /// Takes the accumulated entries of the values `read` returns now as the new zero. `read`
    /// runs under the base's lock, so no [`AccumulatedBase::rebased`] read overlaps it.
    pub fn reset(&self, read: impl FnOnce() -> Vec<i64>) {
        let mask = accumulated_mask();
        let mut base = self.0.lock();
        let raw = read();
        for ((b, &v), &m) in base.iter_mut().zip(&raw).zip(mask) {
            *b = if m { v } else { 0 };
        }
    }

    /// The values `read` returns, counted from the last reset. `read` runs under the base's
    /// lock, so a reset on another thread comes wholly before or after it: a value read before
    /// a reset is never rebased by it (which would make it negative).
    pub fn rebased(&self, read: impl FnOnce() -> Vec<i64>) -> Vec<i64> {
        let base = self.0.lock();
        let mut values = read();
        for (v, b) in values.iter_mut().zip(base.iter()) {
            *v -= b;
        }
        values
    }
}

/// Which of the values, in `Stats::to_torch_dict`'s order, PyTorch's reset of accumulated
/// statistics sets to zero.
fn accumulated_mask() -> &'static [bool] {
    static MASK: OnceLock<Vec<bool>> = OnceLock::new();
    MASK.get_or_init(|| {
        const COUNTERS: [&str; 5] = [
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
        ];
        cudalloc_core::Stats::default()
            .to_torch_dict()
            .iter()
            .map(|(k, _)| {
                k.ends_with(".allocated") || k.ends_with(".freed") || COUNTERS.contains(&k.as_str())
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::torch_values;
    use cudalloc_core::{CachingAllocator, Config};
    use cudalloc_sys::{SimConfig, SimDevice, StreamId};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn value(values: &[i64], key: &str) -> i64 {
        let keys = cudalloc_core::Stats::default().to_torch_dict();
        let i = keys.iter().position(|(k, _)| k == key).expect(key);
        values[i]
    }

    /// After a reset the accumulated entries count from zero, the current and peak ones are
    /// what the allocator holds, and allocations after the reset count again.
    #[test]
    fn a_reset_counts_accumulated_values_from_zero_and_keeps_current_ones() {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        let alloc = CachingAllocator::new(sim, Config::parse("policy:default").unwrap());
        let kept = alloc.allocate(8 * MIB, StreamId(0)).unwrap();
        let gone = alloc.allocate(4 * MIB, StreamId(0)).unwrap();
        alloc.free(gone).unwrap();
        let base = AccumulatedBase::default();
        let before = torch_values(&alloc);
        base.reset(|| torch_values(&alloc));
        let now = base.rebased(|| torch_values(&alloc));
        for key in [
            "allocation.all.allocated",
            "allocation.all.freed",
            "num_device_alloc",
        ] {
            assert_eq!(value(&now, key), 0, "{key} after the reset");
        }
        for key in [
            "allocation.all.current",
            "allocated_bytes.all.peak",
            "max_split_size",
        ] {
            assert_eq!(
                value(&now, key),
                value(&before, key),
                "{key} is not accumulated"
            );
        }
        assert!(value(&before, "allocation.all.allocated") >= 2);
        let again = alloc.allocate(2 * MIB, StreamId(0)).unwrap();
        let later = base.rebased(|| torch_values(&alloc));
        assert_eq!(value(&later, "allocation.all.allocated"), 1);
        assert_eq!(
            value(&later, "allocated_bytes.all.allocated"),
            (2 * MIB) as i64
        );
        assert_eq!(value(&later, "allocation.all.current"), 2);
        alloc.free(again).unwrap();
        alloc.free(kept).unwrap();
    }

    /// A reader of the statistics on one thread while another allocates and resets: no
    /// accumulated value is ever negative.
    #[test]
    fn reads_racing_resets_are_never_negative() {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        let alloc = CachingAllocator::new(sim, Config::parse("policy:default").unwrap());
        let base = AccumulatedBase::default();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let keys = cudalloc_core::Stats::default().to_torch_dict();
        std::thread::scope(|t| {
            let reader = t.spawn(|| {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || reads == 0 {
                    let v = base.rebased(|| torch_values(&alloc));
                    let negative: Vec<_> = keys
                        .iter()
                        .zip(&v)
                        .filter(|((k, _), &x)| x < 0 && k != "max_split_size")
                        .collect();
                    assert!(negative.is_empty(), "{negative:?}");
                    reads += 1;
                }
            });
            for _ in 0..2_000 {
                let a = alloc.allocate(4 * MIB, StreamId(0)).unwrap();
                base.reset(|| torch_values(&alloc));
                alloc.free(a).unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            reader.join().unwrap();
        });
    }
}
