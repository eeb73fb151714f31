//! # cudalloc-capi: the C ABI of cudalloc
//!
//! Builds `libcudalloc_capi.so` (`cargo build --release -p cudalloc-capi`), whose functions are
//! declared in `capi/include/cudalloc.h`. `cudalloc_malloc` and `cudalloc_free` have exactly the
//! signatures PyTorch's `torch.cuda.memory.CUDAPluggableAllocator` loads; the package
//! `python/cudalloc_torch` switches PyTorch over and reads the statistics.
//!
//! - One [`cudalloc_core::CachingAllocator`] per CUDA device, made on the first call that needs
//!   it and configured from `CUDALLOC_CONF`, read once per process (see `registry`). A bad
//!   config makes every call that reads it fail with the config error; without a driver or GPU
//!   every call that needs a device fails with "no CUDA device: ...". `cudalloc_free` and
//!   `cudalloc_record_stream` make no allocator: on a device without one, a pointer is not a
//!   live allocation.
//! - Every function is thread-safe and never unwinds into its caller: each body runs under
//!   `catch_unwind`; an error or a panic becomes the failure value (NULL, -1, 0) and the calling
//!   thread's last error (`cudalloc_last_error`).
//! - Tags (`cudalloc_tag_push`/`cudalloc_tag_pop`, see [`tags`]) are per thread: a thread's
//!   `cudalloc_malloc` calls allocate in its innermost tag, which `cudalloc_sleep` and
//!   `cudalloc_wake` put to sleep and wake by name.
//! - Traces (`cudalloc_trace_start`) record device 0's calls only (our trace format has no
//!   device column).
//!
//! ## Unsafe code
//!
//! The crate denies `unsafe_code`. The one exception is `#[no_mangle]` on the exported
//! functions (the lint counts it as unsafe, since two libraries exporting one name is undefined
//! behaviour at link time): each exported function allows it and is one call into `api`, which
//! is under the crate-wide `deny`. Pointers that C passes in are read and written by the types
//! of `cudalloc_sys::ffi` (`CStrArg`, `CBuf`/`CBufLen`), so every `unsafe` block stays in
//! `cudalloc-sys`. Device pointers and streams are only converted to and from integers.
//!
//! ## From Rust
//!
//! The crate is also an rlib, so Rust code and tests can call the exported functions directly;
//! output buffers come from [`with_c_buffer`], path arguments from [`CStrArg::new`].

#![deny(unsafe_code)]

mod accumulated;
mod api;
mod error;
pub mod json;
pub mod memory_snapshot;
#[cfg(test)]
mod oom_retry_tests;
mod pool_api;
mod pools;
mod registry;
#[cfg(test)]
mod review_tests;
mod share_api;
mod tag_api;
pub mod tags;
pub mod trace;

pub use cudalloc_sys::ffi::{
    with_c_arrays, with_c_arrays_mut, with_c_buffer, CArray, CArrayMut, CBuf, CBufLen, CCount, CIn,
    COut, CStrArg,
};
pub use error::last_error_message;
pub use share_api::{CMapHook, CShared};

use std::ffi::{c_char, c_int, c_void};

/// Allocates `size` bytes on `device` for use on `stream` (a `cudaStream_t`; NULL is the
/// legacy default stream). Returns the device pointer, or NULL on any failure (out of memory
/// included) with the reason in [`cudalloc_last_error`]. Zero bytes return NULL without
/// allocating (after the device is checked: a bad device is still a failure), as PyTorch's
/// own allocator does for empty tensors.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    api::malloc(size, device, stream)
}

/// [`cudalloc_set_malloc_failure_action`]: return NULL (the default).
pub const CUDALLOC_MALLOC_RETURN_NULL: c_int = 0;
/// [`cudalloc_set_malloc_failure_action`]: print the reason to stderr and return NULL.
pub const CUDALLOC_MALLOC_WARN: c_int = 1;
/// [`cudalloc_set_malloc_failure_action`]: print the reason to stderr and abort the process.
pub const CUDALLOC_MALLOC_ABORT: c_int = 2;

