// Checkpoints of private pools, for CUDA graph trees (torch.compile(mode="reduce-overhead")):
// getCheckpointState records a pool's live blocks; setCheckpointPoolState puts the pool back to
// them, as PyTorch's own allocator does. Part of backend.cpp's one translation unit (included by
// it only).
//
// A graph tree takes a checkpoint after recording each graph and restores one when it records a
// new graph after an earlier point of a path: replays do not go through the allocator, so its
// state must be put back to what it was after that point's recording. The delta it returns is
// PyTorch's: every allocation live in the pool before the call is named as freed, and every
// allocation of the checkpoint is handed back as a DataPtr with this allocator's deleter (graph
// trees give it to the storages they revive and drop the others without freeing).
//
// Invariants: after a restore the pool's live blocks are exactly the checkpoint's, at the same
// addresses and sizes (cudalloc_pool_allocate_at hands out a freed block where it was); a block
// live both now and then, with the same size, request and stream, is left allocated rather
// than freed and handed out again (the same state, without a free that record_stream could
// defer); a restore that cannot be done raises, naming the block, after freeing the blocks it
// had handed out (the allocations it freed stay freed: the pool then holds fewer live blocks
// than either state, and graph trees cannot go on from there).

#pragma once

#include "library.h"

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

namespace cudalloc_torch {

// One live block of a pool, as cudalloc_pool_blocks lists it: address, block bytes, bytes
// requested, stream.
using PoolBlock = std::array<uint64_t, 4>;

// A checkpoint of a private pool (getCheckpointState): its live blocks, sorted.
struct PoolCheckpoint : c10::cuda::CUDACachingAllocator::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::cuda::MempoolId_t pool{0, 0};
  std::vector<PoolBlock> blocks;
};

// A private pool's live blocks, sorted.
inline std::vector<PoolBlock> pool_blocks(c10::DeviceIndex device,
                                          const c10::cuda::MempoolId_t& pool) {
  std::vector<PoolBlock> blocks(16);
  while (true) {
    const int64_t n = lib.pool_blocks(device, pool.first, pool.second,
                                      reinterpret_cast<char*>(blocks.data()),
                                      blocks.size() * sizeof(PoolBlock));
    if (n < 0) {
      fail(CUDALLOC_HERE, "pool_blocks failed: " + last_error());
    }
    if (static_cast<size_t>(n) <= blocks.size()) {
      blocks.resize(static_cast<size_t>(n));
      std::sort(blocks.begin(), blocks.end());
      return blocks;
    }
    blocks.resize(static_cast<size_t>(n) + 16);  // it may grow before the retry
  }
}

inline std::shared_ptr<PoolCheckpoint> take_checkpoint(c10::DeviceIndex device,
                                                       c10::cuda::MempoolId_t pool) {
  auto checkpoint = std::make_shared<PoolCheckpoint>();
  checkpoint->device = device;
  checkpoint->pool = pool;
  checkpoint->blocks = pool_blocks(device, pool);
  return checkpoint;
}

inline void* as_pointer(uint64_t address) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(address));
}

// Puts the checkpoint's pool back to it (see the header comment).
inline c10::cuda::CUDACachingAllocator::CheckpointDelta restore_checkpoint(
    const PoolCheckpoint& checkpoint) {
  const std::vector<PoolBlock>& then = checkpoint.blocks;
  const std::vector<PoolBlock> now = pool_blocks(checkpoint.device, checkpoint.pool);
  auto in = [](const std::vector<PoolBlock>& set, const PoolBlock& b) {
    return std::binary_search(set.begin(), set.end(), b);
  };
  c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
  for (const PoolBlock& b : now) {
    delta.ptrs_freed.push_back(as_pointer(b[0]));
    if (!in(then, b)) {
      free_pointer(as_pointer(b[0]));
    }
  }
  std::vector<void*> handed_out;  // by this call, freed again if a later block fails
  for (const PoolBlock& b : then) {
    void* p = as_pointer(b[0]);
    if (in(now, b)) {
      continue;
    }
    if (lib.pool_allocate_at(checkpoint.device, checkpoint.pool.first, checkpoint.pool.second, p,
                             static_cast<size_t>(b[1]), static_cast<size_t>(b[2]),
                             as_pointer(b[3])) != 0) {
      const std::string why = last_error();
      for (void* q : handed_out) {
        free_pointer(q);
      }
      fail(CUDALLOC_HERE, "cannot restore private pool " + pool_name(checkpoint.pool) +
                              " to its checkpoint: " + why);
    }
    handed_out.push_back(p);
  }
  // Only once every block is handed out: a DataPtr frees its block when it is dropped, and
  // one dropped by a failure above would free a block PyTorch's storages still hold.
  const c10::Device device(c10::DeviceType::CUDA, checkpoint.device);
  for (const PoolBlock& b : then) {
    void* p = as_pointer(b[0]);
    delta.dataptrs_allocd.emplace_back(p, p, &free_pointer, device);
  }
  return delta;
}

}  // namespace cudalloc_torch
