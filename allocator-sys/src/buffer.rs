//! [`Buffer<T>`]: typed device memory from a caching pool that cudarc 0.19 accepts wherever it
//! accepts a `CudaSlice<T>`: `memcpy_htod`/`memcpy_dtoh`/`memcpy_dtod`, `memset_zeros`,
//! `CudaBlas` gemm, and kernel launches.
//!
//! # Ownership
//!
//! A buffer is `len` elements of `T` at a device address that a [`BufferPool`] handed out for
//! one stream, the buffer's *owner* ([`DeviceSlice::stream`]). Dropping the buffer gives the
//! memory back to the pool on that stream: stream-ordered, so the pool may hand the block out
//! again at once, but only to work on the same stream, which runs after everything already
//! queued there. Streams named with [`Buffer::record_stream`] are passed to
//! [`BufferPool::record_stream`] first, so the block also waits for their work (PyTorch's
//! `record_stream`). A buffer holds an `Arc` of its pool, which therefore outlives it.
//!
//! The pool lives in the `cudalloc` crate (`CachingAllocator<CudaDevice>` implements
//! [`BufferPool`], and `CachingAllocator::buffer` is the constructor to use); this crate cannot
//! depend on it, hence the trait.
//!
//! # Synchronization: cudarc's contract
//!
//! `DevicePtr::device_ptr(stream)` must make `stream` wait for earlier writes, and
//! `DevicePtrMut::device_ptr_mut(stream)` for earlier reads and writes; the returned
//! `SyncOnDrop` is dropped after the operation is queued. With one stream nothing is needed and
//! nothing is done (once the context has a second stream, cudarc's `CudaSlice` creates two
//! events per allocation and records one on every use; a `Buffer` on its own stream has none). When other streams use the
//! buffer, its tracker records and waits on events, per stream rather than cudarc's single
//! read/write pair, so two readers on two streams are both waited for by the next writer. As
//! with `CudaSlice`, cross-stream ordering is active while the context manages stream
//! synchronization (the default once `new_stream` or `fork` was called); with event tracking
//! disabled it is the caller's job.
//!
//! # Kernel arguments
//!
//! cudarc gives a `PushKernelArg` implementation no access to the launch's stream, so `&buf` and
//! `&mut buf` pushed with `LaunchArgs::arg` mean *a launch on the buffer's own stream*: the
//! owner waits for foreign users before the launch, as for any owner read or write. For a launch
//! on another stream, push the address that `device_ptr(&stream)`/`device_ptr_mut(&stream)`
//! returns and drop its `SyncOnDrop` after `launch`, which is what `cudalloc_sys::ops` does.
//!
//! # Initialized memory
//!
//! Copying device memory to the host as `T` is only sound if every byte pattern there is a valid
//! `T` (cudarc's `alloc` is `unsafe` for that reason). A buffer that is not zeroed or filled at
//! creation must hold a type implementing [`AnyBitPattern`]; the constructors in `cudalloc`
//! enforce it.
//!
//! # Trust
//!
//! [`Buffer::from_pool`] is safe in the sense cudarc's `DevicePtr` trait is safe: both hand a raw
//! device address to cudarc's safe copy functions, and both trust the code that produced it. A
//! [`BufferPool`] must therefore only hand out device memory it owns, at least as large as the
//! buffer, to one buffer at a time. `CachingAllocator<CudaDevice>` hands out `cuMemAlloc`
//! and `cuMemMap` memory on the device, never host-mapped memory.

mod blas;
mod tracker;

#[cfg(test)]
mod tests;

/// cudarc, as this crate builds it (`driver`, `cublas`, dynamic loading; `nvrtc` with the `ops`
/// feature), for crates that reach it through `cudalloc-sys`.
pub use cudarc;

pub use blas::{BlasError, PooledBlas};

use crate::device::StreamId;
use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop,
};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use tracker::Tracker;

/// Why a pool could not take a buffer back.
pub type PoolError = Box<dyn std::error::Error + Send + Sync>;

/// Proof that a call of [`BufferPool::free`] comes from a [`Buffer`] giving its memory back:
/// only this crate makes one, so a pool can free a buffer's block on that call alone and refuse
/// every other way of freeing it (freed by address while the buffer lives, the block could be
/// handed to a second buffer, and both would use it).
#[derive(Debug)]
pub struct FromBuffer(());

/// Where buffers come from and go back to: implemented by `cudalloc`'s
/// `CachingAllocator<CudaDevice>`.
pub trait BufferPool: Send + Sync {
    /// Takes back the allocation at `ptr`, made on `stream`, from the buffer that owned it;
    /// stream-ordered: later work on `stream` may reuse it at once.
    fn free(&self, ptr: u64, stream: StreamId, from: FromBuffer) -> Result<(), PoolError>;

    /// Marks the allocation at `ptr` as used on `stream` too: when it is freed, it is reused
    /// only after the work queued on `stream` by then has completed.
    fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), PoolError>;
}

