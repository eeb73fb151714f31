//! cudarc interop: typed [`Buffer`]s from a [`CachingAllocator<CudaDevice>`], or from a
//! [`RecordingAllocator<CudaDevice, W>`] that writes their allocations and frees to a trace.
//!
//! A `Buffer<T>` (defined in `cudalloc-sys`, where the `unsafe` trait implementations live) is
//! accepted by cudarc 0.19 wherever a `CudaSlice<T>` is: copies, memsets, `CudaBlas` gemm and
//! kernel launches. It is allocated for one stream and goes back to this allocator on that
//! stream when dropped; see `cudalloc_sys::buffer` for the synchronization rules.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudalloc::{CachingAllocator, Config};
//! use cudalloc_sys::CudaDevice;
//! use std::sync::Arc;
//!
//! let alloc = Arc::new(CachingAllocator::new(CudaDevice::new(0)?, Config::parse("policy:default")?));
//! let stream = alloc.with_device(|d| d.context().new_stream())?;
//! let mut x = alloc.buffer::<f32>(1 << 20, &stream)?;      // zeroed
//! stream.memcpy_htod(&vec![1.0f32; 1 << 20], &mut x)?;    // cudarc accepts it unchanged
//! let back: Vec<f32> = stream.clone_dtoh(&x)?;
//! drop(x);                                                 // back to the pool, stream-ordered
//! # Ok(()) }
//! ```
//!
//! The constructors check that the stream belongs to the allocator's device context
//! ([`AllocError::ForeignContext`]) and that `len * size_of::<T>()` does not overflow
//! ([`AllocError::ElementCountOverflow`]); running out of memory is
//! [`AllocError::OutOfMemory`], after the allocator released what it could.
//!
//! Both pools share one implementation of the constructors (the private `BufferSource` trait
//! and the functions over it), so a recorded buffer is made exactly as an unrecorded one. A
//! buffer goes back with [`BufferPool::free`] on the stream it was made for, which is the
//! allocators' `free_on` (a free on another stream is [`AllocError::WrongStream`]).

use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::pool::Allocation;
use crate::record::RecordingAllocator;
use crate::sync::Arc;
use cudalloc_sys::buffer::cudarc::driver::{CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use cudalloc_sys::buffer::{AnyBitPattern, Buffer, BufferPool, FromBuffer, PoolError};
use cudalloc_sys::{CudaDevice, Device, DeviceError, StreamId};
use std::io::Write;

/// Bytes of `len` elements of `T`, or [`AllocError::ElementCountOverflow`] if that overflows.
pub fn buffer_bytes<T>(len: usize) -> Result<u64, AllocError> {
    let elem_size = std::mem::size_of::<T>();
    len.checked_mul(elem_size)
        .and_then(|b| u64::try_from(b).ok())
        .ok_or(AllocError::ElementCountOverflow {
            len,
            elem_size,
            elem_type: std::any::type_name::<T>(),
        })
}

/// The handle of CUDA's per-thread default stream (`cudaStreamPerThread`, cudarc's
/// `per_thread_stream()`): the same on every thread for a different stream on each, so the
/// allocator refuses it (blocks freed on one thread's would be handed to another's unordered).
pub const PER_THREAD_STREAM: StreamId = StreamId(2);

/// The allocator's name for a cudarc stream (its raw `CUstream` handle).
pub fn stream_id(stream: &CudaStream) -> StreamId {
    StreamId(stream.cu_stream() as u64)
}

/// A cudarc driver error as an allocator error.
pub(crate) fn driver_error(call: &'static str, e: DriverError) -> AllocError {
    AllocError::Device(DeviceError::Driver {
        call,
        code: e.0 as i32,
        message: e.to_string(),
    })
}

impl BufferPool for CachingAllocator<CudaDevice> {
    fn free(&self, ptr: u64, stream: StreamId, _: FromBuffer) -> Result<(), PoolError> {
        Ok(self.free_buffer(ptr, stream)?)
    }

    fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), PoolError> {
        Ok(CachingAllocator::record_stream(self, ptr, stream)?)
    }
}

/// Frees go through the recorder (`free_requested`, `free_completed` on the buffer's stream).
impl<W: Write + Send + 'static> BufferPool for RecordingAllocator<CudaDevice, W> {
    fn free(&self, ptr: u64, stream: StreamId, _: FromBuffer) -> Result<(), PoolError> {
        Ok(self.free_buffer(ptr, stream)?)
    }

    fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), PoolError> {
        Ok(RecordingAllocator::record_stream(self, ptr, stream)?)
    }
}

/// What the buffer constructors need of a pool; one implementation of them serves both pools
/// (and, through [`crate::workspace`], both pools' cuBLAS handles).
pub(crate) trait BufferSource: BufferPool + Sized + 'static {
    /// Allocates `bytes` on `stream` (recorded, for the recording pool).
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<Allocation, AllocError>;

    /// The pool's CUDA device.
    fn with_device<R>(&self, f: impl FnOnce(&CudaDevice) -> R) -> R;

    /// Marks the allocation at `ptr` as a buffer's (freed only through [`BufferPool::free`]).
    fn mark_buffer(&self, ptr: u64);
}

// Each method calls the inherent one of the same name: a `Type::method` path picks an
// inherent method over a trait's.
impl BufferSource for CachingAllocator<CudaDevice> {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        CachingAllocator::allocate(self, bytes, stream)
    }

    fn with_device<R>(&self, f: impl FnOnce(&CudaDevice) -> R) -> R {
        CachingAllocator::with_device(self, f)
    }

    fn mark_buffer(&self, ptr: u64) {
        CachingAllocator::mark_buffer(self, ptr);
    }
}

