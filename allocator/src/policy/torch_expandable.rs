//! `torch-expandable`: PyTorch's `expandable_segments:True`, rule for rule.
//!
//! - place and split: [`torch`]'s rules with `expandable` set: a block's
//!   unmapped tail counts in best fit, and any rest of at least 512 bytes is split off;
//! - grow (`try_allocate_expandable_block`): the lowest-addressed run of free and unmapped
//!   blocks of the request's stream and pool that holds it, or else a new virtual range of 1.125
//!   times the device's memory; its unmapped part is mapped in pages of 2 MiB (small pool) or
//!   20 MiB (large pool), or in one chunk per growth where the pool's config says so
//!   (`whole_growths`: graph pools made from a `default` allocator). Refused when the segment
//!   size PyTorch would ask for passes the memory limit.

use super::{torch, Policy};
use crate::pool::block::BlockId;
use crate::pool::{Core, Request};
use crate::sizes::{PoolKind, LARGE_BUFFER, SMALL_BUFFER};
use cudalloc_sys::{Device, DeviceError, StreamId};

/// PyTorch's caching allocator with expandable segments. It keeps no state.
#[derive(Clone, Copy, Debug, Default)]
pub struct TorchExpandable;

impl Policy for TorchExpandable {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        Ok(torch::get_free_block(core, req, true))
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        torch::should_split(core, id, size, true)
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        if core.over_limit(req.alloc_size) {
            return Ok(None);
        }
        try_allocate_expandable_block(core, req)
    }
}

/// PyTorch's `try_allocate_expandable_block`: find room, map what is missing, and return a free
/// block of at least `req.size` bytes taken out of the free index.
fn try_allocate_expandable_block<D: Device>(
    core: &mut Core<D>,
    req: &Request,
) -> Result<Option<BlockId>, DeviceError> {
    let page = match req.pool {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => LARGE_BUFFER,
    };
    let Some(c) = find_expandable_block(core, req.stream, req.pool, req.size, page)? else {
        return Ok(None);
    };
    // A chunk of at most `window` bytes per driver call; the segment rounds it to pages.
    let window = match core.config().whole_growths {
        true => u64::MAX,
        false => page,
    };
    core.map_run(c, req.size, |core, id, want| {
        core.map_block(id, want, window)
    })
}

/// [`Core::room_in_ranges`], or a new range of 1.125 times the device's memory (as PyTorch
/// reserves) when there is none.
fn find_expandable_block<D: Device>(
    core: &mut Core<D>,
    stream: StreamId,
    pool: PoolKind,
    size: u64,
    page: u64,
) -> Result<Option<BlockId>, DeviceError> {
    if let Some(c) = core.room_in_ranges(stream, pool, size) {
        return Ok(Some(c));
    }
    let (_, total) = core.device.mem_info()?;
    core.new_segment(stream, pool, page, total + total / 8)
}
