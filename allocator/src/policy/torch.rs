//! `torch`: PyTorch's `DeviceCachingAllocator` rule for rule (fixed segments, one `cudaMalloc`
//! each).
//!
//! - place: best fit in the request's pool and stream (`get_free_block`), except that a request
//!   below `max_split_size` never takes an oversize block, and an oversize request takes one
//!   only when it exceeds the request by less than `max_non_split_rounding`;
//! - split: a small block when the rest is at least 512 bytes, a large one when the request is
//!   below `max_split_size` and the rest is more than 1 MiB (`should_split`);
//! - release (`release_available_cached_blocks`): before the ladder's last rung, unsplit
//!   oversize cached blocks of the request's stream, the smallest that is enough or else the
//!   largest first, until one request's worth is freed (the default of every policy's
//!   `release`); and under a memory limit with `garbage_collection_threshold`, before any
//!   growth, unsplit cached segments older than the average (`garbage_collect_cached_blocks`);
//! - grow: one new segment of `get_allocation_size` bytes (2 MiB for the small pool, 20 MiB up
//!   to 10 MiB requests, the request rounded to 2 MiB above), refused past the memory limit
//!   (`alloc_block`).
//!
//! The functions here take `expandable`, the one switch PyTorch's own functions read
//! (`expandable_segments_`), so that [`super::TorchExpandable`] and `default` share them.

use super::Policy;
use crate::pool::block::{Arena, Block, BlockId, NIL};
use crate::pool::index::FreeIndex;
use crate::pool::{Core, Request};
use crate::sizes::{PoolKind, MIN_BLOCK, SMALL_SIZE};
use cudalloc_sys::{Device, DeviceError};
use smallvec::SmallVec;

/// PyTorch's caching allocator with fixed segments. It keeps no state.
#[derive(Clone, Copy, Debug, Default)]
pub struct Torch;

impl Policy for Torch {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        Ok(get_free_block(core, req, false))
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        should_split(core, id, size, false)
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        core.alloc_segment(req)
    }
}

/// PyTorch's rule for a cached block of `size` bytes found for `req`: a request below
/// `max_split_size` (`mss`) takes no block of that size or more (it would split an oversize
/// block), and one at or above it takes no block larger by `rounding`
/// (`max_non_split_rounding`) or more.
pub fn serves(req: &Request, size: u64, mss: u64, rounding: u64) -> bool {
    size >= req.size
        && !(req.size < mss && size >= mss)
        && !(req.size >= mss && size >= req.size.saturating_add(rounding))
}

/// What a best-fit search reads of the pool: whether the garbage-collection clock runs, the
/// oversize settings (`max_split_size`, `max_non_split_rounding`), the blocks, and the
/// request's free index.
fn search_parts<'a, D: Device>(
    core: &'a mut Core<D>,
    req: &Request,
) -> (bool, u64, u64, &'a Arena, &'a mut FreeIndex) {
    let idx = match req.pool {
        PoolKind::Small => &mut core.small,
        PoolKind::Large => &mut core.large,
    };
    let gc = core.limit.is_some() && core.cfg.garbage_collection_threshold > 0.0;
    let (mss, rounding) = (core.cfg.max_split_size, core.cfg.max_non_split_rounding);
    (gc, mss, rounding, &core.blocks, idx)
}

/// Best fit from the request's free index, with PyTorch's oversize rules; the block is taken out
/// of the index. With `expandable`, a block's unmapped tail counts as part of its size, so a
/// block at the end of an expandable segment is chosen only when nothing else fits.
pub fn get_free_block<D: Device>(
    core: &mut Core<D>,
    req: &Request,
    expandable: bool,
) -> Option<BlockId> {
    let (gc, mss, rounding, blocks, idx) = search_parts(core, req);
    if gc {
        idx.searches += 1;
    }
    let (size, id) = {
        let mut it = idx.at_least(req.stream.0, req.size);
        let (mut size, mut id) = it.next()?;
        if expandable && blocks[id].is_expandable() {
            let mut top = expandable_size(blocks, id);
            for (next_size, next) in it {
                // A block grows to at least its size: one of `top` bytes or more grows to no
                // less, and its block need not be read.
                if next_size >= top {
                    break;
                }
                let g = expandable_size(blocks, next);
                if g >= top {
                    break;
                }
                (size, id, top) = (next_size, next, g);
            }
        }
        (size, id)
    };
    if !serves(req, size, mss, rounding) {
        return None;
    }
    let removed = idx.remove(&blocks[id]);
    debug_assert!(removed);
    Some(id)
}

