/*
 * cudalloc.h: the C ABI of cudalloc, a caching CUDA memory allocator (libcudalloc_capi.so).
 *
 * Build:  cargo build --release -p cudalloc-capi   ->  target/release/libcudalloc_capi.so
 * Link:   -I capi/include -L target/release -lcudalloc_capi   (or dlopen the library)
 *
 * PyTorch: cudalloc_malloc and cudalloc_free have the signatures that
 * torch.cuda.memory.CUDAPluggableAllocator(path, "cudalloc_malloc", "cudalloc_free") loads;
 * python/cudalloc_torch does that for you (see docs/pytorch.md).
 *
 * Devices and configuration
 *   There is one allocator per CUDA device, made on that device's first cudalloc_malloc,
 *   cudalloc_set_memory_fraction, cudalloc_enable_peer_access or JSON call. It uses the
 *   device's primary context (the one the CUDA runtime and PyTorch use); a call that needs the driver makes that context current
 *   and, before it returns, makes the calling thread's own context current again (none, if it
 *   had none), as PyTorch's allocator restores the device it found: no call changes which
 *   device the caller's CUDA work goes to. The configuration is read once per process, on the first call, from
 *   the environment variable CUDALLOC_CONF (PyTorch's PYTORCH_CUDA_ALLOC_CONF syntax plus
 *   cudalloc's keys, e.g. "policy:torch-expandable" or "policy:default,fragmentation_budget:0.05";
 *   unset: policy "default"). A bad configuration makes every call that reads it fail with the
 *   config error: cudalloc_check, cudalloc_malloc, cudalloc_free and cudalloc_record_stream (of
 *   a non-NULL pointer; cudalloc_free returns nothing, the reason is in cudalloc_last_error()),
 *   cudalloc_empty_cache, cudalloc_set_memory_fraction, cudalloc_reset_peak_stats, the JSON
 *   functions and cudalloc_memory_snapshot. Without a driver or a GPU these fail with "no CUDA device ...", except
 *   cudalloc_free and cudalloc_record_stream: they never make an allocator or open a device, and
 *   for a device that has no allocator yet (every device, without a GPU) they fail as for any
 *   pointer that is not a live allocation.
 *   cudalloc_set_malloc_failure_action, cudalloc_trace_start, cudalloc_trace_stop and
 *   cudalloc_last_error neither read it nor need a device (a trace started without one records
 *   its header line only).
 *
 * Errors
 *   Functions returning a pointer return NULL on failure (cudalloc_malloc also returns NULL,
 *   without an error, for 0 bytes), those returning int return 0 on
 *   success and -1 on failure, the JSON functions and cudalloc_memory_snapshot return 0 on
 *   failure. The reason is then in
 *   cudalloc_last_error(), per thread. No function unwinds into the caller, and none aborts
 *   unless cudalloc_set_malloc_failure_action(CUDALLOC_MALLOC_ABORT) asked a failed
 *   cudalloc_malloc to.
 *
 * Threads
 *   Every function may be called from any thread at any time.
 *
 * Pointer arguments (the caller's promise)
 *   - const char* arguments are NULL or NUL-terminated strings that stay valid and unchanged
 *     during the call;
 *   - a (char* buf, size_t len) pair is NULL, or memory writable for len bytes that no other
 *     thread touches during the call.
 *   Device pointers (void* ptr) and streams are never dereferenced on the host.
 */
#ifndef CUDALLOC_H
#define CUDALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA stream: the same value as cudaStream_t / CUstream (NULL: the legacy default stream).
 * Declared as void* so that this header does not need the CUDA headers; a cudaStream_t (a
 * pointer) converts to it implicitly in C and in C++. Cached memory is kept per stream handle,
 * so a handle must name one stream for every thread: cudaStreamPerThread (0x2) is refused (by
 * cudalloc_malloc and cudalloc_record_stream), since each thread has its own; in a program
 * built with --default-stream per-thread, pass a created stream rather than NULL. */
typedef void *cudalloc_stream_t;

