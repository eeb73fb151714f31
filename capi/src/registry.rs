//! One [`CachingAllocator`] per CUDA device, made on first use.
//!
//! The first call of any device reads `CUDALLOC_CONF` (once per process) and asks the driver
//! for the device count (once per process); the first call for device `d` that needs its
//! allocator opens it ([`CudaDevice::new`]) and builds the allocator. Each of these outcomes,
//! success or failure, is kept for the life of the process: a bad config, a missing driver or a
//! device that cannot be opened makes every later call for it fail with the same message.
//! Calls about a pointer ([`device_if_made`]) read the config but neither ask the driver nor
//! make an allocator: a device without one holds no allocation.

use crate::accumulated::AccumulatedBase;
use crate::pools::Pools;
use cudalloc_core::{AllocError, CachingAllocator, Config, Policy};
use cudalloc_sys::wrap::RecordAnswers;
use cudalloc_sys::{CudaDevice, DeviceError};
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The device under each allocator: the driver's, keeping its answers to event queries while a
/// trace is written (`crate::trace`).
pub(crate) type Gpu = RecordAnswers<CudaDevice>;

/// A device's allocator and what the C ABI counts about it.
pub(crate) struct Dev {
    /// The allocator.
    pub alloc: CachingAllocator<Gpu>,
    /// The policy it was configured with.
    pub policy: Policy,
    /// Ordinal.
    pub ordinal: usize,
    /// Its private pools (graph pools, `MemPool`s).
    pub pools: Pools<Gpu>,
    /// `cudalloc_free` calls that failed (they return nothing, so they are counted here).
    free_errors: AtomicU64,
    /// The zero of `cudalloc_device_stats`' accumulated values since
    /// `cudalloc_reset_accumulated_stats`.
    accumulated: AccumulatedBase,
    /// Held while the peer list is read and set (`Dev::add_peer`), so that no peer is lost.
    peers_lock: parking_lot::Mutex<()>,
}

