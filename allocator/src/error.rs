//! Typed errors of the allocator.
//!
//! Each cause has its own variant carrying the values that explain it, so a caller can match
//! on the cause and read the figures; the `Display` text names them too.

use crate::sizes::MAX_REQUEST;
use cudalloc_sys::{DeviceError, StreamId};
use std::fmt;

/// Why an allocator call failed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum AllocError {
    /// The device (or the memory limit) could not supply the memory, even after every cached
    /// block that could be released was released.
    OutOfMemory {
        /// The device's ordinal (so that one rank of a multi-GPU job says which GPU ran out).
        device: usize,
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
        /// The device's ordinal.
        device: usize,
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
    /// The pointer belongs to a `Buffer` (`CachingAllocator::buffer` and the like): it goes
    /// back to the pool when the buffer is dropped or freed, not by address.
    OwnedByBuffer(u64),
    /// A request larger than `limit`, the most the call takes: [`MAX_REQUEST`] (256 TiB, more
    /// than any device holds) for an allocation; for a cuBLAS workspace on a host whose `usize`
    /// is narrower than 64 bits, also `usize::MAX` (a buffer's length).
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// The most the call takes.
        limit: u64,
    },
    /// A memory fraction outside [0, 1] (NaN and infinities included).
    BadFraction(f64),
    /// `free_on` named another stream than the one the allocation was made on (nothing freed).
    WrongStream {
        /// The allocation's address.
        ptr: u64,
        /// The stream it was allocated on, the one to free it on.
        allocated_on: StreamId,
        /// The stream the free named.
        freed_on: StreamId,
    },
    /// A buffer was asked for on a stream of another CUDA context than the allocator's device
    /// (the primary context of its ordinal).
    ForeignContext {
        /// The stream.
        stream: StreamId,
        /// The device ordinal of the stream's context.
        stream_device: usize,
        /// The allocator's device ordinal.
        device: usize,
    },
    /// A policy's `place` or `grow` gave a block the core may not hand out for the request
    /// (nothing was handed out; the block stays where it was).
    PolicyBroke {
        /// The block's id.
        block: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The caller asked, during a CUDA graph capture it told the allocator of, for what needs a
    /// device call the capture forbids (`pool::capture`); nothing changed.
    DuringCapture {
        /// What was asked: `grow` (a growth by `malloc`), `empty_cache`, `sleep`, `wake`, or
        /// `end_capture` without a capture begun in its mode.
        what: &'static str,
        /// Bytes asked for (`grow`), else 0.
        requested: u64,
    },
    /// The memory asked for sleeps (`CachingAllocator::sleep`): an allocation, a free or a
    /// `record_stream` of a sleeping tag's memory waits until the tag wakes (nothing changed).
    Asleep {
        /// What was asked: `allocate`, `free` or `record_stream`.
        what: &'static str,
        /// The sleeping tag, when the caller named one (a lone `Pool` has none).
        tag: Option<String>,
    },
    /// Sleep needs expandable segments (pages that can be unmapped while their addresses stay
    /// reserved); the `torch` policy allocates fixed segments (`cuMemAlloc`).
    SleepUnsupported,
    /// A sleep unmapped some of the pages but not all: the driver refused an unmap, or a wait
    /// for the copies of later pages failed. The memory sleeps (it refuses allocations, frees
    /// and `record_stream`, and a wake restores it whole), yet `mapped` bytes of its pages stay
    /// on the device, counted in the reserved bytes. Sleeping it again copies their bytes again
    /// and retries their unmap; waking it works as after any sleep.
    SleepIncomplete {
        /// The tag, when the caller named one (a lone `Pool` has none).
        tag: Option<String>,
        /// Bytes of the pages still mapped.
        mapped: u64,
        /// The first refused call.
        source: DeviceError,
    },
    /// `len` elements of `elem_size` bytes each are more bytes than a `usize` or `u64` counts.
    ElementCountOverflow {
        /// Elements asked for.
        len: usize,
        /// Bytes of one element.
        elem_size: usize,
        /// The element type's name.
        elem_type: &'static str,
    },
    /// The allocation at `ptr` cannot be shared with another process (`CachingAllocator::share`):
    /// `why` says why and which config key to set.
    NotShareable {
        /// The allocation's address.
        ptr: u64,
        /// Why, naming the key to set.
        why: String,
    },
    /// A shared allocation's description cannot be opened (`SharedMapping::open`): `why` says
    /// what is wrong with it.
    BadShare {
        /// What is wrong.
        why: String,
    },
    /// [`crate::CachingAllocator::allocate_at`]: the range is not free in this allocator
    /// (`why` says what holds it), so it cannot be handed out there.
    NotFree {
        /// First address asked for.
        ptr: u64,
        /// Bytes asked for.
        size: u64,
        /// Why not.
        why: &'static str,
    },
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
                device,
                requested,
                rounded,
                reserved,
                allocated,
                device_free,
                limit,
            } => {
                write!(
                    f,
                    "out of memory on device {device}: tried to allocate {} ({} rounded); {} reserved, {} allocated, {} free on the device",
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
                device,
                requested,
                ranges,
                range_bytes,
                device_free,
            } => write!(
                f,
                "out of address space on device {device}: tried to allocate {} with {} free on the device, but no \
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
            AllocError::OwnedByBuffer(p) => write!(
                f,
                "{p:#x} belongs to a Buffer: it is freed when the buffer is dropped (or by \
                 Buffer::free), not by address"
            ),
            AllocError::TooLarge { requested, limit } => too_large(f, *requested, *limit),
            AllocError::BadFraction(x) => write!(f, "memory fraction {x} is not in [0, 1]"),
            AllocError::PolicyBroke { block, why } => write!(
                f,
                "the policy gave block {block} for a request it cannot serve: {why} (a bug in \
                 the policy; nothing was handed out)"
            ),
            AllocError::WrongStream {
                ptr,
                allocated_on,
                freed_on,
            } => write!(
                f,
                "{ptr:#x} was allocated on {allocated_on}, freed on {freed_on}"
            ),
            AllocError::ForeignContext {
                stream,
                stream_device,
                device,
            } => write!(
                f,
                "{stream} belongs to another CUDA context (of device {stream_device}) than the \
                 allocator's device ({device})"
            ),
            AllocError::DuringCapture { what, requested } => during_capture(f, what, *requested),
            AllocError::Asleep { what, tag } => match tag {
                Some(t) => write!(f, "{what}: tag {t:?} sleeps; wake it first"),
                None => write!(f, "{what}: the pool sleeps; wake it first"),
            },
            AllocError::SleepUnsupported => write!(
                f,
                "sleep and wake need expandable segments, and the torch policy allocates fixed \
                 ones (cuMemAlloc): use the default or torch-expandable policy"
            ),
            AllocError::SleepIncomplete {
                tag,
                mapped,
                source,
            } => {
                match tag {
                    Some(t) => write!(f, "tag {t:?} sleeps, but ")?,
                    None => write!(f, "the pool sleeps, but ")?,
                }
                write!(
                    f,
                    "{} of its pages stay mapped ({source}); sleep it again to retry, or wake it",
                    crate::fmt::bytes(*mapped)
                )
            }
            AllocError::ElementCountOverflow {
                len,
                elem_size,
                elem_type,
            } => write!(
                f,
                "{len} elements of {elem_type} ({elem_size} bytes each): the size overflows"
            ),
            AllocError::NotShareable { ptr, why } => {
                write!(f, "the allocation at {ptr:#x} cannot be shared: {why}")
            }
            AllocError::BadShare { why } => write!(f, "cannot open the shared allocation: {why}"),
            AllocError::NotFree { ptr, size, why } => write!(
                f,
                "cannot hand out {} at {ptr:#x}: {why}",
                crate::fmt::bytes(*size)
            ),
        }
    }
}