/* Reads CUDALLOC_CONF and finds the driver and the devices, as the first call of any other
 * function would, without opening a device (no context is created). Returns the number of
 * devices, or -1 (bad config, no driver, no device) with the reason in cudalloc_last_error(). */
int cudalloc_check(void);

/* Allocates size bytes on device for use on stream. Returns the device pointer (aligned to at
 * least 256 bytes, like cudaMalloc), or NULL on any failure, out of memory included. size 0
 * returns NULL without allocating and without an error (as cudaMalloc and PyTorch's own
 * allocator hand out nothing for 0 bytes; freeing NULL is a no-op), unless device is bad. */
void *cudalloc_malloc(size_t size, int device, cudalloc_stream_t stream);

/* What cudalloc_malloc does when it fails, besides setting the last error. Returns the previous
 * action, or -1 for an unknown one. PyTorch's CUDAPluggableAllocator does not check the pointer
 * it gets (a NULL becomes a tensor at address 0 and a later "illegal memory access"), so
 * python/cudalloc_torch sets CUDALLOC_MALLOC_ABORT. */
#define CUDALLOC_MALLOC_RETURN_NULL 0 /* return NULL (the default) */
#define CUDALLOC_MALLOC_WARN 1        /* print the reason to stderr, return NULL */
#define CUDALLOC_MALLOC_ABORT 2       /* print the reason to stderr, abort the process */
int cudalloc_set_malloc_failure_action(int action);

/* Frees ptr, returned by cudalloc_malloc for device; device -1 means whichever device's
 * allocator holds ptr (for callers that keep only the pointer). NULL is ignored. size and stream are
 * accepted for PyTorch's signature and not needed (the allocator knows both). As in PyTorch's
 * caching allocator, the memory goes back to the pool of the allocation's stream, so work
 * already queued on that stream may still use it; streams declared with cudalloc_record_stream
 * are waited for first. A failure (ptr is not a live allocation of device) sets
 * cudalloc_last_error() and, if device has an allocator, counts in its stats
 * (capi.free_errors); with device -1, in those of the lowest-numbered device that has one. */
void cudalloc_free(void *ptr, size_t size, int device, cudalloc_stream_t stream);

/* Releases every cached, unused block of device to the driver (nothing to do for a device that
 * has not been used). 0 or -1. */
int cudalloc_empty_cache(int device);

/* Marks the live allocation ptr as used on stream too: once freed, its memory is reused only
 * after the work queued on stream up to its free has completed. 0 or -1. NULL (what a 0-byte
 * cudalloc_malloc returns) is ignored: 0. stream must belong to device's primary context (or
 * be a default stream): a stream of another device is refused (-1), since the event marking
 * its use could never be recorded on it. */
int cudalloc_record_stream(void *ptr, int device, cudalloc_stream_t stream);

/* Caps device's allocator at fraction (0 <= fraction <= 1) of the device's memory; requests
 * beyond the cap fail with out of memory. 0 or -1. */
int cudalloc_set_memory_fraction(double fraction, int device);

/* Resets every peak statistic of device to its current value (nothing to do for a device that
 * has not been used). 0 or -1. */
int cudalloc_reset_peak_stats(int device);

/* torch.cuda.reset_accumulated_memory_stats: from now on cudalloc_device_stats counts device's
 * accumulated values (every stat's allocated and freed, num_alloc_retries, num_ooms,
 * num_sync_all_streams, num_device_alloc, num_device_free) from zero; current and peak values
 * are untouched, and so is cudalloc_stats_json (counted since the process started). Nothing
 * to do for a device that has not been used. 0 or -1. */
int cudalloc_reset_accumulated_stats(int device);

/* Makes every page of device's allocator and of its private pools accessible from device peer
 * too: those mapped already and those mapped from now on (torch's enablePeerAccess(peer,
 * device); a kernel on peer reading device's memory needs it under the expandable policies,
 * whose pages are accessible only from the devices named). peer's context must have peer
 * access to device enabled (cudaDeviceEnablePeerAccess). 0 or -1: a peer that does not exist,
 * is device itself or cannot access it (cuDeviceCanAccessPeer) is refused, the peers as they
 * were; a grant the driver refuses leaves the peers as they were (call it again to grant
 * them all). */