impl Dev {
    /// Counts a failed `cudalloc_free`.
    pub fn count_free_error(&self) {
        self.free_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Failed `cudalloc_free` calls so far.
    pub fn free_errors(&self) -> u64 {
        self.free_errors.load(Ordering::Relaxed)
    }

    /// `cudalloc_device_stats`' values: the allocator's and its private pools' (dropped ones
    /// included), the reserved peak the exact one of them together, the accumulated values
    /// counted from the last [`Dev::reset_accumulated_stats`].
    pub fn torch_values(&self) -> Vec<i64> {
        self.accumulated.rebased(|| self.raw_torch_values())
    }

    /// PyTorch's `reset_accumulated_memory_stats`: [`Dev::torch_values`]' accumulated entries
    /// count from zero again.
    pub fn reset_accumulated_stats(&self) {
        self.accumulated.reset(|| self.raw_torch_values());
    }

    fn raw_torch_values(&self) -> Vec<i64> {
        let mut values = crate::json::torch_values(&self.alloc);
        self.pools.add_torch_values(&mut values);
        // The sum of the pools' peaks only bounds the device's: the group's is exact.
        values[crate::json::reserved_peak_index()] = self.alloc.group_reserved_peak() as i64;
        values
    }

    /// The caller began a CUDA graph capture on this device: until it ends, neither the
    /// device's allocator nor a private pool makes a device call the capture forbids.
    pub fn begin_capture(&self) {
        self.pools.begin_capture(&self.alloc);
    }

    /// The capture begun with [`Dev::begin_capture`] ended; every allocator ends it, even after
    /// one fails, and the first error is returned.
    pub fn end_capture(&self) -> Result<(), AllocError> {
        self.pools.end_capture(&self.alloc)
    }

    /// Makes every page of this device's allocator and of its private pools accessible from
    /// device `peer` too (PyTorch's `enablePeerAccess(peer, this device)`): those mapped
    /// already and those mapped from now on. Every allocator is tried even after one fails to
    /// grant (that one keeps its peers, so the same call again grants it); the first error is
    /// returned.
    pub fn add_peer(&self, peer: usize) -> Result<(), AllocError> {
        let _one_at_a_time = self.peers_lock.lock();
        let mut peers = self.alloc.peer_access();
        if !peers.contains(&peer) {
            peers.push(peer);
        }
        let r = self.alloc.set_peer_access(&peers);
        r.and(self.pools.set_peer_access(&peers))
    }

    /// A new allocator for a private pool of this device: a graph pool of the device's
    /// allocator, under its memory limit (`CachingAllocator::graph_pool`).
    pub fn open_pool(&self) -> Result<CachingAllocator<Gpu>, String> {
        Ok(self.alloc.graph_pool())
    }
}

type Slot = OnceLock<Result<Dev, String>>;

/// The configuration from `CUDALLOC_CONF`.
static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();

/// One slot per device the driver reports.
static SLOTS: OnceLock<Result<Vec<Slot>, String>> = OnceLock::new();

/// The configuration from `CUDALLOC_CONF`, read once.
fn config() -> Result<&'static Config, String> {
    CONFIG
        .get_or_init(|| Config::from_env().map_err(|e| format!("bad CUDALLOC_CONF: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// One slot per device the driver reports, made once.
fn slots() -> Result<&'static [Slot], String> {
    SLOTS
        .get_or_init(|| match CudaDevice::device_count() {
            Ok(0) => Err("no CUDA device: the driver reports 0 devices".to_string()),
            Ok(n) => Ok((0..n).map(|_| OnceLock::new()).collect()),
            // "no CUDA device available: <why>"
            Err(e @ DeviceError::Unavailable(_)) => Err(e.to_string()),
            Err(e) => Err(format!("no CUDA device: {e}")),
        })
        .as_ref()
        .map(Vec::as_slice)
        .map_err(Clone::clone)
}

/// Reads the configuration and counts the devices (each once per process); the device count.
pub(crate) fn check() -> Result<usize, String> {
    config()?;
    Ok(slots()?.len())
}

/// The slot of device `device`, after the checks every call makes.
fn slot(device: c_int) -> Result<(&'static Slot, &'static Config, usize), String> {
    let cfg = config()?;
    let slots = slots()?;
    let ordinal = usize::try_from(device)
        .ok()
        .filter(|&d| d < slots.len())
        .ok_or_else(|| {
            format!(
                "no CUDA device {device}: the driver reports {} device(s)",
                slots.len()
            )
        })?;
    Ok((&slots[ordinal], cfg, ordinal))
}

/// The memory fraction an allocator of `device` starts with: the configuration's
/// `per_process_memory_fraction`, 1.0 without one. Errors as [`device_if_used`].
pub(crate) fn configured_fraction(device: c_int) -> Result<f64, String> {
    let (_, cfg, _) = slot(device)?;
    Ok(cfg.pool().memory_fraction.unwrap_or(1.0))
}

/// The allocator of device `device` if a call has made it; None if none has (a valid device
/// that was never used). Errors as [`device`].
pub(crate) fn device_if_used(device: c_int) -> Result<Option<&'static Dev>, String> {
    let (slot, _, _) = slot(device)?;
    match slot.get() {
        None => Ok(None),
        Some(made) => made.as_ref().map(Some).map_err(Clone::clone),
    }
}

/// The allocator of device `device` if a call has made it, without asking the driver: None if
/// none has (no device has been used yet, or not this one; always without a driver). Errors:
/// a bad config, a negative ordinal; once the devices are counted, those of [`device_if_used`].
pub(crate) fn device_if_made(device: c_int) -> Result<Option<&'static Dev>, String> {
    config()?;
    if device < 0 {
        return Err(format!(
            "no CUDA device {device}: a device ordinal is never negative"
        ));
    }
    match SLOTS.get() {
        Some(Ok(_)) => device_if_used(device),
        _ => Ok(None),
    }
}

/// The allocator of device `device`, made on first use.
pub(crate) fn device(device: c_int) -> Result<&'static Dev, String> {
    let (slot, cfg, ordinal) = slot(device)?;
    slot.get_or_init(|| {
        let dev = CudaDevice::new(ordinal)
            .map_err(|e| format!("cannot open CUDA device {ordinal}: {e}"))?;
        // `try_new` refuses here a key the device cannot honour (`shareable_segments`).
        let alloc = CachingAllocator::try_new(RecordAnswers::new(dev), cfg.clone())
            .map_err(|e| format!("bad CUDALLOC_CONF for CUDA device {ordinal}: {e}"))?;
        Ok(Dev {
            alloc,
            policy: cfg.policy(),
            ordinal,
            pools: Pools::default(),
            free_errors: AtomicU64::new(0),
            accumulated: AccumulatedBase::default(),
            peers_lock: parking_lot::Mutex::new(()),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// How many device slots there are (0 before the devices are counted, or if counting failed):
/// the ordinals [`existing`] can be asked about.
pub(crate) fn made_count() -> usize {
    SLOTS
        .get()
        .and_then(|s| s.as_ref().ok())
        .map_or(0, Vec::len)
}

/// The allocator of device `ordinal` if it has been made already; makes nothing and does not
/// call the driver.
pub(crate) fn existing(ordinal: usize) -> Option<&'static Dev> {
    let slots = SLOTS.get()?.as_ref().ok()?;
    slots.get(ordinal)?.get()?.as_ref().ok()
}
