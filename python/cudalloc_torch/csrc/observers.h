// The out-of-memory observers (torch._C._cuda_attach_out_of_memory_observer): called before
// the backend raises torch.OutOfMemoryError, as PyTorch's allocator calls them. Part of
// backend.cpp's one translation unit (included by it only).

#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <vector>

#include "library.h"

namespace cudalloc_torch {
namespace {

// Functions (torch._C._cuda_attach_out_of_memory_observer) called with (device, bytes
// asked for, the device's memory or its cap, the device's free memory) before an
// out-of-memory error is raised. Guarded by observers_mutex.
std::mutex observers_mutex;
std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;

// Calls every out-of-memory observer, as PyTorch's allocator does before it raises: the
// limit is the cap when one is set (cudalloc_memory_fraction), else the device's memory.
void tell_observers(size_t size, c10::DeviceIndex device) {
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> calls;
  {
    std::lock_guard<std::mutex> lock(observers_mutex);
    calls = observers;
  }
  if (calls.empty()) {
    return;
  }
  size_t free = 0;
  size_t total = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    if (!queried(cudaMemGetInfo(&free, &total))) {
      free = total = 0;
    }
  }
  const double fraction = lib.memory_fraction(device);
  const size_t limit = fraction >= 0.0 && fraction < 1.0
      ? static_cast<size_t>(fraction * static_cast<double>(total))
      : total;
  for (const auto& observer : calls) {
    observer(device, size, limit, free);
  }
}

}  // namespace
}  // namespace cudalloc_torch