int cudalloc_enable_peer_access(int device, int peer);

/* The fraction of device's memory its allocator is capped at: the cap over the device's total
 * memory, 1.0 without a cap (torch.cuda.get_per_process_memory_fraction); for a device not
 * used yet (not opened by this call) the configuration's per_process_memory_fraction, or 1.0;
 * -1.0 on failure. */
double cudalloc_memory_fraction(int device);

/* Statistics of device as a JSON object. Writes the JSON and a terminating NUL into buf if
 * len >= (returned length + 1); writes nothing otherwise (buf may be NULL with len 0). Always
 * returns the JSON's length without the NUL, so a caller can retry with a bigger buffer (the
 * length may grow between calls); 0 on failure.
 *
 * Every top-level integer is a torch.cuda.memory_stats() key ("allocated_bytes.all.peak",
 * "reserved_bytes.all.current", "num_ooms", ...). The allocator keeps streams in 64 shards,
 * each with its own statistics; the current values and counts are exact, and so is
 * "reserved_bytes.all.peak" (the most the device held for the allocator at once); any other
 * ".peak" is the sum of the shards' peaks (the reserved ones capped by the exact one), and a
 * block waiting in a thread cache counts in them until it leaves the cache: exact while one
 * stream (or several of one shard) allocates with thread caches off (thread_cache:False), an
 * upper bound otherwise. The other top-level entries:
 *   "policy":        the policy's name (string);
 *   "fragmentation": {"free_bytes", "largest_free_block", "external_fragmentation",
 *                     "utilisation", "mapped_bytes", "virtual_bytes",
 *                     "free_histogram": [[bucket_bytes, count, bytes], ...]};
 *   "driver_calls":  {"mallocs", "frees", "maps", "unmaps", "total", "device_waits",
 *                     "pages_moved", "given_back_bytes", "taken_back_bytes",
 *                     "lent_blocks", "lends_refused_busy"}: driver calls,
 *                    waits for the device, pages moved to a growth, bytes given back in
 *                    stream order and taken back before the device caught up (or
 *                    after their unmap failed), blocks lent across streams and lends
 *                    given up on a stream not found idle (lend_blocks:True);
 *   "excess":        {"reserved", "live", "rounding", "pending", "releasable", "pinned",
 *                     "stray", "pinned_pages"}: where the reserved bytes are now (read after
 *                    the rest): what live allocations asked for (blocks held in thread caches
 *                    count as live here), rounding, blocks waiting for other streams or pages
 *                    on their way back, free chunks the allocator could give back now, free
 *                    bytes sharing a chunk or segment with a block in use, pages whose release
 *                    failed (0 unless a driver call failed), and of the pinned bytes the whole
 *                    device pages no block in use touches; all but the last add up to
 *                    "reserved";
 *   "thread_cache":  {"hits", "blocks", "bytes"}: allocations served from per-thread caches so
 *                    far, blocks and bytes held there now (the torch keys count every
 *                    allocation and free, these included);
 *   "capi":          {"device", "free_errors", "private_pools": {"active", "retired",
 *                     "driver_calls", "device_waits"}}: the device, the failed cudalloc_free
 *                    calls, and the private pools in use, out of use and not yet dropped, and
 *                    the driver calls and device waits of every pool so far (dropped ones
 *                    included). */
size_t cudalloc_stats_json(int device, char *buf, size_t len);