/// What [`cudalloc_malloc`] does when it fails, besides setting the last error: 0 returns NULL
/// (the default), 1 also prints the reason to stderr, 2 prints it and aborts the process (for
/// callers that cannot handle NULL, such as PyTorch's pluggable allocator). Returns the previous
/// action, or -1 for an unknown one.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_set_malloc_failure_action(action: c_int) -> c_int {
    api::set_malloc_failure_action(action)
}

/// Frees `ptr`, returned by [`cudalloc_malloc`] for `device` (-1: whichever device's allocator
/// holds it). NULL is ignored. `size` and
/// `stream` (PyTorch passes the allocation's) are not needed: the allocator knows both. A
/// failure (a pointer that is not live) sets [`cudalloc_last_error`] and, if `device` has an
/// allocator (this call never makes one), is counted in its stats (`capi.free_errors`); with
/// device -1, in those of the lowest-numbered device that has one.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    let _ = (size, stream);
    api::free(ptr, device)
}

/// Reads `CUDALLOC_CONF` and finds the driver and the devices, as the first call of any other
/// function would, without opening a device. Returns the number of devices, or -1 on failure
/// (a bad config, no driver, no device).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_check() -> c_int {
    api::check()
}

/// Returns every cached block of `device` that can go back to the driver, and the memory of
/// its private pools out of use (pools in use keep theirs); nothing to do for a device not used
/// yet. 0, or -1 on failure (a pool whose release the driver refused keeps its memory until a
/// later call; the other pools still give theirs back).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_empty_cache(device: c_int) -> c_int {
    api::empty_cache(device)
}

/// Marks the allocation at `ptr` as used on `stream` too: when freed, its block returns to the
/// pool only after the work queued on `stream` up to the free has completed. 0, or -1 on
/// failure (a stream of another device's context included). NULL (a 0-byte allocation) is
/// ignored: 0.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    api::record_stream(ptr, device, stream)
}

/// Caps `device`'s allocator at `fraction` (0..=1) of the device's memory. 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_set_memory_fraction(fraction: f64, device: c_int) -> c_int {
    api::set_memory_fraction(fraction, device)
}

/// Resets every peak statistic of `device` to its current value (nothing to do for a device not
/// used yet). 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_reset_peak_stats(device: c_int) -> c_int {
    api::reset_peak_stats(device)
}

/// PyTorch's `torch.cuda.reset_accumulated_memory_stats`: from now on `device`'s
/// [`cudalloc_device_stats`] count every stat's `allocated` and `freed` and the counters
/// `num_alloc_retries`, `num_ooms`, `num_sync_all_streams`, `num_device_alloc` and
/// `num_device_free` from zero (nothing to do for a device not used yet). 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_reset_accumulated_stats(device: c_int) -> c_int {
    api::reset_accumulated_stats(device)
}

/// Makes every page of `device`'s allocator, its private pools included, accessible from
/// device `peer` too: the pages mapped already and those mapped from now on (PyTorch's
/// `enablePeerAccess(peer, device)`, which a kernel on `peer` reading `device`'s memory needs
/// under the expandable policies; `peer`'s context must have peer access to `device` enabled,
/// `cudaDeviceEnablePeerAccess`). 0, or -1 on failure: a peer that does not exist, is `device`
/// or cannot access it is refused and changes nothing; a grant the driver refuses leaves the
/// peers as they were.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    api::enable_peer_access(device, peer)
}

/// The fraction of `device`'s memory its allocator is capped at (its limit over the device's
/// total memory; 1.0 without a cap), as PyTorch's `get_per_process_memory_fraction` reads it;
/// for a device not used yet (not opened) the configuration's fraction; -1.0 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_memory_fraction(device: c_int) -> f64 {
    api::memory_fraction(device)
}

/// Writes `device`'s statistics as NUL-terminated JSON into `buf` if they fit in `len` bytes
/// (NUL included); writes nothing otherwise. Returns the JSON's length without the NUL (retry
/// with a buffer of at least that plus one), or 0 on failure. See [`json`] for the keys.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_stats_json<'id>(
    device: c_int,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    api::stats_json(device, buf, len)
}

