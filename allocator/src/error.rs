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
    /// A driver error other than out-of-memory.
    Device(DeviceError),
    /// The pointer is not a live allocation of this allocator (a double free, a foreign pointer).
    NotAllocated(u64),
    /// A bad argument (a size that overflows, a fraction outside [0, 1]).
    InvalidArgument(String),
}

impl AllocError {
    /// True for [`AllocError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory { .. })
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