/// The text of [`AllocError::DuringCapture`]: what was refused and what to do instead.
fn during_capture(f: &mut fmt::Formatter<'_>, what: &str, requested: u64) -> fmt::Result {
    match what {
        "grow" => write!(
            f,
            "cannot get {requested} bytes during a CUDA graph capture: this policy grows with \
             cuMemAlloc, which a capture forbids; run the captured work once before capturing \
             (a warm-up) so that the pool already holds the memory, or use the default or \
             torch-expandable policy, which map pages during a capture"
        ),
        "sleep" | "wake" => write!(
            f,
            "{what} during a CUDA graph capture: it copies and waits for the device, which a \
             capture forbids; call it before or after the capture"
        ),
        "empty_cache" => write!(
            f,
            "empty_cache during a CUDA graph capture: it waits for the device, which a capture \
             forbids; call it before or after the capture"
        ),
        _ => write!(
            f,
            "{what}: no CUDA graph capture in that mode is underway (each begin_capture is \
             ended with the same mode)"
        ),
    }
}

/// The text of [`AllocError::TooLarge`]: why the limit is what it is.
fn too_large(f: &mut fmt::Formatter<'_>, requested: u64, limit: u64) -> fmt::Result {
    let why = if limit == MAX_REQUEST {
        "larger than any device"
    } else {
        "more than this host can address"
    };
    write!(
        f,
        "{requested} bytes is {why} (a request may be at most {limit} bytes, {})",
        crate::fmt::bytes(limit)
    )
}

