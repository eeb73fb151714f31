//! The settings of a [`CachingAllocator`] that every stream shard and tag pool holds alike:
//! captures underway, the memory limit and the peer devices.
//!
//! Invariant: each setting goes to every shard, then to every tag pool (`tags`), so that a
//! pool made later starts with the allocator's (the tags keep the settings for theirs).

use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use cudalloc_sys::{CaptureMode, Device};

impl<D: Device> CachingAllocator<D> {
    /// The caller begins a CUDA graph capture in `mode`: until it ends, no shard makes a
    /// device call the capture forbids (`pool::capture`). Call it before the capture begins
    /// (before `cuStreamBeginCapture`), so that no call of another thread lands inside it.
    pub fn begin_capture(&self, mode: CaptureMode) {
        for s in self.shards.iter() {
            s.lock().begin_capture(mode);
        }
        let _ = self.tags_capture(mode, true);
    }

    /// The caller ended a capture begun with [`CachingAllocator::begin_capture`] (call it after
    /// `cuStreamEndCapture`); blocks freed during the capture that other streams used start
    /// waiting for those streams' work now. Every shard ends it, even after one fails; the
    /// first error is returned.
    pub fn end_capture(&self, mode: CaptureMode) -> Result<(), AllocError> {
        let mut first = Ok(());
        for s in self.shards.iter() {
            let r = s.lock().end_capture(mode);
            if first.is_ok() {
                first = r;
            }
        }
        let r = self.tags_capture(mode, false);
        first.and(r)
    }

    /// Caps the allocator at `fraction` of the device's memory; 1.0 removes the cap
    /// ([`crate::Pool::set_memory_fraction`]).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        self.set_memory_limit(crate::pool::fraction_limit(&*self.device, fraction)?);
        Ok(())
    }

    /// The fraction of the device's memory the allocator is capped at: its limit over the
    /// device's total memory, 1.0 without a limit (PyTorch's
    /// `get_per_process_memory_fraction`). An error only if the device's memory cannot be read.
    pub fn memory_fraction(&self) -> Result<f64, AllocError> {
        let Some(limit) = self.memory_limit() else {
            return Ok(1.0);
        };
        let (_, total) = self.device.mem_info()?;
        Ok((limit as f64 / total.max(1) as f64).min(1.0))
    }

    /// The memory limit: the most bytes this allocator and its graph pools may hold together
    /// (`None`: no cap).
    pub fn memory_limit(&self) -> Option<u64> {
        self.shards[0].lock().core.limit
    }

    /// Caps the allocator at `bytes` (`None`: no cap): this allocator and its graph pools
    /// together, as PyTorch's `set_per_process_memory_fraction` caps its private pools too.
    /// Graph pools made before keep the limit they had; set theirs too.
    pub fn set_memory_limit(&self, bytes: Option<u64>) {
        for s in self.shards.iter() {
            s.lock().set_limit(bytes);
        }
        // A limit grants nothing, so it cannot fail.
        let _ = self.tags_settings(Some(bytes), None);
    }

    /// Makes every page of this allocator accessible from the peer devices `peers` too
    /// (expandable policies): the pages mapped from now on, and those mapped already when the
    /// list adds a device (PyTorch's `enablePeerAccess`: a kernel on the peer reading a tensor
    /// of this device needs it). The peers' contexts must have peer access to this device
    /// enabled. Every shard and tag pool is tried even after one fails to grant (that one keeps
    /// its peers, so the same call again grants it); the first error is returned.
    pub fn set_peer_access(&self, peers: &[usize]) -> Result<(), AllocError> {
        let mut first = Ok(());
        for s in self.shards.iter() {
            let r = s.lock().set_peers(peers.to_vec());
            if first.is_ok() {
                first = r;
            }
        }
        first.and(self.tags_settings(None, Some(peers)))
    }

    /// The peer devices whose access every page has ([`CachingAllocator::set_peer_access`]).
    pub fn peer_access(&self) -> Vec<usize> {
        self.shards[0].lock().core.peers.clone()
    }
}
