// torch.cuda.memory_snapshot() from the library's documents: cudalloc_memory_snapshot's
// segments and blocks become PyTorch's SegmentInfo, and cudalloc_memory_history's events
// PyTorch's TraceEntry (torch.cuda.memory._record_memory_history / _dump_snapshot). Part of
// backend.cpp's one translation unit (included by it only).

#pragma once

#include "library.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <vector>

namespace cudalloc_torch {

// cudalloc_memory_snapshot's document, as cudalloc.h declares it: a header (the segment and
// block counts), the segments, then the blocks.
struct SnapshotSegment {
  uint64_t address;
  uint64_t total_size;
  uint64_t stream;
  uint64_t pool_id[2];
  uint64_t first_block;
  uint64_t block_count;
  int32_t device;
  int32_t flags;
};
struct SnapshotBlock {
  uint64_t address;
  uint64_t size;
  uint64_t requested_size;
  int32_t state;
  int32_t reserved;
};
static_assert(sizeof(SnapshotSegment) == 64, "cudalloc_segment is 64 bytes");
static_assert(sizeof(SnapshotBlock) == 32, "cudalloc_block is 32 bytes");
inline constexpr size_t kSnapshotHeader = 2 * sizeof(uint64_t);
inline constexpr int32_t kSegmentLarge = 1;         // CUDALLOC_SEGMENT_LARGE
inline constexpr int32_t kSegmentExpandable = 2;    // CUDALLOC_SEGMENT_EXPANDABLE
inline constexpr int32_t kBlockAllocated = 1;       // CUDALLOC_BLOCK_ALLOCATED
inline constexpr int32_t kBlockPendingEvents = 2;   // CUDALLOC_BLOCK_PENDING_EVENTS

// Device `device`'s document (`pool` only, or everything for {0, 0}), in 8-byte words.
inline std::vector<uint64_t> snapshot_document(int device, const c10::cuda::MempoolId_t& pool) {
  std::vector<uint64_t> words(kSnapshotHeader / sizeof(uint64_t) + 256);
  while (true) {
    const size_t bytes = words.size() * sizeof(uint64_t);
    const size_t need = lib.memory_snapshot(device, pool.first, pool.second,
                                            reinterpret_cast<char*>(words.data()), bytes);
    if (need < kSnapshotHeader) {
      fail(CUDALLOC_HERE, "memory_snapshot failed: " + last_error());
    }
    if (need <= bytes) {
      words.resize(need / sizeof(uint64_t));
      return words;
    }
    words.resize(need / sizeof(uint64_t) + 256);  // it may grow before the retry
  }
}

// A segment of the document as PyTorch's snapshot has it: its blocks' states become
// PyTorch's allocated and active flags, and the segment's sizes their sums, as PyTorch's
// allocator sums them.
inline c10::CachingDeviceAllocator::SegmentInfo torch_segment(const SnapshotSegment& s,
                                                       const SnapshotBlock* blocks) {
  c10::CachingDeviceAllocator::SegmentInfo info;
  info.device = static_cast<c10::DeviceIndex>(s.device);
  info.address = static_cast<size_t>(s.address);
  info.total_size = static_cast<size_t>(s.total_size);
  info.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(s.stream));
  info.is_large = (s.flags & kSegmentLarge) != 0;
  info.is_expandable = (s.flags & kSegmentExpandable) != 0;
  info.owner_private_pool_id = {s.pool_id[0], s.pool_id[1]};
  for (uint64_t i = 0; i < s.block_count; ++i) {
    const SnapshotBlock& b = blocks[s.first_block + i];
    c10::CachingDeviceAllocator::BlockInfo block;
    block.size = static_cast<size_t>(b.size);
    block.requested_size = static_cast<size_t>(b.requested_size);
    block.allocated = b.state == kBlockAllocated;
    block.active = block.allocated || b.state == kBlockPendingEvents;
    if (block.allocated) {
      info.allocated_size += block.size;
    }
    if (block.active) {
      info.active_size += block.size;
      info.requested_size += block.requested_size;
    }
    info.blocks.push_back(std::move(block));
  }
  return info;
}

