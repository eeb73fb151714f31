//! Typed errors of the allocator.

use cudalloc_sys::DeviceError;
use std::fmt;

/// Why an allocator call failed.
#[derive(Clone, Debug, PartialEq)]
pub enum AllocError {
    /// The device (or the memory limit) could not supply the memory, even after every cached
    /// block that could be released was released.
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// The request after rounding.
        rounded: u64,
        /// Bytes the allocator holds from the device.
        reserved: u64,
        /// Bytes handed out to callers.
        allocated: u64,
        /// Free device memory as the driver reports it.
        device_free: u64,
        /// The allocator's memory limit, if one is set.
        limit: Option<u64>,
    },
    /// The device's virtual address space ran out before its memory did: no range could be
    /// reserved for an expandable segment (each stream and pool has its own ranges).
    AddressSpace {
        /// Bytes asked for.
        requested: u64,
        /// Virtual ranges this pool holds.
        ranges: u64,
        /// Their bytes of address space.
        range_bytes: u64,
        /// Free device memory as the driver reports it.
        device_free: u64,
    },
    /// A driver error other than out-of-memory.
    Device(DeviceError),
    /// The pointer is not a live allocation of this allocator (a double free, a foreign pointer).
    NotAllocated(u64),
    /// A bad argument (a size that overflows, a fraction outside [0, 1]).
    InvalidArgument(String),
}

impl AllocError {
    /// True for [`AllocError::OutOfMemory`] and [`AllocError::AddressSpace`]: the request
    /// could not be met now, and freeing memory (or streams) may help.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory { .. } | AllocError::AddressSpace { .. }
        )
    }
}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory {
                requested,
                rounded,
                reserved,
                allocated,
                device_free,
                limit,
            } => {
                write!(
                    f,
                    "out of memory: tried to allocate {} ({} rounded); {} reserved, {} allocated, {} free on the device",
                    crate::fmt::bytes(*requested),
                    crate::fmt::bytes(*rounded),
                    crate::fmt::bytes(*reserved),
                    crate::fmt::bytes(*allocated),
                    crate::fmt::bytes(*device_free)
                )?;
                if let Some(l) = limit {
                    write!(f, ", limit {}", crate::fmt::bytes(*l))?;
                }
                Ok(())
            }
            AllocError::AddressSpace {
                requested,
                ranges,
                range_bytes,
                device_free,
            } => write!(
                f,
                "out of address space: tried to allocate {} with {} free on the device, but no \
                 virtual range could be reserved; this pool holds {ranges} ranges of {} in all \
                 (each stream has its own)",
                crate::fmt::bytes(*requested),
                crate::fmt::bytes(*device_free),
                crate::fmt::bytes(*range_bytes)
            ),
            AllocError::Device(e) => write!(f, "device error: {e}"),
            AllocError::NotAllocated(p) => {
                write!(f, "{p:#x} is not a live allocation of this allocator")
            }
            AllocError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
        }
    }
}

impl std::error::Error for AllocError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AllocError::Device(e) => Some(e),
            _ => None,
        }
    }
}
