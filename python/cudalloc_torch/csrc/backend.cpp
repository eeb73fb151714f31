// cudalloc's PyTorch backend: a c10 CUDA allocator that forwards every call to the C ABI of
// libcudalloc_capi (capi/include/cudalloc.h). It holds no allocator logic; it translates:
//
//   - allocate / raw_alloc: cudalloc_malloc on the current device and stream; out of memory
//     becomes c10::OutOfMemoryError (torch.OutOfMemoryError in Python), any other failure
//     c10::Error (RuntimeError), never a null pointer handed on;
//   - the deleter and raw_delete: cudalloc_free with device -1 (the library finds the owner);
//   - recordStream (Tensor.record_stream): cudalloc_record_stream, for memory of this allocator;
//   - getDeviceStats, resetPeakStats, resetAccumulatedStats, emptyCache, setMemoryFraction,
//     getMemoryFraction, cacheInfo, snapshot, recordHistory: the library's statistics,
//     segments, history and controls, so that torch.cuda.memory_stats(),
//     torch.cuda.memory_snapshot(), torch.cuda.memory._record_memory_history() and friends
//     report cudalloc, and (register_device_allocator) so do the torch.accelerator ones;
//   - attachOutOfMemoryObserver: the observers are called before an out-of-memory is raised,
//     as PyTorch's allocator calls them;
//   - enablePeerAccess and memcpyAsync: a device that reads another's tensors gets access to
//     their pages (cudalloc_enable_peer_access: a mapped page is accessible only from the
//     devices named), and a copy between devices without peer access goes through
//     cudaMemcpyPeerAsync, as PyTorch's allocator does for its own mapped pages;
//   - private pools (torch.cuda.graph, graph_pool_handle, CUDA graph trees, torch.cuda.MemPool):
//     the library's cudalloc_pool_* functions; allocations go to a pool while PyTorch's stream
//     filter for it says so, and during a capture in relaxed capture mode, as PyTorch's own
//     allocator allocates, so that a capture is never invalidated by an allocation; the first
//     allocation that finds its stream being captured tells the library of that capture
//     (cudalloc_capture_begin, once per capture id), and the first endAllocateToPool,
//     allocation while a route is active, emptyCache or beginAllocateToPool after the capture
//     ended ends it (cudalloc_capture_end), so that meanwhile no allocator of the device polls
//     an event, waits or gives memory back. A capture that fails (CUDAGraph::capture_end
//     throws before it calls endAllocateToPool) ends there too, and so does its route (see
//     routes.h); its private pool stays acquired (nothing calls releasePool).
//
// library.h holds the library's function table and the error helpers, snapshot.h the
// translation of the snapshot and history documents, checkpoint.h the checkpoints of private
// pools (CUDA graph trees), observers.h the out-of-memory observers, sharing.h and ipc.h the
// sharing of tensors between processes (torch.multiprocessing); with routes.h they make one
// translation unit.
//
// It derives from PyTorch's CUDAPluggableAllocator for the members it does not override (those
// raise PyTorch's "not supported" error). The library's functions are passed in as addresses
// by Python (ctypes), so that this module and cudalloc_torch's ctypes calls use one copy.

#include <pybind11/stl.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "library.h"
#include "ipc.h"
#include "checkpoint.h"
#include "observers.h"
#include "routes.h"
#include "sharing.h"
#include "snapshot.h"

