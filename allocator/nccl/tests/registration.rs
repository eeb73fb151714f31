//! The NCCL helper on the CPU: without `libnccl` every NCCL call is an error, never a panic;
//! the registration helper holds exactly the ranges its allocator announced and not withdrawn
//! (here with no communicator, so nothing reaches NCCL), and gives them all up when the
//! allocator lets go.

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_nccl::NcclRegistration;
use cudalloc_sys::nccl::{self, Communicator, NcclError};
use cudalloc_sys::{SimDevice, StreamId};
use std::sync::Arc;

#[test]
fn without_nccl_every_call_is_an_error() {
    match nccl::available() {
        Err(NcclError::Unavailable(why)) => {
            assert!(!why.is_empty());
            let e = Communicator::init_all(&[0]).unwrap_err();
            assert!(matches!(e, NcclError::Unavailable(_)), "{e}");
            assert!(nccl::group(|| Ok(())).is_err());
        }
        Err(other) => panic!("availability is Unavailable or Ok, not {other}"),
        // NCCL is installed here: making a communicator needs a GPU, which may be absent.
        Ok(()) => {
            let _ = Communicator::init_all(&[0]);
        }
    }
}

#[test]
fn the_helper_holds_exactly_the_announced_ranges() {
    for policy in Policy::ALL {
        let dev = Arc::new(SimDevice::with_capacity(1 << 30));
        let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
        let reg = Arc::new(NcclRegistration::new(Vec::new()));
        let early = alloc.allocate(3 << 20, StreamId::DEFAULT).unwrap();
        alloc.set_map_hooks(Some(reg.clone()));
        let late = alloc.allocate(50 << 20, StreamId(7)).unwrap();
        let ranges = alloc.mapped_ranges();
        let bytes: u64 = ranges.iter().map(|r| r.1).sum();
        assert_eq!(reg.registered(), (ranges.len(), bytes), "{policy:?}");
        assert!(
            bytes >= (53 << 20),
            "{policy:?}: both allocations are covered"
        );
        alloc.free(early).unwrap();
        alloc.free(late).unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(reg.registered(), (0, 0), "{policy:?}: everything withdrawn");
        assert!(reg.errors().is_empty());
    }
}
