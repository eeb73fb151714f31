//! The driver's default memory pool (what `cuMemAllocAsync`, and so cudarc's `CudaStream::alloc`,
//! allocates from): its current and peak bytes, for comparing cudarc's allocation with
//! cudalloc's. These are the pool's own counters, so the peak between two host
//! synchronizations is seen too, which sampling `cuMemGetInfo` misses.
//!
//! | function | driver calls |
//! | --- | --- |
//! | [`usage`] | `cuDeviceGetDefaultMemPool`, `cuMemPoolGetAttribute` (reserved and used, current and high) |
//! | [`reset_peaks`] | `cuMemPoolSetAttribute` (both highs to 0: they restart from the current values) |
//! | [`set_release_threshold`] | `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)` |
//! | [`trim`] | `cuMemPoolTrimTo(pool, 0)` |

use cudarc::driver::sys::{self, CUmemPool_attribute as Attr};
use cudarc::driver::{CudaContext, DriverError};
use std::ffi::c_void;

/// Bytes of the default memory pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemPoolUsage {
    /// Physical memory the pool holds now.
    pub reserved: u64,
    /// Highest `reserved` since the last reset.
    pub reserved_high: u64,
    /// Bytes of live allocations now.
    pub used: u64,
    /// Highest `used` since the last reset.
    pub used_high: u64,
}

fn check(code: sys::CUresult) -> Result<(), DriverError> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(DriverError(e)),
    }
}

fn default_pool(ctx: &CudaContext) -> Result<sys::CUmemoryPool, DriverError> {
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and `cu_device` a device handle of a live context.
    check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) })?;
    Ok(pool)
}

fn get(pool: sys::CUmemoryPool, attr: Attr) -> Result<u64, DriverError> {
    let mut v: u64 = 0;
    // SAFETY: `pool` came from `cuDeviceGetDefaultMemPool` (default pools are never destroyed);
    // the attributes read here are `cuuint64_t`, and `v` is a valid `u64` out-pointer.
    check(unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast::<c_void>())
    })?;
    Ok(v)
}

fn set(pool: sys::CUmemoryPool, attr: Attr, value: u64) -> Result<(), DriverError> {
    let mut v = value;
    // SAFETY: as in `get`; the attributes written here are `cuuint64_t` and `v` outlives the call.
    check(unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast::<c_void>()) })
}

/// The default pool's counters on `ctx`'s device.
pub fn usage(ctx: &CudaContext) -> Result<MemPoolUsage, DriverError> {
    let pool = default_pool(ctx)?;
    Ok(MemPoolUsage {
        reserved: get(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        reserved_high: get(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        used: get(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        used_high: get(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    })
}

/// Restarts both high-water marks from the current values.
pub fn reset_peaks(ctx: &CudaContext) -> Result<(), DriverError> {
    let pool = default_pool(ctx)?;
    set(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
    set(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
}

/// Bytes the pool may keep cached across synchronizations (the driver's default is 0: it
/// returns free memory to the device at every stream or context synchronization).
pub fn set_release_threshold(ctx: &CudaContext, bytes: u64) -> Result<(), DriverError> {
    set(
        default_pool(ctx)?,
        Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        bytes,
    )
}

/// Returns every cached byte of the pool to the device.
pub fn trim(ctx: &CudaContext) -> Result<(), DriverError> {
    let pool = default_pool(ctx)?;
    // SAFETY: `pool` is the device's default pool; trimming only releases unused memory.
    check(unsafe { sys::cuMemPoolTrimTo(pool, 0) })
}