namespace cudalloc_torch {
namespace {

// Guards `routes` and `told`.
std::mutex routes_mutex;

// A CUDA graph capture the library was told of (cudalloc_capture_begin): its id, its device,
// and a stream it captures, to ask whether it still runs.
struct Told {
  unsigned long long id;
  c10::DeviceIndex device;
  cudaStream_t stream;
};
std::vector<Told> told;  // guarded by routes_mutex

// The id of the capture `stream` is part of, or 0 when it is not being captured (or the query
// failed).
unsigned long long capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (!queried(cudaStreamGetCaptureInfo(stream, &status, &id)) ||
      status == cudaStreamCaptureStatusNone) {
    return 0;
  }
  return id;
}

// The private pools allocations go to (routes.h; their pools stay acquired when a capture's
// route is pruned: releasePool gives them back).
Routes<cudaStream_t, c10::cuda::MempoolId_t> routes{capture_id};

// Ends (cudalloc_capture_end) each told capture whose stream is no longer in it: the capture
// ended or failed, whichever route or path saw it end; then prunes the routes. A failed end is
// reported, not raised: the library ends the capture all the same. Caller holds routes_mutex.
void end_finished_captures() {
  routes.prune();
  for (auto it = told.begin(); it != told.end();) {
    if (capture_id(it->stream) == it->id) {
      ++it;
      continue;
    }
    const c10::DeviceIndex device = it->device;
    it = told.erase(it);
    if (lib.capture_end(device) != 0) {
      report("capture_end failed: " + last_error());
    }
  }
}

// `stream`, of `device`, is being captured: tells the library once per capture, so that
// meanwhile no allocator of the device polls an event, waits or gives memory back.
void tell_capture(c10::DeviceIndex device, cudaStream_t stream) {
  const unsigned long long id = capture_id(stream);
  std::lock_guard<std::mutex> lock(routes_mutex);
  end_finished_captures();
  if (id == 0) {
    return;
  }
  for (const Told& t : told) {
    if (t.id == id && t.device == device) {
      return;
    }
  }
  if (lib.capture_begin(device) != 0) {
    fail(CUDALLOC_HERE, "capture_begin failed: " + last_error());
  }
  told.push_back(Told{id, device, stream});
}

// The pool an allocation on `stream` goes to, if a route takes it. Told captures and routes
// that are over go first.
std::optional<c10::cuda::MempoolId_t> route(c10::DeviceIndex device, cudaStream_t stream) {
  if (routes.empty()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(routes_mutex);
  end_finished_captures();
  return routes.find(device, stream);
}

// While `stream` is being captured into a CUDA graph, switches the calling thread to relaxed
// capture mode, as PyTorch's allocator does around cudaMalloc, so that the driver calls an
// allocation may make (cuMemAlloc, cuMemMap ...) do not invalidate the capture; restores the
// mode on destruction.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    on_ = queried(cudaStreamIsCapturing(stream, &status)) &&
        status != cudaStreamCaptureStatusNone;
    if (on_) {
      cudaThreadExchangeStreamCaptureMode(&mode_);
    }
  }
  bool on() const {
    return on_;
  }
  ~RelaxedCapture() {
    if (on_) {
      cudaThreadExchangeStreamCaptureMode(&mode_);
    }
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  bool on_ = false;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

void* library_malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  if (routes.empty()) {
    return lib.malloc(size, device, stream);
  }
  RelaxedCapture relaxed(stream);
  if (relaxed.on()) {
    tell_capture(device, stream);
  }
  if (auto pool = route(device, stream)) {
    return lib.pool_malloc(size, device, stream, pool->first, pool->second);
  }
  return lib.malloc(size, device, stream);
}

// cudalloc_malloc (or cudalloc_pool_malloc), with its failure raised as PyTorch raises its own.
void* checked_malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  if (size == 0) {
    return nullptr;  // nothing is handed out for 0 bytes, as PyTorch's allocator does
  }
  void* p = library_malloc(size, device, stream);
  if (p != nullptr) {
    return p;
  }
  const std::string where = std::to_string(size) + " bytes on device " +
      std::to_string(static_cast<int>(device));
  if (lib.last_error_kind() == kOutOfMemory) {
    const std::string message =
        "CUDA out of memory. Tried to allocate " + where + " (cudalloc): " + last_error();
    tell_observers(size, device);
    throw c10::OutOfMemoryError(CUDALLOC_HERE, message);
  }
  fail(CUDALLOC_HERE, "could not allocate " + where + ": " + last_error());
}

// A private pool's live allocations, sorted.
std::vector<uint64_t> pool_live(c10::DeviceIndex device, const c10::cuda::MempoolId_t& pool) {
  std::vector<uint64_t> live;
  for (const PoolBlock& b : pool_blocks(device, pool)) {
    live.push_back(b[0]);  // pool_blocks sorts by address first
  }
  return live;
}

void fill(c10::CachingDeviceAllocator::Stat& s, const int64_t*& v) {
  s.current = *v++;
  s.peak = *v++;
  s.allocated = *v++;
  s.freed = *v++;
}