/* device's torch.cuda.memory_stats() values (its private pools included; all zeros for a device
 * not used yet, which is not opened) as int64_t in native byte order, written into buf if
 * len >= the returned size (writes nothing otherwise; buf may be NULL with len 0). Returns the
 * size in bytes (CUDALLOC_DEVICE_STATS values of 8 bytes), 0 on failure. Cheaper than
 * cudalloc_stats_json (no snapshot, no JSON), for callers that ask often. The order: for each of
 * allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
 * inactive_split_bytes, requested_bytes, and for each of all, small_pool, large_pool: current,
 * peak, allocated, freed (108 values); then oversize_allocations and oversize_segments, each
 * current, peak, allocated, freed (8); then num_alloc_retries, num_ooms, num_sync_all_streams,
 * num_device_alloc, num_device_free, max_split_size (-1: no limit). */
#define CUDALLOC_DEVICE_STATS 122
size_t cudalloc_device_stats(int device, char *buf, size_t len);

/* Segments and blocks of device as JSON, with the same buffer protocol as cudalloc_stats_json:
 * {"device", "policy", "segments": [{"addr", "size", "mapped", "pool" ("small"|"large"),
 * "stream", "expandable", "tag" (the tag whose memory it is, or null), "blocks": [{"addr",
 * "size", "requested", "state", "stream"}]}]},
 * state one of "allocated", "pending_events", "free", "unmapped", "releasing" (free pages on
 * their way back to the device), "moved" (addresses whose pages moved to a growth of their
 * stream, unmapped once the device catches up; no memory of their own), "thread_cached" (freed
 * by the caller into a per-thread cache: not allocated, as the stats count it, and not free
 * either, for only that thread's next request of the same size and stream can have it). */
size_t cudalloc_snapshot_json(int device, char *buf, size_t len);

/* Segments and blocks of device in the shape of PyTorch's memory snapshot
 * (torch.cuda.memory_snapshot()), as plain structs: those of private pool (id0, id1) only, or,
 * for (0, 0), the device's own memory and every private pool's (each segment names its pool).
 * Writes them into buf if they fit in len bytes (writes nothing otherwise; buf may be NULL with
 * len 0) and returns their size in bytes, written or needed (it may grow between calls: retry
 * with a bigger buffer); 0 on failure. A device not used yet, or a pool it does not have, gives
 * a document with no segments (the header alone), and is not opened. buf must be aligned to 8
 * bytes (malloc's is). The document: a cudalloc_snapshot_header, then header.segments
 * cudalloc_segment, then header.blocks cudalloc_block; segments in address order, each
 * segment's blocks (block_count of them from index first_block) tiling it in address order.
 * As in PyTorch's snapshot a segment holds only memory backed by the device: an expandable
 * segment is reported as one segment per run of mapped pages (its unmapped addresses, and its
 * moved ones, whose pages another block holds, are in no segment), so total_size adds up to the
 * reserved bytes. PyTorch's block states: allocated
 * ("active_allocated"), pending events ("active_pending_free"), the others ("inactive"). */
#define CUDALLOC_SEGMENT_LARGE 1      /* flags: the large pool (else the small one) */
#define CUDALLOC_SEGMENT_EXPANDABLE 2 /* flags: part of an expandable segment */
#define CUDALLOC_BLOCK_ALLOCATED 1      /* handed out and not freed */
#define CUDALLOC_BLOCK_PENDING_EVENTS 2 /* freed, waiting for the work of other streams */
#define CUDALLOC_BLOCK_FREE 3           /* cached, free for any request */
#define CUDALLOC_BLOCK_RELEASING 4      /* free pages on their way back to the device */
#define CUDALLOC_BLOCK_THREAD_CACHED 5  /* freed into a per-thread cache (see snapshot_json) */
typedef struct cudalloc_snapshot_header {
    uint64_t segments; /* number of cudalloc_segment that follow */
    uint64_t blocks;   /* number of cudalloc_block after them */
} cudalloc_snapshot_header;
typedef struct cudalloc_segment { /* 64 bytes */
    uint64_t address;     /* first address */
    uint64_t total_size;  /* bytes of its blocks */
    uint64_t stream;      /* the cudaStream_t its memory belongs to, as an integer */
    uint64_t pool_id[2];  /* the private pool that owns it; {0, 0}: the device's own memory */
    uint64_t first_block; /* index of its first block among the blocks */
    uint64_t block_count; /* number of its blocks */
    int32_t device;
    int32_t flags; /* CUDALLOC_SEGMENT_LARGE, CUDALLOC_SEGMENT_EXPANDABLE */
} cudalloc_segment;
typedef struct cudalloc_block { /* 32 bytes */
    uint64_t address;
    uint64_t size;
    uint64_t requested_size; /* what its last caller asked for; 0 for a free block */
    int32_t state;           /* CUDALLOC_BLOCK_* */
    int32_t reserved;        /* 0 */
} cudalloc_block;
size_t cudalloc_memory_snapshot(int device, unsigned long long id0, unsigned long long id1,
                                char *buf, size_t len);