impl<W: Write + Send + 'static> BufferSource for RecordingAllocator<CudaDevice, W> {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        RecordingAllocator::allocate(self, bytes, stream)
    }

    fn with_device<R>(&self, f: impl FnOnce(&CudaDevice) -> R) -> R {
        RecordingAllocator::with_device(self, f)
    }

    fn mark_buffer(&self, ptr: u64) {
        RecordingAllocator::mark_buffer(self, ptr);
    }
}

/// The buffer constructors, once for [`CachingAllocator<CudaDevice>`] and once for
/// [`RecordingAllocator<CudaDevice, W>`], each a call of the shared functions below.
macro_rules! buffer_constructors {
    () => {
        /// A zeroed buffer of `len` elements for use on `stream` (one `cuMemsetD8Async` on it).
        pub fn buffer<T: DeviceRepr + ValidAsZeroBits>(
            self: &Arc<Self>,
            len: usize,
            stream: &Arc<CudaStream>,
        ) -> Result<Buffer<T>, AllocError> {
            zeroed_buffer(self, len, stream)
        }

        /// A buffer of `len` elements for use on `stream`, holding whatever its block held
        /// (no device work at all); only for types where every bit pattern is a value.
        pub fn buffer_uninit<T: AnyBitPattern>(
            self: &Arc<Self>,
            len: usize,
            stream: &Arc<CudaStream>,
        ) -> Result<Buffer<T>, AllocError> {
            raw_buffer(self, len, stream)
        }

        /// A buffer holding a copy of `data`, for use on `stream` (`cuMemcpyHtoDAsync` on it).
        pub fn buffer_from<T: DeviceRepr>(
            self: &Arc<Self>,
            data: &[T],
            stream: &Arc<CudaStream>,
        ) -> Result<Buffer<T>, AllocError> {
            copied_buffer(self, data, stream)
        }
    };
}

impl CachingAllocator<CudaDevice> {
    buffer_constructors!();

    /// A buffer holding a copy of `data`, for use on `stream`, allocated in tag `tag`
    /// ([`CachingAllocator::allocate_tagged`]): it sleeps and wakes with the tag, and like any
    /// tagged allocation it cannot be freed (dropped) while the tag sleeps.
    pub fn tagged_buffer_from<T: DeviceRepr>(
        self: &Arc<Self>,
        tag: &str,
        data: &[T],
        stream: &Arc<CudaStream>,
    ) -> Result<Buffer<T>, AllocError> {
        let mut b = buffer_in(self, data.len(), stream, |bytes, s| {
            self.allocate_tagged(bytes, s, tag)
        })?;
        stream
            .memcpy_htod(data, &mut b)
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        Ok(b)
    }
}

/// The constructors of [`CachingAllocator<CudaDevice>`], recorded: each writes `alloc`, and the
/// buffer's drop or `free` writes `free_requested` and `free_completed`. A buffer holds an `Arc`
/// of the recorder, so drop every buffer before `Arc::try_unwrap` and
/// [`RecordingAllocator::finish`].
impl<W: Write + Send + 'static> RecordingAllocator<CudaDevice, W> {
    buffer_constructors!();
}

/// A zeroed buffer from `pool` (one `cuMemsetD8Async` on `stream`).
fn zeroed_buffer<P: BufferSource, T: DeviceRepr + ValidAsZeroBits>(
    pool: &Arc<P>,
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<Buffer<T>, AllocError> {
    let mut b = raw_buffer::<P, T>(pool, len, stream)?;
    stream
        .memset_zeros(&mut b)
        .map_err(|e| driver_error("cuMemsetD8Async", e))?;
    Ok(b)
}

/// A buffer from `pool` holding a copy of `data` (`cuMemcpyHtoDAsync` on `stream`).
fn copied_buffer<P: BufferSource, T: DeviceRepr>(
    pool: &Arc<P>,
    data: &[T],
    stream: &Arc<CudaStream>,
) -> Result<Buffer<T>, AllocError> {
    let mut b = raw_buffer::<P, T>(pool, data.len(), stream)?;
    stream
        .memcpy_htod(data, &mut b)
        .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
    Ok(b)
}

/// Allocates the block; the caller initializes it before anyone can read it.
pub(crate) fn raw_buffer<P: BufferSource, T>(
    pool: &Arc<P>,
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<Buffer<T>, AllocError> {
    buffer_in(pool, len, stream, |bytes, s| pool.allocate(bytes, s))
}

/// [`raw_buffer`] with the block from `allocate` (bytes, stream).
fn buffer_in<P: BufferSource, T>(
    pool: &Arc<P>,
    len: usize,
    stream: &Arc<CudaStream>,
    allocate: impl FnOnce(u64, StreamId) -> Result<Allocation, AllocError>,
) -> Result<Buffer<T>, AllocError> {
    let bytes = buffer_bytes::<T>(len)?;
    if stream_id(stream) == PER_THREAD_STREAM {
        return Err(AllocError::Device(DeviceError::invalid(
            "stream",
            "the per-thread default stream (handle 0x2) is a different stream on each thread, \
             which the allocator cannot tell apart; pass a stream created for the work",
        )));
    }
    let (same, device) = pool.with_device(|d| (**d.context() == **stream.context(), d.ordinal()));
    if !same {
        return Err(AllocError::ForeignContext {
            stream: stream_id(stream),
            stream_device: stream.context().ordinal(),
            device,
        });
    }
    let a = allocate(bytes, stream_id(stream))?;
    // Before the address leaves this function: from now on only the buffer frees it.
    pool.mark_buffer(a.ptr());
    let owner: Arc<dyn BufferPool> = pool.clone();
    Ok(Buffer::from_pool(owner, a.ptr(), len, stream.clone()))
}