// Appends device `device`'s segments (`pool`'s only, or all for {0, 0}) to `out`.
inline void add_segments(int device, const c10::cuda::MempoolId_t& pool,
                  std::vector<c10::CachingDeviceAllocator::SegmentInfo>& out) {
  const std::vector<uint64_t> doc = snapshot_document(device, pool);
  const uint64_t segments = doc[0];
  const uint64_t blocks = doc[1];
  const size_t bytes = doc.size() * sizeof(uint64_t);
  if (bytes != kSnapshotHeader + segments * sizeof(SnapshotSegment) +
                   blocks * sizeof(SnapshotBlock)) {
    fail(CUDALLOC_HERE, "memory_snapshot: the document's size does not match its counts");
  }
  const char* at = reinterpret_cast<const char*>(doc.data()) + kSnapshotHeader;
  std::vector<SnapshotSegment> segs(segments);
  std::memcpy(segs.data(), at, segments * sizeof(SnapshotSegment));
  std::vector<SnapshotBlock> blks(blocks);
  std::memcpy(blks.data(), at + segments * sizeof(SnapshotSegment), blocks * sizeof(SnapshotBlock));
  for (const SnapshotSegment& s : segs) {
    if (s.first_block > blocks || s.block_count > blocks - s.first_block) {
      fail(CUDALLOC_HERE, "memory_snapshot: a segment's blocks lie outside the document");
    }
    out.push_back(torch_segment(s, blks.data()));
  }
}

// cudalloc_memory_history's document, as cudalloc.h declares it: the event count, then the
// events, oldest first.
struct HistoryEvent {
  uint64_t address;
  uint64_t size;
  uint64_t stream;
  uint64_t time_us;
  int32_t action;
  int32_t device;
};
static_assert(sizeof(HistoryEvent) == 40, "cudalloc_event is 40 bytes");
inline constexpr size_t kHistoryHeader = sizeof(uint64_t);

// The history's events.
inline std::vector<HistoryEvent> history_events() {
  std::vector<char> doc(kHistoryHeader + 1024 * sizeof(HistoryEvent));
  while (true) {
    const size_t need = lib.memory_history(doc.data(), doc.size());
    if (need < kHistoryHeader) {
      fail(CUDALLOC_HERE, "memory_history failed: " + last_error());
    }
    if (need <= doc.size()) {
      uint64_t count = 0;
      std::memcpy(&count, doc.data(), sizeof count);
      if (need != kHistoryHeader + count * sizeof(HistoryEvent)) {
        fail(CUDALLOC_HERE, "memory_history: the document's size does not match its count");
      }
      std::vector<HistoryEvent> events(count);
      std::memcpy(events.data(), doc.data() + kHistoryHeader, count * sizeof(HistoryEvent));
      return events;
    }
    doc.resize(need + 1024 * sizeof(HistoryEvent));  // it may grow before the retry
  }
}

// The history as PyTorch's trace, one list per device, leaving out the actions in `skip`
// (PyTorch's skip_actions). The events carry Unix-epoch microseconds already, which is what
// PyTorch's snapshot reports (it converts its own clock's ticks into them); no stack frames.
inline std::vector<std::vector<c10::CachingDeviceAllocator::TraceEntry>> device_traces(
    int devices,
    const std::vector<c10::CachingDeviceAllocator::TraceEntry::Action>& skip) {
  using Entry = c10::CachingDeviceAllocator::TraceEntry;
  std::vector<std::vector<Entry>> out(static_cast<size_t>(devices));
  for (const HistoryEvent& e : history_events()) {
    if (e.device < 0 || e.device >= devices || e.action < Entry::ALLOC || e.action > Entry::OOM) {
      fail(CUDALLOC_HERE, "memory_history: an event with device " + std::to_string(e.device) +
                              " and action " + std::to_string(e.action));
    }
    const auto action = static_cast<Entry::Action>(e.action);
    if (std::find(skip.begin(), skip.end(), action) != skip.end()) {
      continue;
    }
    Entry entry(action, static_cast<c10::DeviceIndex>(e.device), static_cast<size_t>(e.address),
                static_cast<size_t>(e.size),
                reinterpret_cast<void*>(static_cast<uintptr_t>(e.stream)), {0, 0}, 0);
    entry.time_.t_ = static_cast<time_t>(e.time_us);
    out[static_cast<size_t>(e.device)].push_back(std::move(entry));
  }
  return out;
}

}  // namespace cudalloc_torch