/* Starts recording device 0's allocations and frees to path, in cudalloc's trace format
 * (CSV "action,addr,size,stream,time_us"; gzip'd when path ends in ".gz"), for
 * `cudalloc replay`. The trace begins with an "alloc" at time 0 for every allocation live now;
 * then cudalloc_malloc writes "alloc" ("oom" when it runs out of memory), cudalloc_free writes
 * "free_requested" and "free_completed" (for an allocation given to cudalloc_record_stream on
 * another stream while the trace runs, "free_completed" when its block goes back to the pool,
 * after that stream's work); time_us counts from the start. Before the events of each
 * cudalloc_malloc that succeeds and each cudalloc_free that completes at once come the
 * device's answers to the event queries the allocator made in it (event_done, event_pending,
 * with the event's stream), which `cudalloc replay --answers` gives again. Other devices are not
 * recorded (the format has no device column). While a trace runs, device 0's cudalloc_malloc
 * and cudalloc_free calls (and cudalloc_record_stream and cudalloc_empty_cache) take one lock
 * each, across threads, so that the events are written in
 * the order they were served: threads allocating on device 0 at once wait for each other (the
 * allocator's per-stream and per-thread concurrency returns when the trace stops). 0 or -1 (a
 * trace is already running, the file cannot be created). */
int cudalloc_trace_start(const char *path);

/* Stops the trace and closes its file. Call it before the process exits: events are formatted
 * into 64 KiB buffers and written (and compressed) on a writer thread of the library, so
 * without it the last ones, up to about 2 MiB, are lost and a gzip'd trace is cut short.
 * 0 or -1 (no trace running, a write failed). */
int cudalloc_trace_stop(void);

/* Device 0's allocation history, kept in memory, for torch.cuda.memory._record_memory_history
 * and _dump_snapshot (python/cudalloc_torch does this for you). cudalloc_history_start keeps
 * the latest max_entries events (alloc, free_requested, free_completed, oom; "free_completed"
 * of an allocation used on another stream comes when its block goes back to the pool), starting
 * with an "alloc" for every allocation live now (the events kept from an earlier history are
 * dropped); a call while the history is kept changes max_entries (and clears when clear is
 * non-zero). It fails while a trace is recorded to a file (cudalloc_trace_start), and
 * cudalloc_trace_start fails while the history is kept. cudalloc_history_stop stops it; the
 * events stay readable until the next start; cudalloc_history_clear drops them. cudalloc_history_enabled: 1 while
 * kept, 0 otherwise.
 * cudalloc_memory_history writes a cudalloc_history_header then the events, oldest first, into
 * buf if they fit in len bytes, and returns the bytes they take (0 on failure; call it with a
 * NULL buf to learn the size). Recording takes one lock per call of device 0, as a trace does. */
typedef struct cudalloc_history_header {
    uint64_t events; /* number of cudalloc_event that follow */
} cudalloc_history_header;
typedef struct cudalloc_event { /* 40 bytes */
    uint64_t address; /* 0 for "oom" */
    uint64_t size;    /* bytes asked for */
    uint64_t stream;  /* the cudaStream_t, as an integer */
    uint64_t time_us; /* microseconds since the Unix epoch */
    int32_t action;   /* PyTorch's TraceEntry::Action: 0 alloc, 1 free_requested,
                         2 free_completed, 3 segment_alloc, 4 segment_free, 5 segment_map,
                         6 segment_unmap, 7 snapshot, 8 oom */
    int32_t device;
} cudalloc_event;
int cudalloc_history_start(uint64_t max_entries, int clear);
int cudalloc_history_stop(void);
int cudalloc_history_clear(void);
int cudalloc_history_enabled(void);
size_t cudalloc_memory_history(void *buf, size_t len);

