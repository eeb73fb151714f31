// The allocation routes of cudalloc's PyTorch backend: the private pools allocations go to
// (PyTorch's "allocate to pool" calls, made by torch.cuda.graph's capture and by
// torch.cuda.use_mem_pool), each with the filter that says which streams' allocations it takes.
// Plain C++ (no torch, no CUDA): the stream type and the capture query are parameters, so that
// python/tests/test_routes.py compiles and checks these rules on a machine without either.
//
// Invariants:
//   - size() is the number of routes; empty() reads one atomic, so that an allocation with no
//     route takes no lock. Every other member is called with the caller's lock held.
//   - At most one route per (device, pool): begin refuses a second.
//   - A capture's route ends with its capture, even if PyTorch never ends it
//     (CUDAGraph::capture_end throws before endAllocateToPool when the capture failed, and the
//     route's filter may then outlive the CUDAGraph it reads). A route is `scoped` (a
//     capture's) when its filter refused its origin (the stream current on the thread that
//     began it: CUDAGraph::capture_begin begins its route with the capture stream current,
//     then begins the capture) or when the origin was already being captured then (a
//     conditional node's route, a use_mem_pool begun inside a capture). prune binds a scoped
//     route to its origin's capture once seen, and drops it once the origin has left that
//     capture, or, never seen captured, at the next call from the thread that began it (which
//     makes no call between beginning the route and beginning the capture).
//   - find looks innermost (last begun) first, as PyTorch's allocator does.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace cudalloc_torch {

template <class Stream, class Pool>
class Routes {
 public:
  using Filter = std::function<bool(Stream)>;
  // The id of the capture a stream is part of, 0 when it is not being captured.
  using CaptureOf = std::function<unsigned long long(Stream)>;

  explicit Routes(CaptureOf capture_of) : capture_of_(std::move(capture_of)) {}

  bool empty() const {
    return count_.load(std::memory_order_acquire) == 0;
  }

  std::size_t size() const {
    return routes_.size();
  }

  // Whether `device` has a route to `pool`.
  bool has(int device, const Pool& pool) const {
    return std::any_of(routes_.begin(), routes_.end(), [&](const Route& r) {
      return r.device == device && r.pool == pool;
    });
  }

  // Begins a route to `pool` from the calling thread, whose current stream is `origin`; false
  // (and nothing begun) if `device` already has one to `pool`.
  bool begin(int device, Pool pool, Filter filter, Stream origin) {
    if (has(device, pool)) {
      return false;
    }
    const unsigned long long capture = capture_of_(origin);
    const bool scoped = capture != 0 || !filter(origin);
    routes_.push_back(Route{
        device, std::move(pool), std::move(filter), origin, std::this_thread::get_id(), scoped,
        capture});
    count_.fetch_add(1, std::memory_order_release);
    return true;
  }

  // Ends the route of `device` to `pool` if the calling thread began it: nothing otherwise
  // (prune may have dropped the caller's, and another thread begun one to the same pool since,
  // which stays; a capture's route that another thread ends is pruned once its capture is).
  void end(int device, const Pool& pool) {
    const auto me = std::this_thread::get_id();
    auto it = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) {
      return r.device == device && r.pool == pool && r.thread == me;
    });
    if (it != routes_.end()) {
      erase(it);
    }
  }

  // Whether a route is a capture's (scoped): while one is, nothing may give memory back.
  bool any_scoped() const {
    return std::any_of(routes_.begin(), routes_.end(), [](const Route& r) { return r.scoped; });
  }

  // The pool an allocation of `device` on `stream` goes to, if a route takes it.
  std::optional<Pool> find(int device, Stream stream) const {
    for (auto r = routes_.rbegin(); r != routes_.rend(); ++r) {
      if (r->device == device && r->filter(stream)) {
        return r->pool;
      }
    }
    return std::nullopt;
  }

  // Binds each scoped route to its origin's capture, and drops those whose capture is over
  // (see the invariants).
  void prune() {
    for (auto it = routes_.begin(); it != routes_.end();) {
      if (!it->scoped) {
        ++it;
        continue;
      }
      const unsigned long long now = capture_of_(it->origin);
      const bool over = it->capture != 0
          ? now != it->capture
          : now == 0 && it->thread == std::this_thread::get_id();
      if (over) {
        it = erase(it);
        continue;
      }
      it->capture = now;
      ++it;
    }
  }

 private:
  struct Route {
    int device;
    Pool pool;
    Filter filter;
    Stream origin;
    std::thread::id thread;
    bool scoped;
    unsigned long long capture;  // the origin's capture once seen; 0: not yet
  };

  typename std::vector<Route>::iterator erase(typename std::vector<Route>::iterator it) {
    count_.fetch_sub(1, std::memory_order_release);
    return routes_.erase(it);
  }

  std::vector<Route> routes_;
  std::atomic<int> count_{0};
  CaptureOf capture_of_;
};

}  // namespace cudalloc_torch
