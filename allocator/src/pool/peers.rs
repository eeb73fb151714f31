//! Peer access to a pool's pages: the devices that may read and write them besides the pool's
//! own (`Core::peers`; PyTorch's `enablePeerAccess`, which a copy kernel reading another
//! device's tensor needs: a mapped page is accessible only from the devices its access names).
//!
//! Invariant: every chunk mapped in the pool's ranges is accessible from every device of
//! `peers`. A chunk mapped later gets the access as it is mapped (`segment::attach_kept`, and a
//! wake's or a move's mapping through the same `Mapper`); the chunks mapped before a device
//! joined the list get it here.

use super::Core;
use crate::error::AllocError;
use cudalloc_sys::Device;

impl<D: Device> Core<D> {
    /// Sets the peer devices. When the list adds a device, every chunk mapped already is made
    /// accessible from it too; chunks mapped from now on are as they are mapped. On a failure
    /// the list stays what it was and the error is returned, so a later call with the same
    /// list grants every chunk again (a grant given twice is harmless) and a device that
    /// cannot be granted does not fail every later mapping.
    pub fn set_peers(&mut self, peers: Vec<usize>) -> Result<(), AllocError> {
        let added = peers.iter().any(|p| !self.peers.contains(p));
        if !added {
            self.peers = peers;
            return Ok(());
        }
        for seg in self.segments.iter().flatten() {
            for (&at, chunk) in &seg.chunks {
                self.device.set_access(at, chunk.size, &peers)?;
            }
        }
        self.peers = peers;
        Ok(())
    }
}