/* The calling thread's last error: the message of its most recent failed cudalloc call (cut to
 * 1023 bytes), or "" if none has failed (a successful call does not clear it). Never NULL. The
 * string lives in per-thread storage that stays valid until the thread exits; a later failure
 * on the same thread overwrites it, so copy it before the next call if you need to keep it. */
const char *cudalloc_last_error(void);

/* CUDA graph captures: cudalloc_capture_begin tells the device's allocator and its private
 * pools that a stream of the device is being captured (call it once the capture runs, or before
 * it begins); until cudalloc_capture_end they poll no event, wait for nothing, give no memory
 * back and defer the events of frees after cudalloc_record_stream to the end, so that no call
 * the capture forbids is made. Growth maps pages or calls cuMemAlloc as usual: relax the
 * allocating thread's capture mode (cudaThreadExchangeStreamCaptureMode) around allocations for
 * the captured stream, as PyTorch's allocator does. cudalloc_empty_cache fails meanwhile.
 * Captures nest: each begin needs its end (call it after the capture ended). Both 0 or -1
 * (cudalloc_capture_end: also when no capture was begun). */
int cudalloc_capture_begin(int device);
int cudalloc_capture_end(int device);

/* Private pools: the memory of a CUDA graph or of a torch.cuda.MemPool, kept apart. A pool is
 * named by its device and two integers (PyTorch's MempoolId_t). Memory allocated from a pool is
 * never handed to an allocation outside it; it is freed with cudalloc_free (device -1 finds it)
 * and marked with cudalloc_record_stream like any other. Under the "default" policy a pool
 * follows "torch-expandable"'s rules (it grows by pages and gives nothing back while in use, so
 * that an allocation during a capture never waits for the device).
 *
 * cudalloc_pool_acquire makes the pool or counts one more use (a released id comes back with
 * its pool); cudalloc_pool_release counts one use less, and at none the pool takes no new
 * allocation. A pool in use keeps all its memory, freed blocks included (a graph's replays
 * write them): cudalloc_empty_cache leaves it alone. The memory of a pool out of use goes back
 * to the driver at cudalloc_empty_cache, at cudalloc_pool_empty_cache of that pool, or when a
 * cudalloc_malloc or cudalloc_pool_malloc runs out of memory (then it retries once; a pool
 * allocation also empties the device allocator's cache first), never inside a release or a
 * free.
 * cudalloc_pool_empty_cache on a device the library has not opened does nothing (nor opens
 * it; an ordinal no device has is still an error once the devices are counted).
 * cudalloc_pool_set_use_on_oom (PyTorch's MemPool(use_on_oom=True)): with on not 0, a pool in
 * use lends its cached memory: an allocation on the device (in a pool too) that runs out of
 * memory gives the pool's whole free chunks back to the driver and retries once. A chunk that
 * holds a live block stays (under "default" a chunk is a whole growth); nothing goes back
 * during a capture, nor from a pool an allocation during a capture came from, whose freed
 * blocks a graph's replays write; a released pool used again lends nothing. All 0 or -1.
 * cudalloc_pool_use_count: the uses (0: not in use), or -1. cudalloc_pool_malloc: like
 * cudalloc_malloc, from a pool in use; it never aborts (NULL, with the kind in
 * cudalloc_last_error_kind). cudalloc_pool_live: the number of live allocations of a pool in
 * use, -1 on failure; their addresses (uint64_t, native byte order) are written into buf when
 * they fit in len bytes. cudalloc_pool_blocks: the same for a checkpoint of the pool, four
 * uint64_t per allocation (address, block bytes, bytes requested, stream).
 * cudalloc_pool_allocate_at hands out again one block such a list named, at its address (CUDA
 * graph trees restore a pool so): the range must lie in one free block of the pool on that
 * stream; 0, or -1 with nothing handed out. cudalloc_device_stats counts the pools' memory with the device's (the
 * peaks then add up: an upper bound), the pools dropped so far included; cudalloc_stats_json
 * counts the device's own allocator only. */