/// Writes `device`'s `torch.cuda.memory_stats()` values into `buf` as native-endian `int64_t`s,
/// in the order [`json::TORCH_VALUES`] describes, if they fit in `len` bytes; writes nothing
/// otherwise. Returns their size in bytes (written or needed), or 0 on failure. Cheaper than
/// [`cudalloc_stats_json`]: no snapshot, no JSON.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_device_stats<'id>(
    device: c_int,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    api::device_stats(device, buf, len)
}

/// Like [`cudalloc_stats_json`], for `device`'s segments and blocks.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_snapshot_json<'id>(
    device: c_int,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    api::snapshot_json(device, buf, len)
}

/// Writes `device`'s segments and blocks in the shape of PyTorch's memory snapshot (see
/// [`memory_snapshot`] for the layout) into `buf` if they fit in `len` bytes; writes nothing
/// otherwise. Private pool `(id0, id1)` only, or, for (0, 0), the device's own memory and every
/// private pool's. Returns the size in bytes (written or needed), or 0 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_memory_snapshot<'id>(
    device: c_int,
    id0: u64,
    id1: u64,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    api::memory_snapshot(device, (id0, id1), buf, len)
}

/// Starts recording device 0's allocations and frees to `path` in cudalloc's trace format
/// (gzip'd when the name ends in `.gz`), beginning with the allocations live now. 0, or -1 on
/// failure (a trace already running, a file that cannot be created).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_trace_start(path: CStrArg<'_>) -> c_int {
    api::trace_start(path)
}

/// Stops the trace and closes its file. 0, or -1 on failure (no trace running, a write error).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_trace_stop() -> c_int {
    api::trace_stop()
}

/// Starts keeping device 0's allocation history in memory: its latest `max_entries` events
/// (`alloc`, `free_requested`, `free_completed`, `oom`), beginning with an `alloc` for each
/// allocation live now, as PyTorch's `torch.cuda.memory._record_memory_history` does (the
/// events kept from an earlier history are dropped); while the history is being kept, a call
/// changes `max_entries` (and clears when `clear` is non-zero). 0, or -1 on failure (a trace
/// is being recorded to a file).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_history_start(max_entries: u64, clear: c_int) -> c_int {
    api::history_start(max_entries, clear)
}

/// Stops keeping the history; its events stay readable until the next start or clear. 0, or
/// -1 when none is being kept.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_history_stop() -> c_int {
    api::history_stop()
}

/// Drops the history's events (kept or being kept). 0.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_history_clear() -> c_int {
    api::history_clear()
}

/// 1 while the history is being kept, 0 otherwise.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_history_enabled() -> c_int {
    api::history_enabled()
}

/// Writes the history's events (`cudalloc.h`: a `cudalloc_history_header`, then the
/// `cudalloc_event`s, oldest first) into `buf` if they fit in `len` bytes; returns the bytes
/// they take (call with a NULL `buf` to learn it), or 0 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `api`.
#[no_mangle]
pub extern "C" fn cudalloc_memory_history<'id>(buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    api::memory_history(buf, len)
}

/// Tells device `device`'s allocator and its private pools that a CUDA graph capture begins
/// (call it once a stream of the device is being captured, or before the capture begins):
/// until [`cudalloc_capture_end`], they poll no event, wait for nothing, give no memory back,
/// and defer the events of frees after [`cudalloc_record_stream`] to the end; growth maps
/// pages or calls `cuMemAlloc` as usual (the caller relaxes the allocating thread's capture
/// mode around allocations for the captured stream), and [`cudalloc_empty_cache`] fails.
/// Captures nest: each begin needs its end. 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_capture_begin(device: c_int) -> c_int {
    pool_api::capture_begin(device)
}