/// [`get_free_block`] over the blocks `may_take` accepts: the answer (and the garbage-collection
/// clock) of taking each block it found and `may_take` refused out of the index and searching
/// again, the refused blocks put back afterwards, in one walk over the index. (It keeps the
/// walk to go back along it, which the plain search has no need of.)
///
/// The search with `expandable` walks from the first fit on while each block could grow to
/// less than the one before it (`run`, a stack); a refused block is the top of that walk, and
/// the search without it walks the same blocks up to the one below it, then goes on from the
/// block after the refused one, which is where the walk stopped (`rest.peek()`).
pub fn get_free_block_where<D: Device>(
    core: &mut Core<D>,
    req: &Request,
    expandable: bool,
    mut may_take: impl FnMut(&Block) -> bool,
) -> Option<BlockId> {
    let (gc, mss, rounding, blocks, idx) = search_parts(core, req);
    let grow = |b: BlockId| expandable_size(blocks, b);
    let (found, searches) = {
        let mut rest = idx.at_least(req.stream.0, req.size).peekable();
        // (size, block, what it could grow to) of each block of the walk.
        let mut run: SmallVec<[(u64, BlockId, u64); 8]> = SmallVec::new();
        let mut searches = 1;
        let found = loop {
            let walk = match run.first() {
                Some(&(_, bottom, _)) => expandable && blocks[bottom].is_expandable(),
                None => match rest.next() {
                    Some((size, id)) => {
                        let walk = expandable && blocks[id].is_expandable();
                        run.push((size, id, if walk { grow(id) } else { 0 }));
                        walk
                    }
                    None => break None,
                },
            };
            let (mut size, mut id, mut top) = run[run.len() - 1];
            if walk {
                while let Some(&(next_size, next)) = rest.peek() {
                    // As in `get_free_block`: no block grows to less than its size.
                    if next_size >= top {
                        break;
                    }
                    let g = grow(next);
                    if g >= top {
                        break;
                    }
                    (size, id, top) = (next_size, next, g);
                    run.push((size, id, top));
                    rest.next();
                }
            }
            if !serves(req, size, mss, rounding) {
                break None;
            }
            if may_take(&blocks[id]) {
                break Some(id);
            }
            run.pop();
            searches += 1;
        };
        (found, searches)
    };
    if gc {
        idx.searches += searches;
    }
    let id = found?;
    let removed = idx.remove(&blocks[id]);
    debug_assert!(removed);
    Some(id)
}

/// PyTorch's `should_split`: whether block `id`, about to serve `size` bytes, gives its rest
/// back as a free block.
pub fn should_split<D: Device>(core: &Core<D>, id: BlockId, size: u64, expandable: bool) -> bool {
    let b = &core.blocks[id];
    let remaining = b.size - size;
    if b.pool == PoolKind::Small || expandable {
        remaining >= MIN_BLOCK
    } else {
        size < core.cfg.max_split_size && remaining > SMALL_SIZE
    }
}

/// A block's size plus the unmapped block right after it (what it could grow to).
fn expandable_size(blocks: &Arena, id: BlockId) -> u64 {
    let b = &blocks[id];
    let tail = if b.next != NIL && !blocks[b.next].mapped {
        blocks[b.next].size
    } else {
        0
    };
    b.size + tail
}

/// Releases oversize cached blocks of the request's stream until one request's worth is
/// freed (PyTorch's `release_available_cached_blocks`). False when that is impossible.
pub fn release_available_cached_blocks<D: Device>(
    core: &mut Core<D>,
    req: &Request,
) -> Result<bool, DeviceError> {
    let mss = core.cfg.max_split_size;
    if mss == u64::MAX {
        return Ok(false);
    }
    let key = req.size.max(mss);
    let stream = req.stream.0;
    let first = core.index(req.pool).at_least(stream, key).next();
    if let Some((_, id)) = first {
        // This step releases whole segments only: a split block is never released (with a
        // valid `max_split_size`, at least 20 MiB, no split block reaches it anyway).
        if !core.blocks[id].is_expandable()
            && !core.blocks[id].is_split()
            && core.release_block(id)?
        {
            return Ok(true);
        }
    }
    let candidates: Vec<(u64, BlockId)> = core.index(req.pool).below(stream, key).collect();
    let mut released = 0;
    for (size, id) in candidates {
        if released >= key || size < mss {
            break;
        }
        if !core.blocks[id].is_expandable()
            && !core.blocks[id].is_split()
            && core.release_block(id)?
        {
            released += size;
        }
    }
    Ok(released >= key)
}

/// Frees old unsplit large segments once reserved memory passes
/// `garbage_collection_threshold` of the limit (PyTorch's `garbage_collect_cached_blocks`; the ladder runs it before any growth, under every
/// policy).
pub fn garbage_collect_cached_blocks<D: Device>(core: &mut Core<D>) -> Result<(), DeviceError> {
    let Some(limit) = core.limit else {
        return Ok(());
    };
    let threshold = (core.cfg.garbage_collection_threshold * limit as f64) as u64;
    let reserved = core.total_reserved();
    if reserved <= threshold {
        return Ok(());
    }
    let target = reserved - threshold;
    let clock = core.large.searches;
    let age = |c: &Core<D>, id: BlockId| clock - c.blocks[id].gc_base;
    let freeable: Vec<BlockId> = core
        .large
        .all_free()
        .filter(|&id| !core.blocks[id].is_split())
        .collect();
    let mut total_age: u64 = freeable.iter().map(|&id| age(core, id)).sum();
    let mut count = freeable.len() as u64;
    let mut reclaimed = 0;
    let mut freed_one = true;
    while reclaimed < target && freed_one && count > 0 {
        let threshold_age = total_age as f64 / count as f64;
        freed_one = false;
        let ids: Vec<BlockId> = core.large.all_free().collect();
        for id in ids {
            let b = &core.blocks[id];
            if !b.is_split() && !b.is_expandable() && age(core, id) as f64 >= threshold_age {
                freed_one = true;
                reclaimed += b.size;
                total_age -= age(core, id);
                count -= 1;
                core.release_block(id)?;
            }
        }
    }
    Ok(())
}