int cudalloc_pool_acquire(int device, unsigned long long id0, unsigned long long id1);
int cudalloc_pool_release(int device, unsigned long long id0, unsigned long long id1);
int cudalloc_pool_use_count(int device, unsigned long long id0, unsigned long long id1);
int cudalloc_pool_empty_cache(int device, unsigned long long id0, unsigned long long id1);
int cudalloc_pool_set_use_on_oom(int device, unsigned long long id0, unsigned long long id1,
                                 int on);
void *cudalloc_pool_malloc(size_t size, int device, cudalloc_stream_t stream,
                           unsigned long long id0, unsigned long long id1);
long long cudalloc_pool_live(int device, unsigned long long id0, unsigned long long id1,
                             char *buf, size_t len);
long long cudalloc_pool_blocks(int device, unsigned long long id0, unsigned long long id1,
                               char *buf, size_t len);
int cudalloc_pool_allocate_at(int device, unsigned long long id0, unsigned long long id1,
                              void *ptr, size_t size, size_t requested,
                              cudalloc_stream_t stream);

/* Tags, sleep and wake. cudalloc_tag_push makes tag the calling thread's tag until the matching
 * cudalloc_tag_pop (tags nest; the innermost applies): that thread's cudalloc_malloc calls
 * allocate in it. A tag is 1 to 255 bytes of UTF-8 without a comma or a control character;
 * frees need none; private pools (cudalloc_pool_malloc) ignore it. Both 0 or -1 (a bad tag is
 * not pushed; a pop with none pushed fails). cudalloc_tag_depth: the tags pushed and not popped.
 * cudalloc_tag_current: the innermost tag's length (0: none), written NUL-terminated into buf
 * when it fits in len bytes.
 *
 * cudalloc_sleep gives the pages of the tags in the comma-separated list tags back to the
 * driver while their addresses stay reserved; the live allocations of the tags also in offload
 * (a list too; NULL or "" for none) are copied to pinned host memory first, on a stream of the
 * allocator's own after the work of every stream that used them, and come back at wake; the
 * others come back uninitialised. While a tag sleeps its allocations and
 * cudalloc_record_stream calls fail; a cudalloc_free of its memory is taken at once and the
 * block goes back to the tag at the wake. cudalloc_wake maps new pages at the same addresses and
 * copies the offloaded bytes back; work submitted afterwards to stream, or to a stream that
 * used the tag, runs after the copies (the host does not wait). Tags are done in list order;
 * a failure stops at the failed tag (those before it are done, those after it are not, it is
 * unchanged), with these kinds: CUDALLOC_ERROR_OUT_OF_MEMORY for a wake with no room even after
 * the retired private pools' caches went back, as for cudalloc_malloc (the tag stays asleep
 * and intact; retry once memory is freed), CUDALLOC_ERROR_SLEEP_INCOMPLETE for a
 * sleep that unmapped some pages but not all (the driver refused an unmap, or a wait for the
 * copies of later pages failed: the tag sleeps all the same, those pages still mapped;
 * cudalloc_sleep again retries them). Both need an expandable policy
 * (default or torch-expandable) and are refused during a capture. Each tag keeps its pinned
 * host buffer after a wake, for its next sleep: cudalloc_release_host_buffers frees those of
 * the awake tags. All 0 or -1. cudalloc_tag_stats_json: the tags' statistics as a JSON array,
 * written as cudalloc_stats_json writes (the length, or 0 on failure). */