class Allocator : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  Allocator()
      : CUDAPluggableAllocator(
            [](size_t size, int device, cudaStream_t stream) {
              return checked_malloc(size, static_cast<c10::DeviceIndex>(device), stream);
            },
            [](void* ptr, size_t, int, cudaStream_t) { free_pointer(ptr); }) {}

  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* p = checked_malloc(size, device, stream);
    return {p, p, &free_pointer, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pointer;
  }

  void* raw_alloc(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return checked_malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    return checked_malloc(size, c10::cuda::current_device(), stream);
  }

  void raw_delete(void* ptr) override {
    free_pointer(ptr);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Memory of another allocator (a tensor made with from_blob, say) is not ours to track,
    // as PyTorch's own allocator ignores it too.
    if (ptr.get() == nullptr || ptr.get_deleter() != &free_pointer) {
      return;
    }
    check(lib.record_stream(ptr.get(), ptr.device().index(), stream.stream()),
          "record_stream");
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::vector<int64_t> values(kDeviceStats);
    const size_t bytes = values.size() * sizeof(int64_t);
    const size_t got =
        lib.device_stats(device, reinterpret_cast<char*>(values.data()), bytes);
    if (got != bytes) {
      fail(CUDALLOC_HERE, "device_stats failed: " + last_error());
    }
    c10::CachingDeviceAllocator::DeviceStats out;
    const int64_t* v = values.data();
    for (auto* array : {&out.allocation, &out.segment, &out.active, &out.inactive_split,
                        &out.allocated_bytes, &out.reserved_bytes, &out.active_bytes,
                        &out.inactive_split_bytes, &out.requested_bytes}) {
      for (auto& stat : *array) {
        fill(stat, v);
      }
    }
    fill(out.oversize_allocations, v);
    fill(out.oversize_segments, v);
    out.num_alloc_retries = *v++;
    out.num_ooms = *v++;
    out.num_sync_all_streams = *v++;
    out.num_device_alloc = *v++;
    out.num_device_free = *v++;
    out.max_split_size = *v++;
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(lib.reset_peak_stats(device), "reset_peak_stats");
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(lib.reset_accumulated_stats(device), "reset_accumulated_stats");
  }

  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex);
    observers.push_back(std::move(observer));
  }

  // torch.cuda.empty_cache() passes {0, 0}: the devices' cached memory and the private pools
  // out of use go back (pools in use keep theirs), inside a use_mem_pool block too (PyTorch's
  // allocator keeps the device's cached blocks there). Nothing is released while a capture is
  // underway (a capture's route, or a capture the library was told of), since releasing
  // memory waits for the device, which a capture forbids; a capture begun outside
  // torch.cuda.graph that has allocated nothing yet is seen by neither. MemPool's destructor
  // passes its pool: that pool's memory goes back if it is out of use, on whichever device it
  // is (every device is asked, as PyTorch's allocator asks each; one the library has not
  // opened is left alone); from a destructor, a failure is reported, not thrown.
  void emptyCache(c10::cuda::MempoolId_t pool) override {
    if (pool.first != 0 || pool.second != 0) {
      const int n = c10::cuda::device_count();
      for (int d = 0; d < n; ++d) {
        if (lib.pool_empty_cache(d, pool.first, pool.second) != 0) {
          report("pool_empty_cache failed: " + last_error());
        }
      }
      return;
    }
    // The lock is held through the release, so that no capture begins its route meanwhile.
    std::lock_guard<std::mutex> lock(routes_mutex);
    end_finished_captures();
    if (routes.any_scoped() || !told.empty()) {
      return;
    }
    const int n = c10::cuda::device_count();
    for (int d = 0; d < n; ++d) {
      check(lib.empty_cache(d), "empty_cache");
    }
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(lib.set_memory_fraction(fraction, device), "set_memory_fraction");
  }

  // PyTorch calls it before a kernel on `dev` reads memory of `dev_to_access` (get_p2p_access):
  // the driver's peer access, as the base enables it, then the pages of `dev_to_access`'s
  // allocator, mapped before and after, made accessible from `dev`.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    check(lib.enable_peer_access(dev_to_access, dev), "enable_peer_access");
  }

  // With peer access the copy engines reach the pages; without it only the peer copy does
  // (cudaMemcpyAsync between devices fails on mapped pages that the other device cannot
  // access).
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    const double fraction = lib.memory_fraction(device);
    if (fraction < 0.0) {
      fail(CUDALLOC_HERE, "memory_fraction failed: " + last_error());
    }
    return fraction;
  }

  // PyTorch's contract: *largest_block is in and out; 0 on entry means "start from the
  // device's free memory". Out: the larger of that and the largest cached free block.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    if (*largest_block == 0) {
      size_t free = 0;
      size_t total = 0;
      if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
        *largest_block = free;
      }
    }
    std::string json;
    size_t n = 0;
    do {  // the document may grow between the size and the fill
      json.assign(lib.stats_json(device, nullptr, 0) + 64, '\0');
      n = lib.stats_json(device, json.data(), json.size());
      if (n == 0) {
        fail(CUDALLOC_HERE, "stats failed: " + last_error());
      }
    } while (n >= json.size());
    const char* key = "\"largest_free_block\":";
    const size_t at = json.find(key);
    if (at == std::string::npos) {
      fail(CUDALLOC_HERE, "no largest_free_block in the stats");
    }
    const size_t cached = std::strtoull(json.c_str() + at + std::strlen(key), nullptr, 10);
    *largest_block = std::max(*largest_block, cached);
  }

  // torch.cuda.memory_snapshot() and torch.cuda.memory._snapshot(): every device's segments
  // and blocks, the private pools' included (each names its pool), or those of `pool` only,
  // and with include_traces the history kept since torch.cuda.memory._record_memory_history
  // (device 0's: the library records one device). No stack frames; of the allocator settings
  // only max_split_size is filled in.
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t pool,
                                                         bool include_traces) override {
    c10::cuda::CUDACachingAllocator::SnapshotInfo info{};
    const int n = c10::cuda::device_count();
    for (int d = 0; d < n; ++d) {
      add_segments(d, pool, info.segments);
    }
    if (include_traces) {
      std::lock_guard<std::mutex> lock(history_mutex);
      info.device_traces = device_traces(n, skip_actions);
    }
    const int64_t max_split = getDeviceStats(c10::cuda::current_device()).max_split_size;
    info.config_metadata.max_split_size =
        max_split > 0 ? static_cast<size_t>(max_split) : std::numeric_limits<size_t>::max();
    return info;
  }

  // torch.cuda.memory._record_memory_history: the library keeps the latest max_entries events
  // of device 0 (alloc, free_requested, free_completed, oom); stack frames are not recorded
  // (the context recorder is not called), and skip_actions leave those actions out of the
  // snapshot's trace. _record_memory_history(enabled=None) stops and drops the events, as
  // PyTorch's allocator does.
  void recordHistory(
      bool enabled,
      c10::cuda::CUDACachingAllocator::CreateContextFn /*context_recorder*/,
      size_t max_entries,
      c10::cuda::CUDACachingAllocator::RecordContext /*when*/,
      bool clear,
      const std::vector<std::string>& skip) override {
    std::lock_guard<std::mutex> lock(history_mutex);
    if (enabled) {
      check(lib.history_start(max_entries, clear ? 1 : 0), "history_start");
      skip_actions.clear();
      for (const std::string& name : skip) {
        skip_actions.push_back(c10::CachingDeviceAllocator::parseTraceEntryAction(name));
      }
      return;
    }
    // Disabling drops the events too, as PyTorch's allocator does (dump the snapshot first).
    if (lib.history_enabled() == 1) {
      check(lib.history_stop(), "history_stop");
    }
    check(lib.history_clear(), "history_clear");
  }

  bool isHistoryEnabled() override {
    const int on = lib.history_enabled();
    if (on < 0) {
      fail(CUDALLOC_HERE, "history_enabled failed: " + last_error());
    }
    return on == 1;
  }

  // torch.multiprocessing's CUDA tensor sharing (sharing.h).
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    return share_tensor(ptr);
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return open_tensor(handle);
  }

  std::string name() override {
    return "cudalloc";
  }

  // Private pools: every call is the library's (pools, their uses and their memory live
  // there); only the routing by stream filter is kept here, since the filters are C++.

  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::cuda::MempoolId_t pool,
      std::function<bool(cudaStream_t)> filter) override {
    const cudaStream_t origin = c10::cuda::getCurrentCUDAStream(device).stream();
    std::lock_guard<std::mutex> lock(routes_mutex);
    end_finished_captures();
    if (routes.has(device, pool)) {
      fail(CUDALLOC_HERE, "already allocating to private pool " + pool_name(pool));
    }
    check(lib.pool_acquire(device, pool.first, pool.second), "pool_acquire");
    try {
      routes.begin(device, pool, std::move(filter), origin);
    } catch (...) {  // the filter threw
      lib.pool_release(device, pool.first, pool.second);
      throw;
    }
  }

  // CUDAGraph::capture_end calls it after the capture ended: a told capture that is over
  // ends here (one still running, as around a use_mem_pool inside a capture, does not).
  // Only a route the calling thread began ends (Routes::end).
  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) override {
    std::lock_guard<std::mutex> lock(routes_mutex);
    routes.end(device, pool);
    end_finished_captures();
  }

  // Called from the destructors of CUDAGraph and MemPool, where an exception would terminate
  // the process: a failure is reported on stderr instead.
  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) override {
    if (lib.pool_release(device, pool.first, pool.second) != 0) {
      report("pool_release failed: " + last_error());
    }
  }

  // MemPool(use_on_oom=True) lets an allocation that runs out of memory use the pool's free
  // memory: cudalloc gives the pool's whole free chunks back to the driver for that
  // allocation's second try (cudalloc_pool_set_use_on_oom). MemPool's constructor sets it
  // after createOrIncrefPool: a failure there gives that use back (a constructor that throws
  // runs no destructor to release it). Its destructor clears it, where a throw would end the
  // process: that failure is reported instead.
  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t pool, bool use_on_oom) override {
    if (lib.pool_set_use_on_oom(device, pool.first, pool.second, use_on_oom ? 1 : 0) == 0) {
      return;
    }
    const std::string why = "pool_set_use_on_oom failed: " + last_error();
    if (!use_on_oom) {
      report(why);
      return;
    }
    if (lib.pool_release(device, pool.first, pool.second) != 0) {
      report("pool_release failed: " + last_error());
    }
    fail(CUDALLOC_HERE, why);
  }

  // MemPool(no_split=True): cudalloc has no pool whose blocks are never split. Called only by
  // MemPool's constructor, after createOrIncrefPool: the use it took is given back before the
  // error, since a constructor that throws runs no destructor to release it.
  void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) override {
    if (lib.pool_release(device, pool.first, pool.second) != 0) {
      report("pool_release failed: " + last_error());
    }
    fail(CUDALLOC_HERE, "MemPool(no_split=True) is not supported: pool " + pool_name(pool) +
                            " would split its blocks as any other");
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::cuda::MempoolId_t pool,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    if (allocator && allocator.get() != this) {
      fail(CUDALLOC_HERE,
           "a MemPool with an allocator of its own cannot live in cudalloc's pools; create it "
           "without one (torch.cuda.MemPool())");
    }
    check(lib.pool_acquire(device, pool.first, pool.second), "pool_acquire");
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) override {
    const int n = lib.pool_use_count(device, pool.first, pool.second);
    if (n < 0) {
      fail(CUDALLOC_HERE, "pool_use_count failed: " + last_error());
    }
    return n;
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      c10::cuda::MempoolId_t pool,
      const std::unordered_set<void*>& expected) override {
    const std::vector<uint64_t> live = pool_live(device, pool);
    if (live.size() != expected.size()) {
      return false;
    }
    for (uint64_t addr : live) {
      if (expected.count(reinterpret_cast<void*>(addr)) == 0) {
        return false;
      }
    }
    return true;
  }

  // CUDA graph trees (torch.compile(mode="reduce-overhead")): checkpoint.h.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::cuda::MempoolId_t pool) override {
    return take_checkpoint(device, pool);
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> state) override {
    auto checkpoint = std::dynamic_pointer_cast<PoolCheckpoint>(state);
    if (!checkpoint || checkpoint->device != device) {
      fail(CUDALLOC_HERE, "not a checkpoint of cudalloc's pools on this device");
    }
    return restore_checkpoint(*checkpoint);
  }
 private:
  std::mutex history_mutex;
  // PyTorch's skip_actions of the last _record_memory_history.
  std::vector<c10::CachingDeviceAllocator::TraceEntry::Action> skip_actions;
};