impl std::error::Error for AllocError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AllocError::Device(e) => Some(e),
            _ => None,
        }
    }
}

/// A config key that could not be accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key (or the offending token when no key could be read).
    pub key: String,
    /// What was wrong.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "config key `{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The invariant a full scan (`check_invariants`) found broken; see the module docs of
/// [`crate::Pool`]'s core and of [`crate::CachingAllocator`] for what each states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Invariant {
    /// The blocks of a segment tile it exactly, in address order.
    Tiling,
    /// No two neighbouring blocks are both free and mapped, or both unmapped.
    Merged,
    /// No two segments overlap.
    Overlap,
    /// A block is in its pool's free index iff it is free and mapped, in the unmapped index iff
    /// it is unmapped; a block in use is mapped; a free block carries no policy mark; sizes are
    /// multiples of 512 bytes.
    Index,
    /// A mapped block of an expandable segment lies on mapped pages.
    Mapping,
    /// Every statistic's `current` equals what a scan of the blocks recomputes.
    Statistics,
    /// `reserved_bytes` equals the bytes held from the device.
    Reserved,
    /// The pinned units list exactly the pinned bytes of the breakdown of reserved bytes.
    Pinning,
    /// Capture bookkeeping: blocks freed during a capture wait for it to end.
    Capture,
    /// Every block lies in a segment.
    Reachable,
    /// The live table of a `CachingAllocator` agrees with its pools and thread caches.
    LiveTable,
    /// A `CachingAllocator`'s shared reserved counter equals the sum of its pools.
    SharedReserved,
}

impl Invariant {
    /// What the invariant states, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            Invariant::Tiling => "blocks tile their segment",
            Invariant::Merged => "free neighbours are merged",
            Invariant::Overlap => "segments do not overlap",
            Invariant::Index => "the free indexes hold exactly the free blocks",
            Invariant::Mapping => "mapped blocks lie on mapped pages",
            Invariant::Statistics => "statistics equal the blocks",
            Invariant::Reserved => "reserved bytes equal the bytes held",
            Invariant::Pinning => "pinned units add up to the pinned bytes",
            Invariant::Capture => "blocks freed during a capture wait for it",
            Invariant::Reachable => "every block lies in a segment",
            Invariant::LiveTable => "the live table agrees with the pools",
            Invariant::SharedReserved => "the shared reserved counter equals the pools'",
        }
    }
}

/// A broken invariant, found by `check_invariants`: which one, and what the scan saw.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InvariantError {
    /// The invariant.
    pub invariant: Invariant,
    /// What the scan saw (addresses and counts).
    pub detail: String,
}

impl InvariantError {
    pub(crate) fn new(invariant: Invariant, detail: impl Into<String>) -> InvariantError {
        InvariantError {
            invariant,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for InvariantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.invariant.describe(), self.detail)
    }
}

impl std::error::Error for InvariantError {}