/// Ends a capture begun with [`cudalloc_capture_begin`] (call it after the capture ended):
/// frees deferred during it start waiting for their streams' work. Every allocator of the
/// device ends it, even after one fails. 0, or -1 on failure (a device with no capture begun
/// included).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_capture_end(device: c_int) -> c_int {
    pool_api::capture_end(device)
}

/// Makes device `device`'s private pool `(id0, id1)` (PyTorch's `MempoolId_t`) or counts one
/// more use of it. Memory allocated from a private pool ([`cudalloc_pool_malloc`]) is never
/// handed to an allocation outside it. 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_acquire(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_api::acquire(device, (id0, id1))
}

/// Counts one use of a private pool less; at none the pool takes no new allocations and its
/// memory goes back to the driver once none of it is live. 0, or -1 on failure (a pool not in
/// use).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_release(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_api::release(device, (id0, id1))
}

/// Gives the memory of private pool `(id0, id1)` back to the driver if the pool is out of use
/// (a pool in use keeps its memory: a graph's replays write its freed blocks); waits for the
/// device. A device the library has not opened holds no pool: nothing is done, and it is not
/// opened. 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_empty_cache(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_api::empty_cache(device, (id0, id1))
}

/// Sets whether private pool `(id0, id1)`, which must be in use, lends its cached memory
/// (PyTorch's `MemPool(use_on_oom=True)`): when `on` is not 0, an allocation on the device
/// that runs out of memory gives the pool's whole free chunks back to the driver and tries once
/// more (a chunk holding a live block stays; nothing is given back during a capture, nor by a
/// pool a capture allocated from). A retired pool used again lends nothing until set again.
/// 0, or -1 on failure (a pool not in use).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_set_use_on_oom(
    device: c_int,
    id0: u64,
    id1: u64,
    on: c_int,
) -> c_int {
    pool_api::set_use_on_oom(device, (id0, id1), on)
}

/// The uses of a private pool (0: not in use), or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_use_count(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_api::use_count(device, (id0, id1))
}

/// Like [`cudalloc_malloc`], from private pool `(id0, id1)`, which must be in use. Never aborts:
/// NULL with the reason in [`cudalloc_last_error`] and its kind in
/// [`cudalloc_last_error_kind`]. Freed by [`cudalloc_free`] like any other allocation.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    id0: u64,
    id1: u64,
) -> *mut c_void {
    pool_api::malloc(size, device, stream, (id0, id1))
}

/// The live allocations of a private pool: their addresses as native-endian `uint64_t`s written
/// into `buf` if they fit in `len` bytes (nothing written otherwise). Returns their number, or
/// -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_live<'id>(
    device: c_int,
    id0: u64,
    id1: u64,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> i64 {
    pool_api::live(device, (id0, id1), buf, len)
}

/// The live allocations of a private pool in use, for a checkpoint of it: four native-endian
/// `uint64_t`s each (address, block bytes, bytes requested, stream), written into `buf` if they
/// all fit in `len` bytes (nothing written otherwise). Returns their number, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_blocks<'id>(
    device: c_int,
    id0: u64,
    id1: u64,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> i64 {
    pool_api::blocks(device, (id0, id1), buf, len)
}

/// Hands out `size` bytes at `ptr` from private pool `(id0, id1)`, in use, for a caller that
/// asked for `requested` bytes on `stream`: one block of a checkpoint that
/// [`cudalloc_pool_blocks`] listed, handed out again where it was (CUDA graph trees restoring
/// a pool). The range must lie in one free block of the pool on that stream. Freed by
/// [`cudalloc_free`] like any other allocation. 0, or -1 on failure (nothing handed out).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `pool_api`.
#[no_mangle]
pub extern "C" fn cudalloc_pool_allocate_at(
    device: c_int,
    id0: u64,
    id1: u64,
    ptr: *mut c_void,
    size: usize,
    requested: usize,
    stream: *mut c_void,
) -> c_int {
    let range = [ptr as usize as u64, size as u64, requested as u64];
    pool_api::allocate_at(device, (id0, id1), range, stream)
}

