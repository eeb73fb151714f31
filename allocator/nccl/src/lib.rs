//! # cudalloc-nccl: cudalloc's memory registered with NCCL
//!
//! NCCL moves data faster from buffers registered with a communicator (`ncclCommRegister`:
//! zero-copy paths, fewer internal copies), and registering is slow, so an engine registers its
//! memory once and keeps it registered. cudalloc's map hooks ([`cudalloc::hooks`]) say when a
//! range of device memory becomes usable and before it goes away; [`NcclRegistration`] is a
//! [`MapHooks`] that registers each such range with every communicator of its device and
//! deregisters it before its unmap:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use cudalloc::{CachingAllocator, Config};
//! # use cudalloc_sys::{nccl::Communicator, CudaDevice};
//! # use cudalloc_nccl::NcclRegistration;
//! let comms: Vec<Arc<Communicator>> =
//!     Communicator::init_all(&[0])?.into_iter().map(Arc::new).collect();
//! let alloc = CachingAllocator::new(CudaDevice::new(0)?, Config::default());
//! let registration = Arc::new(NcclRegistration::new(comms));
//! alloc.set_map_hooks(Some(registration.clone()));
//! // ... every page the allocator maps is registered before a buffer in it is handed out ...
//! assert!(registration.errors().is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A registration that fails does not stop the allocator (a hook cannot fail): the error is
//! kept ([`NcclRegistration::errors`]) and the range is simply not registered, so the
//! collectives on it take NCCL's unregistered path. Invariant: the registrations held are
//! exactly those of the ranges announced and not withdrawn, one per communicator of the range's
//! device; dropping the helper deregisters what it still holds.

use cudalloc::MapHooks;
use cudalloc_sys::nccl::{Communicator, NcclError, Registration};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// One announced range: its bytes, and one registration per communicator of its device (by
/// the communicator's index).
type Held = (u64, Vec<(usize, Registration)>);

/// Registers every range its allocator maps with the communicators of the range's device (see
/// the crate documentation).
#[derive(Debug)]
pub struct NcclRegistration {
    comms: Vec<Arc<Communicator>>,
    /// (device, address) -> what is registered there.
    held: Mutex<HashMap<(usize, u64), Held>>,
    errors: Mutex<Vec<NcclError>>,
}

impl NcclRegistration {
    /// A helper over `comms` (any number per device; each range goes to those of its device).
    pub fn new(comms: Vec<Arc<Communicator>>) -> Self {
        NcclRegistration {
            comms,
            held: Mutex::new(HashMap::new()),
            errors: Mutex::new(Vec::new()),
        }
    }

    /// The errors of the registrations and deregistrations that failed so far.
    pub fn errors(&self) -> Vec<NcclError> {
        self.errors.lock().clone()
    }

    /// Ranges registered now, and their bytes.
    pub fn registered(&self) -> (usize, u64) {
        let held = self.held.lock();
        (held.len(), held.values().map(|(n, _)| n).sum())
    }

    fn deregister(&self, regs: Vec<(usize, Registration)>) {
        for (i, reg) in regs {
            if let Err(e) = self.comms[i].deregister(reg) {
                self.errors.lock().push(e);
            }
        }
    }
}

impl MapHooks for NcclRegistration {
    fn mapped(&self, device: usize, addr: u64, size: u64) {
        let mut regs = Vec::new();
        for (i, comm) in self.comms.iter().enumerate() {
            if comm.ordinal() != device {
                continue;
            }
            match comm.register(addr, size) {
                Ok(reg) => regs.push((i, reg)),
                Err(e) => self.errors.lock().push(e),
            }
        }
        // A range announced again without its withdrawal (a bug on the allocator's side): the
        // old registrations go, rather than stay with NCCL for pages that may be gone.
        let old = self.held.lock().insert((device, addr), (size, regs));
        if let Some((_, old)) = old {
            self.deregister(old);
        }
    }

    fn unmapping(&self, device: usize, addr: u64, _size: u64) {
        let regs = self.held.lock().remove(&(device, addr));
        if let Some((_, regs)) = regs {
            self.deregister(regs);
        }
    }
}

impl Drop for NcclRegistration {
    fn drop(&mut self) {
        let held: Vec<_> = self.held.lock().drain().collect();
        for (_, (_, regs)) in held {
            self.deregister(regs);
        }
    }
}
