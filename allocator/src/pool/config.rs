//! [`PoolConfig`]: the settings every policy shares, PyTorch's keys for rounding, splitting,
//! garbage collection and the memory cap.
//!
//! Invariant: a `PoolConfig` that a [`Config`](crate::Config) holds passed
//! [`PoolConfig::validate`] (every way of building a `Config` checks it), so the core never
//! meets a value a parsed config string could not give, except `whole_growths`, which no key
//! sets (graph pools' configurations do, and a `Config` of a policy other than
//! `torch-expandable` refuses it).

use crate::error::ConfigError;
use crate::sizes::{self, LARGE_BUFFER};

/// Number of power-of-two size intervals of `roundup_power2_divisions` (1 MiB .. 64 GiB).
pub const DIVISION_INTERVALS: usize = 16;

/// The settings every policy shares (the config string's PyTorch keys).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    /// Blocks of at least this size are never split (`u64::MAX`: no limit; otherwise at least
    /// 20 MiB). Key `max_split_size_mb`.
    pub max_split_size: u64,
    /// An oversize cached block may exceed the request by less than this (at least 20 MiB).
    /// Key `max_non_split_rounding_mb`.
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval, indexed from 1 MiB up (0 or 1: plain 512 B
    /// rounding; otherwise a power of two). Key `roundup_power2_divisions`.
    pub roundup_power2_divisions: [u64; DIVISION_INTERVALS],
    /// Fraction of the memory limit above which old cached segments are freed (0: off;
    /// otherwise in (0, 1)). Key `garbage_collection_threshold`.
    pub garbage_collection_threshold: f64,
    /// Cap on the memory held from each device, as a fraction of it in [0, 1] (PyTorch's
    /// `per_process_memory_fraction` key; `None`: no cap). A pool applies it when it is made,
    /// as [`crate::Pool::set_memory_fraction`] would.
    pub memory_fraction: Option<f64>,
    /// Create the pages of expandable segments exportable as POSIX file descriptors, so that
    /// [`crate::CachingAllocator::share`] can hand an allocation to another process (costs a
    /// little at each page creation; the `torch` policy, whose segments are `cuMemAlloc`'d,
    /// refuses it). Key `shareable_segments`.
    pub shareable_segments: bool,
    /// Map each growth of an expandable segment as one chunk, instead of PyTorch's pages of
    /// 2 MiB (small pool) and 20 MiB (large pool) one driver call each (`torch-expandable`'s
    /// rules only). No key: a graph pool made from a `default` allocator sets it
    /// ([`crate::Config::for_graph_pool`]), since it gives nothing back while it lives and so
    /// gains nothing from pages it could unmap one at a time. A [`crate::Config`] of another
    /// policy refuses it.
    pub whole_growths: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; DIVISION_INTERVALS],
            garbage_collection_threshold: 0.0,
            memory_fraction: None,
            shareable_segments: false,
            whole_growths: false,
        }
    }
}

impl PoolConfig {
    /// Checks every value against what its key accepts; the error names the key and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let min_mb = LARGE_BUFFER >> 20;
        let below_min = |key: &str, bytes: u64| {
            ConfigError::new(
                key,
                format!("{bytes} bytes is below the minimum of {min_mb} MB"),
            )
        };
        if self.max_split_size < LARGE_BUFFER {
            return Err(below_min("max_split_size_mb", self.max_split_size));
        }
        if self.max_non_split_rounding < LARGE_BUFFER {
            return Err(below_min(
                "max_non_split_rounding_mb",
                self.max_non_split_rounding,
            ));
        }
        if let Some(&v) = self
            .roundup_power2_divisions
            .iter()
            .find(|&&v| v != 0 && !v.is_power_of_two())
        {
            return Err(ConfigError::new(
                "roundup_power2_divisions",
                format!("{v} divisions is not a power of two"),
            ));
        }
        let gc = self.garbage_collection_threshold;
        if !(gc == 0.0 || (gc > 0.0 && gc < 1.0)) {
            return Err(ConfigError::new(
                "garbage_collection_threshold",
                format!("{gc} is not in (0, 1) (0 turns it off)"),
            ));
        }
        match self.memory_fraction {
            Some(f) if !(0.0..=1.0).contains(&f) => Err(ConfigError::new(
                "per_process_memory_fraction",
                format!("{f} is not in [0, 1]"),
            )),
            _ => Ok(()),
        }
    }

    /// Divisions that apply to a request of `size` bytes.
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let index = log.saturating_sub(20).min(DIVISION_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }

    /// A request of `size` bytes rounded under these settings ([`sizes::round_size`]).
    pub fn round_size(&self, size: u64) -> u64 {
        sizes::round_size(size, self.divisions_for(size))
    }
}
