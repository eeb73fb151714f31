// torch.multiprocessing's CUDA tensor sharing on cudalloc's PyTorch backend: the sending
// process exports the allocation's pages (cudalloc_share: one file descriptor per page, which
// needs the shareable_segments key) and keeps the descriptors for the receiver (ipc.h); the
// receiving process fetches them and maps the pages (cudalloc_open_shared) until PyTorch drops
// its storage (cudalloc_close_shared). Both processes run this backend. Part of backend.cpp's
// one translation unit (included by it only).
//
// Invariants:
//   - The handle's offset is 0: the pointer cudalloc_open_shared returns is the allocation's
//     own, as shareIpcHandle is given the storage's pointer.
//   - The sender's descriptors stay open while the allocation lives (free_pointer closes them)
//     and its pages stay (forget_shared closes them all before cudalloc_sleep), so a receiver
//     can open the tensor while the sender holds it, as with CUDA IPC; an allocation has one
//     handle, so PyTorch's receivers open it once however often it is sent.
//   - A receiver's mapping goes (cudalloc_close_shared) after the device's queued work.

#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <memory>
#include <string>
#include <vector>

#include "ipc.h"
#include "library.h"

namespace cudalloc_torch {

// shareIpcHandle: PyTorch calls it with the storage's device current. An allocation shared
// before gets the handle it got then.
inline c10::cuda::CUDACachingAllocator::ShareableHandle share_tensor(void* ptr) {
  c10::cuda::CUDACachingAllocator::ShareableHandle h;
  h.offset = 0;
  if (auto held = ipc::registry().handle_of(ptr)) {
    h.handle = std::move(*held);
    return h;
  }
  const int device = c10::cuda::current_device();
  Shared out{};
  std::vector<int> fds(16);
  std::vector<unsigned long long> sizes(16);
  long long n = lib.share(ptr, device, &out, fds.data(), sizes.data(), fds.size());
  if (n > static_cast<long long>(fds.size())) {  // nothing exported: again, with room
    fds.resize(static_cast<size_t>(n));
    sizes.resize(static_cast<size_t>(n));
    n = lib.share(ptr, device, &out, fds.data(), sizes.data(), fds.size());
  }
  if (n < 0 || n > static_cast<long long>(fds.size())) {
    fail(CUDALLOC_HERE, "sharing a CUDA tensor with another process (cudalloc_share): " +
                            last_error());
  }
  fds.resize(static_cast<size_t>(n));
  ipc::Wire w;
  w.device = out.device;
  w.segment = out.segment;
  w.offset = out.offset;
  w.size = out.size;
  w.page_sizes.assign(sizes.begin(), sizes.begin() + n);
  try {
    h.handle = ipc::registry().add(ptr, std::move(fds), std::move(w));
  } catch (const std::exception& e) {
    fail(CUDALLOC_HERE, e.what());
  }
  return h;
}

// getIpcDevPtr: PyTorch calls it with the storage's device current.
inline std::shared_ptr<void> open_tensor(const std::string& handle) {
  const int device = c10::cuda::current_device();
  ipc::Wire w;
  std::vector<int> fds;
  try {
    w = ipc::decode(handle);
    fds = ipc::fetch(w);
  } catch (const std::exception& e) {
    fail(CUDALLOC_HERE, e.what());
  }
  const Shared shared{w.device, w.segment, w.offset, w.size, w.page_sizes.size()};
  std::vector<unsigned long long> sizes(w.page_sizes.begin(), w.page_sizes.end());
  void* p = lib.open_shared(device, &shared, fds.data(), sizes.data(), fds.size());
  for (int fd : fds) {
    ::close(fd);  // cudalloc_open_shared borrows them
  }
  if (p == nullptr) {
    fail(CUDALLOC_HERE, "opening a CUDA tensor shared by another process (cudalloc_open_shared): " +
                            last_error());
  }
  // The unmap is not ordered with the streams, so the device's queued work finishes first (a
  // device synchronize: during a capture it would invalidate the capture, as the stream
  // synchronize of PyTorch's own IPC deleter would). A deleter must not throw: failures are
  // reported.
  return std::shared_ptr<void>(p, [device](void* q) {
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      if (cudaDeviceSynchronize() != cudaSuccess) {
        (void)cudaGetLastError();
        report("cudaDeviceSynchronize before closing a shared tensor failed");
      }
    } catch (const std::exception& e) {
      report(std::string("closing a shared tensor: ") + e.what());
    }
    if (lib.close_shared(q, device) != 0) {
      report("cudalloc_close_shared failed: " + last_error());
    }
  });
}

// Before cudalloc_sleep: the shared allocations' descriptors are closed, so that their pages
// can go; a receiver that has not opened a tensor yet is then told the sender no longer holds
// it, and sharing the tensor again after the wake exports its new pages.
inline void forget_shared() {
  ipc::registry().forget_all();
}

}  // namespace cudalloc_torch