/// Makes `tag` the calling thread's tag: its [`cudalloc_malloc`] calls allocate in that tag
/// (which sleeps and wakes as one, [`cudalloc_sleep`]) until the matching [`cudalloc_tag_pop`];
/// tags nest, the innermost applies. A tag is 1 to 255 bytes of UTF-8 without a comma or a
/// control character. Frees need no tag. Private pools ([`cudalloc_pool_malloc`]) ignore it.
/// 0, or -1 on failure (NULL, a bad tag; nothing pushed).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_tag_push(tag: CStrArg<'_>) -> c_int {
    tag_api::tag_push(tag)
}

/// Drops the calling thread's innermost tag (the one pushed before it applies again). 0, or -1
/// when none was pushed.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_tag_pop() -> c_int {
    tag_api::tag_pop()
}

/// How many tags the calling thread has pushed and not popped (0: its allocations are
/// untagged). Never fails.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_tag_depth() -> c_int {
    tag_api::tag_depth()
}

/// Writes the calling thread's innermost tag, NUL-terminated, into `buf` if it fits in `len`
/// bytes (NUL included; nothing written otherwise). Returns its length without the NUL, or 0
/// when the thread has no tag. Never fails.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_tag_current<'id>(buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    tag_api::tag_current(buf, len)
}

/// Puts the tags of the comma-separated list `tags` to sleep on `device`, in order: their
/// pages go back to the driver, their addresses stay reserved; the live allocations of the tags
/// also in `offload` (a list too; NULL or "": none) are first copied to pinned host memory and
/// come back at wake, the others come back uninitialised. Allocations and
/// `cudalloc_record_stream` of a sleeping tag fail until it wakes; a free of its memory is taken
/// at once, and the block goes back to the tag at the wake. 0, or -1 on failure: the
/// tags before the failed one sleep, those after it do not, and the failed one is unchanged,
/// except for [`CUDALLOC_ERROR_SLEEP_INCOMPLETE`] (see [`cudalloc_last_error_kind`]), after
/// which it sleeps with some pages still mapped (calling this again retries them).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_sleep(device: c_int, tags: CStrArg<'_>, offload: CStrArg<'_>) -> c_int {
    tag_api::sleep(device, tags, offload)
}

/// Wakes the tags of the comma-separated list `tags` on `device`, in order: new pages at the
/// same addresses and the offloaded bytes copied back; work submitted afterwards to `stream`,
/// or to a stream that used a tag's memory, runs after the copies (the host does not wait). A
/// wake with no room tries once more after the retired private pools' caches went back, as
/// `cudalloc_malloc` does; then it fails with [`CUDALLOC_ERROR_OUT_OF_MEMORY`] and leaves that
/// tag asleep and intact (the tags before it are awake); calling it again once memory was freed
/// succeeds.
/// 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_wake(device: c_int, tags: CStrArg<'_>, stream: *mut c_void) -> c_int {
    tag_api::wake(device, tags, stream)
}

/// Frees the pinned host buffers that `device`'s awake tags keep for their next offloading
/// sleep. 0, or -1 on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_release_host_buffers(device: c_int) -> c_int {
    tag_api::release_host_buffers(device)
}

/// Writes `device`'s per-tag statistics as NUL-terminated JSON (an array, see [`json`]) into
/// `buf` if they fit in `len` bytes, as [`cudalloc_stats_json`] does; the JSON's length, or 0
/// on failure.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `tag_api`.
#[no_mangle]
pub extern "C" fn cudalloc_tag_stats_json<'id>(
    device: c_int,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    tag_api::tag_stats_json(device, buf, len)
}

/// [`cudalloc_last_error_kind`]: no call on this thread has failed.
pub const CUDALLOC_ERROR_NONE: c_int = error::ErrorKind::None as c_int;
/// [`cudalloc_last_error_kind`]: a failure other than out of memory.
pub const CUDALLOC_ERROR_OTHER: c_int = error::ErrorKind::Other as c_int;
/// [`cudalloc_last_error_kind`]: out of memory (the device, the cap or the address space had
/// no room, or the request was larger than any device).
pub const CUDALLOC_ERROR_OUT_OF_MEMORY: c_int = error::ErrorKind::OutOfMemory as c_int;
/// [`cudalloc_last_error_kind`]: [`cudalloc_sleep`] left the tag asleep with some pages still
/// mapped (an unmap refused, or a failed wait for the copies of later pages).
pub const CUDALLOC_ERROR_SLEEP_INCOMPLETE: c_int = error::ErrorKind::SleepIncomplete as c_int;