int cudalloc_tag_push(const char *tag);
int cudalloc_tag_pop(void);
int cudalloc_tag_depth(void);
size_t cudalloc_tag_current(char *buf, size_t len);
int cudalloc_sleep(int device, const char *tags, const char *offload);
int cudalloc_wake(int device, const char *tags, cudalloc_stream_t stream);
int cudalloc_release_host_buffers(int device);
size_t cudalloc_tag_stats_json(int device, char *buf, size_t len);

/* The kind of the calling thread's last error, set together with its message: */
#define CUDALLOC_ERROR_NONE 0          /* no call on this thread has failed */
#define CUDALLOC_ERROR_OTHER 1         /* anything but out of memory */
#define CUDALLOC_ERROR_OUT_OF_MEMORY 2 /* cudalloc_malloc: the device, the cap or the address
                                          space had no room, or the request was larger than any
                                          device (PyTorch raises torch.OutOfMemoryError);
                                          cudalloc_wake: no room for a tag */
#define CUDALLOC_ERROR_SLEEP_INCOMPLETE 3 /* cudalloc_sleep: the tag sleeps, but some of its
                                             pages stay mapped */
int cudalloc_last_error_kind(void);

/* Sharing an allocation with another process on the same GPU (CUDA IPC over expandable
 * segments; docs/multi-gpu.md). The configuration needs "shareable_segments:True" (and an
 * expandable policy: "default" or "torch-expandable"); a device that cannot export memory as
 * POSIX file descriptors fails its first call with the config error.
 *
 * cudalloc_share describes the live allocation ptr of device: it fills *out and, when
 * out->num_pages <= capacity, fds[i] (one new descriptor per page, the caller's to send, e.g.
 * over a Unix socket with SCM_RIGHTS, and to close) and page_sizes[i]. It returns the number of
 * pages (nothing is exported when it exceeds capacity: call again with room), or -1 (an
 * allocation of a segment not made shareable: the message names the key to set). The pages may
 * hold other allocations' bytes too; the descriptors must be imported while the exporter holds
 * the allocation.
 *
 * cudalloc_open_shared, in the importing process, maps those pages on device (the same GPU):
 * fds and page_sizes hold num_pages entries (they stay the caller's); it returns the allocation's
 * pointer in this process, or NULL. The memory stays alive while it is open, even after the
 * exporter freed it or exited. cudalloc_close_shared unmaps it and releases the pages: 0 or -1.
 */
typedef struct cudalloc_shared {
    int device;              /* the exporter's device */
    unsigned long long segment; /* id of the allocation's segment, stable while it lives */
    unsigned long long offset;  /* bytes from the first page to the allocation */
    unsigned long long size;    /* the allocation's bytes */
    size_t num_pages;        /* pages behind it */
} cudalloc_shared_t;
long long cudalloc_share(void *ptr, int device, cudalloc_shared_t *out, int *fds,
                         unsigned long long *page_sizes, size_t capacity);
void *cudalloc_open_shared(int device, const cudalloc_shared_t *shared, const int *fds,
                           const unsigned long long *page_sizes, size_t num_pages);
int cudalloc_close_shared(void *ptr, int device);

/* Map hooks, for registering the allocator's memory with a library that wants it in advance
 * (NCCL's ncclCommRegister): mapped(user, device, addr, size) is called after memory is mapped
 * (or cudaMalloc'd) and before any of it is handed out; unmapping(user, device, addr, size)
 * before that same range is unmapped, nothing in it in use. Both run under the allocator's
 * lock: they must not call cudalloc. cudalloc_set_map_hooks sets them on device's allocator and
 * its private pools and announces every range already mapped; both NULL removes them (every
 * range is withdrawn first). 0 or -1. */
typedef void (*cudalloc_map_hook_t)(void *user, int device, unsigned long long addr,
                                    unsigned long long size);
int cudalloc_set_map_hooks(int device, cudalloc_map_hook_t mapped, cudalloc_map_hook_t unmapping,
                           void *user);

#ifdef __cplusplus
}
#endif

#endif /* CUDALLOC_H */
