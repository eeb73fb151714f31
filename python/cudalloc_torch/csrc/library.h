// The C library as the backend sees it: the C ABI's functions (capi/include/cudalloc.h),
// set once from Python, and how their failures become PyTorch errors. Part of backend.cpp's
// one translation unit (included by it only).

#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "ipc.h"

namespace cudalloc_torch {

// cudalloc_shared_t of the C ABI.
struct Shared {
  int device;
  unsigned long long segment, offset, size;
  size_t num_pages;
};

// The C ABI's functions (capi/include/cudalloc.h), set once by install().
struct Library {
  void* (*malloc)(size_t, int, void*) = nullptr;
  void (*free)(void*, size_t, int, void*) = nullptr;
  int (*record_stream)(void*, int, void*) = nullptr;
  int (*empty_cache)(int) = nullptr;
  int (*set_memory_fraction)(double, int) = nullptr;
  int (*reset_peak_stats)(int) = nullptr;
  int (*reset_accumulated_stats)(int) = nullptr;
  double (*memory_fraction)(int) = nullptr;
  int (*enable_peer_access)(int, int) = nullptr;
  size_t (*device_stats)(int, char*, size_t) = nullptr;
  size_t (*stats_json)(int, char*, size_t) = nullptr;
  const char* (*last_error)() = nullptr;
  int (*last_error_kind)() = nullptr;
  int (*pool_acquire)(int, uint64_t, uint64_t) = nullptr;
  int (*pool_release)(int, uint64_t, uint64_t) = nullptr;
  int (*pool_use_count)(int, uint64_t, uint64_t) = nullptr;
  void* (*pool_malloc)(size_t, int, void*, uint64_t, uint64_t) = nullptr;
  int64_t (*pool_blocks)(int, uint64_t, uint64_t, char*, size_t) = nullptr;
  int (*pool_allocate_at)(int, uint64_t, uint64_t, void*, size_t, size_t, void*) = nullptr;
  int (*pool_empty_cache)(int, uint64_t, uint64_t) = nullptr;
  int (*pool_set_use_on_oom)(int, uint64_t, uint64_t, int) = nullptr;
  size_t (*memory_snapshot)(int, uint64_t, uint64_t, char*, size_t) = nullptr;
  int (*capture_begin)(int) = nullptr;
  int (*capture_end)(int) = nullptr;
  int (*history_start)(uint64_t, int) = nullptr;
  int (*history_stop)() = nullptr;
  int (*history_clear)() = nullptr;
  int (*history_enabled)() = nullptr;
  size_t (*memory_history)(char*, size_t) = nullptr;
  long long (*share)(void*, int, Shared*, int*, unsigned long long*, size_t) = nullptr;
  void* (*open_shared)(int, const Shared*, const int*, const unsigned long long*, size_t) =
      nullptr;
  int (*close_shared)(void*, int) = nullptr;
};

inline Library lib;

inline constexpr int kOutOfMemory = 2;  // CUDALLOC_ERROR_OUT_OF_MEMORY
inline constexpr int kAnyDevice = -1;   // cudalloc_free's "whichever device holds it"
inline constexpr size_t kDeviceStats = 122;  // CUDALLOC_DEVICE_STATS

// A failed query's error is cleared from the runtime's last error, where PyTorch's next
// kernel launch check would find it and raise (the legacy stream answers 906 while a blocking
// stream is being captured, and that capture goes on unharmed).
inline bool queried(cudaError_t code) {
  if (code != cudaSuccess) {
    (void)cudaGetLastError();
  }
  return code == cudaSuccess;
}

inline std::string last_error() {
  const char* e = lib.last_error();
  return e ? std::string(e) : std::string();
}

// Frees memory of this allocator given its pointer alone (the DataPtr deleter); the page
// descriptors kept for another process that opened it (ipc.h) are closed first.
inline void free_pointer(void* ptr) {
  if (ptr != nullptr) {
    ipc::forget(ptr);
    lib.free(ptr, 0, kAnyDevice, nullptr);
  }
}

// Errors are thrown with messages built from std::string and std::to_string only: c10::str
// and TORCH_CHECK format through std::ostream, and formatting a number that way inside an
// extension crashed the process on the H200 (torch 2.11, g++ 13: the extension's own copy of
// ostream's number formatting), while a thrown c10::OutOfMemoryError with a plain message
// reaches Python as torch.OutOfMemoryError.
#define CUDALLOC_HERE \
  c10::SourceLocation { __func__, __FILE__, static_cast<uint32_t>(__LINE__) }

[[noreturn]] inline void fail(const c10::SourceLocation& at, const std::string& message) {
  throw c10::Error(at, "cudalloc: " + message);
}

// For failures where an exception would terminate the process or lose nothing worth raising.
inline void report(const std::string& message) {
  const std::string line = "cudalloc: " + message + "\n";
  std::fputs(line.c_str(), stderr);
}

inline std::string pool_name(const c10::cuda::MempoolId_t& id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// Raises a library call's failure (rc != 0) as a RuntimeError naming the call. Not for
// destructors' paths, where throwing would end the process: those report() instead.
inline void check(int rc, const char* what) {
  if (rc != 0) {
    fail(CUDALLOC_HERE, std::string(what) + " failed: " + last_error());
  }
}

}  // namespace cudalloc_torch