// The allocator make_allocator made, kept for the life of the process (PyTorch holds it too,
// and it cannot be switched back).
std::shared_ptr<Allocator> made;

// c10's allocator table keeps the registration of the highest priority; PyTorch's own
// allocator registers with 0.
constexpr uint8_t kRegistryPriority = 1;

template <typename F>
void set(F& field, uintptr_t address, const char* name) {
  if (address == 0) {
    fail(CUDALLOC_HERE, std::string("the library has no ") + name);
  }
  field = reinterpret_cast<F>(address);
}

// Takes the library's function addresses (by name) and returns the allocator for
// torch.cuda.memory.change_current_allocator.
std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> make_allocator(
    const std::map<std::string, uintptr_t>& fns) {
  auto get = [&](const char* name) {
    auto it = fns.find(name);
    return it == fns.end() ? uintptr_t{0} : it->second;
  };
  set(lib.malloc, get("cudalloc_malloc"), "cudalloc_malloc");
  set(lib.free, get("cudalloc_free"), "cudalloc_free");
  set(lib.record_stream, get("cudalloc_record_stream"), "cudalloc_record_stream");
  set(lib.empty_cache, get("cudalloc_empty_cache"), "cudalloc_empty_cache");
  set(lib.set_memory_fraction, get("cudalloc_set_memory_fraction"),
      "cudalloc_set_memory_fraction");
  set(lib.reset_peak_stats, get("cudalloc_reset_peak_stats"), "cudalloc_reset_peak_stats");
  set(lib.reset_accumulated_stats, get("cudalloc_reset_accumulated_stats"),
      "cudalloc_reset_accumulated_stats");
  set(lib.memory_fraction, get("cudalloc_memory_fraction"), "cudalloc_memory_fraction");
  set(lib.enable_peer_access, get("cudalloc_enable_peer_access"), "cudalloc_enable_peer_access");
  set(lib.device_stats, get("cudalloc_device_stats"), "cudalloc_device_stats");
  set(lib.stats_json, get("cudalloc_stats_json"), "cudalloc_stats_json");
  set(lib.last_error, get("cudalloc_last_error"), "cudalloc_last_error");
  set(lib.last_error_kind, get("cudalloc_last_error_kind"), "cudalloc_last_error_kind");
  set(lib.pool_acquire, get("cudalloc_pool_acquire"), "cudalloc_pool_acquire");
  set(lib.pool_release, get("cudalloc_pool_release"), "cudalloc_pool_release");
  set(lib.pool_use_count, get("cudalloc_pool_use_count"), "cudalloc_pool_use_count");
  set(lib.pool_malloc, get("cudalloc_pool_malloc"), "cudalloc_pool_malloc");
  set(lib.pool_blocks, get("cudalloc_pool_blocks"), "cudalloc_pool_blocks");
  set(lib.pool_allocate_at, get("cudalloc_pool_allocate_at"), "cudalloc_pool_allocate_at");
  set(lib.pool_empty_cache, get("cudalloc_pool_empty_cache"), "cudalloc_pool_empty_cache");
  set(lib.pool_set_use_on_oom, get("cudalloc_pool_set_use_on_oom"),
      "cudalloc_pool_set_use_on_oom");
  set(lib.memory_snapshot, get("cudalloc_memory_snapshot"), "cudalloc_memory_snapshot");
  set(lib.capture_begin, get("cudalloc_capture_begin"), "cudalloc_capture_begin");
  set(lib.capture_end, get("cudalloc_capture_end"), "cudalloc_capture_end");
  set(lib.history_start, get("cudalloc_history_start"), "cudalloc_history_start");
  set(lib.history_stop, get("cudalloc_history_stop"), "cudalloc_history_stop");
  set(lib.history_clear, get("cudalloc_history_clear"), "cudalloc_history_clear");
  set(lib.history_enabled, get("cudalloc_history_enabled"), "cudalloc_history_enabled");
  set(lib.memory_history, get("cudalloc_memory_history"), "cudalloc_memory_history");
  set(lib.share, get("cudalloc_share"), "cudalloc_share");
  set(lib.open_shared, get("cudalloc_open_shared"), "cudalloc_open_shared");
  set(lib.close_shared, get("cudalloc_close_shared"), "cudalloc_close_shared");
  auto allocator = std::make_shared<Allocator>();
  allocator->init(c10::cuda::device_count());
  made = allocator;
  return allocator;
}

// After torch.cuda.memory.change_current_allocator took the allocator: makes it c10's CUDA
// allocator too (c10::GetAllocator), which torch.accelerator's memory functions and code that
// allocates through c10's table read; PyTorch's change_current_allocator sets only the CUDA
// caching allocator's pointer.
void register_device_allocator() {
  if (!made) {
    fail(CUDALLOC_HERE, "register_device_allocator before make_allocator");
  }
  c10::SetAllocator(c10::DeviceType::CUDA, made.get(), kRegistryPriority);
}

}  // namespace
}  // namespace cudalloc_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_allocator", &cudalloc_torch::make_allocator,
        "cudalloc's c10 CUDA allocator over the library functions at the given addresses");
  m.def("register_device_allocator", &cudalloc_torch::register_device_allocator,
        "makes the allocator c10's CUDA allocator too, after change_current_allocator");
  m.def("forget_shared", &cudalloc_torch::forget_shared,
        "closes the descriptors kept for tensors shared with other processes (before a sleep)");
}