/// The kind of the calling thread's last error, set with its message: [`CUDALLOC_ERROR_NONE`]
/// if no call on this thread has failed, [`CUDALLOC_ERROR_OUT_OF_MEMORY`] for a
/// `cudalloc_malloc` or a [`cudalloc_wake`] that ran out of memory,
/// [`CUDALLOC_ERROR_SLEEP_INCOMPLETE`] for an incomplete [`cudalloc_sleep`],
/// [`CUDALLOC_ERROR_OTHER`] for anything else.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `error`.
#[no_mangle]
pub extern "C" fn cudalloc_last_error_kind() -> c_int {
    error::last_error_kind()
}

/// The calling thread's last error: the message of its most recent failed cudalloc call (cut to
/// 1023 bytes), or "" if none failed (successful calls do not clear it). Never NULL; the
/// per-thread storage stays valid until the thread exits and is overwritten by later failures.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `error`.
#[no_mangle]
pub extern "C" fn cudalloc_last_error() -> *const c_char {
    error::last_error_ptr()
}

/// Describes the live allocation `ptr` of `device` for another process: fills `*out` and, when
/// its pages fit in `capacity` entries, `fds` (one new descriptor per page, the caller's to send
/// and close) and `page_sizes`. Returns the number of pages (nothing exported when it is more
/// than `capacity`: call again with room for them), or -1 (an allocation of a segment not made
/// shareable names the config key to set in [`cudalloc_last_error`]).
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `share_api`.
#[no_mangle]
pub extern "C" fn cudalloc_share<'id>(
    ptr: *mut c_void,
    device: c_int,
    out: COut<'_, CShared>,
    fds: CArrayMut<'id, c_int>,
    page_sizes: CArrayMut<'id, u64>,
    capacity: CCount<'id>,
) -> i64 {
    share_api::share(ptr, device, out, fds, page_sizes, capacity)
}

/// Opens on `device` (the exporter's GPU) an allocation another process described with
/// [`cudalloc_share`]: imports its `num_pages` pages from `fds` (which stay the caller's) and
/// maps them. Returns the allocation's pointer in this process, or NULL.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `share_api`.
#[no_mangle]
pub extern "C" fn cudalloc_open_shared<'id>(
    device: c_int,
    shared: CIn<'_, CShared>,
    fds: CArray<'id, c_int>,
    page_sizes: CArray<'id, u64>,
    num_pages: CCount<'id>,
) -> *mut c_void {
    share_api::open(device, shared, fds, page_sizes, num_pages)
}

/// Unmaps an allocation [`cudalloc_open_shared`] opened (`ptr`, on `device`) and releases its
/// pages (the memory goes back to the driver once no process holds it). 0 or -1.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `share_api`.
#[no_mangle]
pub extern "C" fn cudalloc_close_shared(ptr: *mut c_void, device: c_int) -> c_int {
    share_api::close(ptr, device)
}

/// Sets the map hooks of `device`'s allocator and its private pools: `mapped(user, device,
/// addr, size)` after memory is mapped and before any of it is handed out, `unmapping(...)`
/// before it is unmapped; the ranges already mapped are announced at once. Both NULL removes
/// them (withdrawing every range). 0 or -1.
#[allow(unsafe_code)] // `#[no_mangle]` only: the body is one call into `share_api`.
#[no_mangle]
pub extern "C" fn cudalloc_set_map_hooks(
    device: c_int,
    mapped: Option<CMapHook>,
    unmapping: Option<CMapHook>,
    user: *mut c_void,
) -> c_int {
    share_api::set_map_hooks(device, mapped, unmapping, user)
}
