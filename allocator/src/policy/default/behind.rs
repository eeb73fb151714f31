//! The `default` policy while the device runs behind the host (`keep_while_behind`).
//!
//! Without a memory cap, pages given back for a growth that are still on their way back once
//! polled (their stream's queued work had not completed: the device runs behind the host, as
//! it does in a program that queues kernels without waiting) are taken back into the cache at
//! once (`keep_while_behind`): the device holds them either way, and the growth maps its own
//! beside them, so given back they only raise the pool's footprint until the device catches up,
//! while cached they serve the next requests of their stream. Until a give-back completes at
//! once the policy is *behind* (`DefaultPolicy::behind`): no giant range is made and giant
//! blocks serve any request of the capped giant size (`giant`). A device that stays behind at
//! every growth never lets a give-back complete at once, so there the budget gives nothing back
//! without a cap and memory grows to the job's high-water mark; one completes after the host
//! waited for the device.
//! Under a cap the pages go back all the same: the cap needs them, and the out-of-memory ladder
//! waits for them.
//!
//! Invariant: `DefaultPolicy::behind` is set only by a give-back without a cap that left pages
//! releasing, cleared by one that left none, and cleared whenever a cap is in force (`place`).

use super::DefaultPolicy;
use crate::pool::block::BlockId;
use crate::pool::Core;
use cudalloc_sys::{Device, DeviceError, StreamId};

impl DefaultPolicy {
    /// After a give-back without a cap (`keep_while_behind`): the blocks it started releasing
    /// that are still releasing (their stream's queued work had not completed when they were
    /// polled) are taken back into the cache, and the policy is behind while there were any.
    /// Pages the device still holds are held by the pool either way, and the growth maps its
    /// own beside them: given back, they would be of use to no request until the device caught
    /// up (the growth's footprint is theirs plus its own), while cached they serve the next
    /// requests of their stream. Blocks in `before` (id and address, [`releasing_now`]) were
    /// releasing before the give-back; one of them whose unmap failed during it is free and
    /// mapped again, and a block the give-back started there with its id would stay
    /// releasing.
    /// With `move_pages`, those of `stream` (the growth's) stay releasing: the growth maps
    /// their pages at its own addresses ([`map_pages`]).
    pub(super) fn keep_what_the_device_holds<D: Device>(
        &mut self,
        core: &mut Core<D>,
        before: &[(BlockId, u64)],
        stream: StreamId,
    ) {
        let held: Vec<BlockId> = releasing_now(core)
            .into_iter()
            .filter(|b| !before.contains(b))
            .map(|(id, _)| id)
            .collect();
        self.behind = !held.is_empty();
        let moving = self.cfg.rules.move_pages;
        for id in held {
            if !(moving && core.blocks[id].stream == stream) {
                core.reclaim_releasing_block(id);
            }
        }
    }
}

/// True when mapping the first `size` bytes of unmapped block `id` would pass the memory
/// limit, the pages `moving` would take from releasing blocks left out (they are reserved
/// already: [`Core::movable_bytes`]).
pub(super) fn over_limit<D: Device>(core: &Core<D>, moving: bool, id: BlockId, size: u64) -> bool {
    let moved = if moving && core.limit().is_some() {
        core.movable_bytes(id, size)
    } else {
        0
    };
    core.over_limit(size.saturating_sub(moved))
}

/// Maps the first `size` bytes of unmapped block `id` in chunks of at most `window`
/// ([`Core::map_block`]), with `moving` ([`super::rules::Rules::move_pages`]) mapping the
/// pages of releasing blocks of its stream there first ([`Core::map_block_moving`]).
pub(super) fn map_pages<D: Device>(
    core: &mut Core<D>,
    moving: bool,
    id: BlockId,
    size: u64,
    window: u64,
) -> Result<Option<BlockId>, DeviceError> {
    if moving && core.releasing_bytes() > 0 {
        core.map_block_moving(id, size, window)
    } else {
        core.map_block(id, size, window)
    }
}

/// The releasing blocks as (id, address): a block that finished releasing during a give-back
/// can lend its id to one the give-back started, but not its address (its pages are unmapped
/// then, and a release starts only on mapped pages), unless its unmap failed.
pub(super) fn releasing_now<D: Device>(core: &Core<D>) -> Vec<(BlockId, u64)> {
    core.releasing_blocks()
        .map(|id| (id, core.blocks[id].addr))
        .collect()
}
