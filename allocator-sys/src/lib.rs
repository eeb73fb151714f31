//! # cudalloc-sys: the device boundary
//!
//! Everything cudalloc needs from a GPU goes through the [`Device`] trait, whose contract is
//! written once in the [`device`] module. This crate holds every line of `unsafe` code in the
//! project; each `unsafe` block carries a `// SAFETY:` comment.
//!
//! - [`CudaDevice`]: the CUDA driver through cudarc 0.19, loaded dynamically. On a machine without
//!   `libcuda` every call returns [`DeviceError::Unavailable`]; none panics.
//! - [`SimDevice`]: a deterministic, host-only device with a capacity, a VMM granularity,
//!   driver-like address assignment, call counters, fault injection, graph capture with the
//!   driver's rules for which calls a capture refuses, and optional host backing.
//! - [`wrap`]: adaptors around any device (limit bytes, fail calls, count calls, log calls).
//! - [`fds`]: moving file descriptors (exported pages) between processes over a Unix socket.
//! - [`buffer`]: `Buffer<T>`, typed device memory from a pool that cudarc accepts as a
//!   `CudaSlice<T>`, and cuBLAS handles whose workspaces are such buffers.
//! - `nccl` (feature `nccl`, off by default): NCCL communicators, buffer registration and the
//!   collectives of the NCCL example, loaded dynamically.
//! - `ops` (feature `ops`, off by default): the length-checked kernels (NVRTC) and cuBLAS
//!   products of the example engine, and the driver pool's counters it compares with.

pub mod buffer;
pub mod cuda;
pub mod device;
pub mod fds;
pub mod ffi;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "ops")]
pub mod ops;
pub mod sim;
pub mod wrap;

pub use cuda::CudaDevice;
pub use device::{
    Call, CaptureMode, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr,
    PageHandle, StreamId, CAPTURED_EVENT, CAPTURE_INVALIDATED, CAPTURE_UNSUPPORTED,
    MALLOC_ALIGNMENT, NOT_EXPORTABLE,
};
pub use sim::{SimConfig, SimDevice};