/// Types for which every bit pattern is a valid value, so uninitialized device memory may be
/// read back as them.
///
/// # Safety
///
/// Every sequence of `size_of::<Self>()` bytes must be a valid `Self` (no padding, no niches:
/// integers and floats are fine; `bool`, `char`, references and enums are not).
pub unsafe trait AnyBitPattern: DeviceRepr {}

macro_rules! any_bit_pattern {
    ($($t:ty),*) => {$(
        // SAFETY: a primitive integer or float: every bit pattern of its size is a value.
        unsafe impl AnyBitPattern for $t {}
    )*};
}
any_bit_pattern!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);

// SAFETY: an array has no padding between elements, and each element accepts any bit pattern.
unsafe impl<T: AnyBitPattern, const N: usize> AnyBitPattern for [T; N] {}

/// `len` elements of `T` in device memory from a [`BufferPool`]; see the module documentation.
///
/// `Send + Sync` like `CudaSlice`: the host never dereferences the address.
pub struct Buffer<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    pool: Option<Arc<dyn BufferPool>>,
    tracker: Tracker,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Buffer<T> {
    /// Wraps the pool allocation at `ptr` (at least `len * size_of::<T>()` bytes, made for
    /// `stream`) as a buffer that goes back to `pool` when dropped. The memory's contents are
    /// whatever the block held; the caller initializes it (see the module documentation on
    /// initialized memory and trust). Meant for pool implementations: `cudalloc`'s
    /// `CachingAllocator::buffer` calls it.
    pub fn from_pool(
        pool: Arc<dyn BufferPool>,
        ptr: u64,
        len: usize,
        stream: Arc<CudaStream>,
    ) -> Buffer<T> {
        Buffer {
            ptr,
            len,
            stream,
            pool: Some(pool),
            tracker: Tracker::default(),
            _elem: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (`len * size_of::<T>()`; the pool checked it does not overflow).
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address, for code outside cudarc's traits (a C library, a raw launch). Work
    /// queued that way on a stream other than the owner is not tracked: order it yourself and
    /// call [`Buffer::record_stream`] for that stream.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The stream the buffer was allocated on and will be freed on.
    pub fn owner(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Marks the buffer as used on `stream` (PyTorch's `record_stream`): when it is dropped, the
    /// pool reuses the block only after the work queued on `stream` by then completes. The
    /// buffer keeps `stream` alive until then. Uses through cudarc's traits need no call. The
    /// per-thread default stream (handle 0x2, a different stream on each thread) cannot be
    /// kept: the call waits on the host for the work queued on the calling thread's one so
    /// far, and work queued there later is not covered; use a stream created for the work.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        self.tracker.record_stream(&self.stream, stream);
    }

    /// Foreign streams whose use is being tracked now (0 while only the owner used the buffer,
    /// and again after the owner writes it).
    pub fn tracked_streams(&self) -> usize {
        self.tracker.foreign_streams()
    }

    /// Gives the memory back now, reporting what went wrong (dropping does the same and prints
    /// errors to stderr). On an error the block is not reused: it stays allocated in the pool.
    pub fn free(mut self) -> Result<(), PoolError> {
        self.release()
    }

    fn release(&mut self) -> Result<(), PoolError> {
        let Some(pool) = self.pool.take() else {
            return Ok(());
        };
        self.tracker.before_free(&self.stream);
        // Held until the pool has recorded its free events on them (in `free`): a stream whose
        // last handle this was would otherwise be destroyed first, and its handle could be
        // reused by another stream before the event is recorded.
        let recorded = self.tracker.take_recorded();
        for s in &recorded {
            let id = StreamId(s.cu_stream() as u64);
            if pool.record_stream(self.ptr, id).is_err() {
                // The pool could not track it: wait on the host instead of risking early reuse.
                s.synchronize()?;
            }
        }
        let freed = pool.free(
            self.ptr,
            StreamId(self.stream.cu_stream() as u64),
            FromBuffer(()),
        );
        drop(recorded);
        freed
    }
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            eprintln!(
                "cudalloc: buffer at {:#x} ({} bytes) could not go back to its pool: {e}",
                self.ptr,
                self.num_bytes()
            );
        }
    }
}

impl<T> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .field("stream", &format_args!("{:?}", self.stream.cu_stream()))
            .field("tracked_streams", &self.tracked_streams())
            .finish()
    }
}

impl<T> DeviceSlice<T> for Buffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Buffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, self.tracker.read(&self.stream, stream))
    }
}

impl<T> DevicePtrMut<T> for Buffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, self.tracker.write(&self.stream, stream))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's `u64` device address, which lives
// as long as the borrow `'b` of the buffer, itself longer than the launch builder `'a`; a
// `CUdeviceptr` parameter is a `u64` by value. The owner stream is ordered after foreign
// writers before the launch (see the module documentation on kernel arguments).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Buffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Buffer<T>) -> &mut Self {
        arg.tracker.owner_read(&arg.stream);
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&Buffer<T>`; the exclusive borrow is downgraded to a shared one for `'b`
// after the owner stream was ordered after every foreign use.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Buffer<T>) -> &mut Self {
        arg.tracker.owner_write(&arg.stream);
        let arg: &'b Buffer<T> = arg;
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}
