//! [`torch::get_free_block_where`] gives the answer of the search it stands for: take each
//! block the best fit found and `may_take` refused out of the free index, search again, and put
//! the refused blocks back; and it counts the same searches on the garbage-collection clock.

use super::torch::{self, get_free_block_where};
use super::TorchExpandable;
use crate::pool::block::{Block, BlockId};
use crate::pool::config::PoolConfig;
use crate::pool::{Core, Request};
use crate::sizes::{self, PoolKind};
use crate::Pool;
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0);

/// The search `get_free_block_where` replaces.
fn set_aside_and_search_again(
    core: &mut Core<SimDevice>,
    req: &Request,
    may_take: impl Fn(&Block) -> bool,
) -> Option<BlockId> {
    let mut aside = Vec::new();
    let found = loop {
        match torch::get_free_block(core, req, true) {
            Some(id) if !may_take(&core.blocks[id]) => aside.push(id),
            other => break other,
        }
    };
    for id in aside {
        core.large.insert(id, &core.blocks[id]);
    }
    found
}

/// A pool of expandable segments holding free blocks of many sizes between live ones (every
/// `keep`th allocation stays live), with the garbage-collection clock running. With `emptied`,
/// the free pages go back to the device, so that many free blocks end at unmapped gaps and
/// could grow: the best-fit walks are long.
fn fragmented(sizes: &[u64], keep: usize, emptied: bool) -> Pool<SimDevice, TorchExpandable> {
    let cfg = PoolConfig {
        garbage_collection_threshold: 0.5,
        ..PoolConfig::default()
    };
    let sim = SimDevice::new(SimConfig::with_capacity(64 << 30));
    let mut pool = Pool::with_policy(sim, cfg, TorchExpandable).unwrap();
    pool.set_limit(Some(60 << 30));
    let held: Vec<_> = sizes
        .iter()
        .map(|&n| pool.allocate(n, S).unwrap())
        .collect();
    for (i, a) in held.into_iter().enumerate() {
        if i % keep != 0 {
            pool.free(a).unwrap();
        }
    }
    if emptied {
        pool.empty_cache().unwrap();
    }
    pool
}

fn request(size: u64) -> Request {
    Request {
        stream: S,
        pool: PoolKind::Large,
        size,
        alloc_size: sizes::segment_size(size),
    }
}

proptest! {
    #[test]
    fn one_walk_finds_what_searching_again_finds(
        sizes in proptest::collection::vec((2u64..300, 0u64..512), 4..40),
        keep in 2usize..5,
        emptied in proptest::bool::ANY,
        wants in proptest::collection::vec(1u64..3200, 1..12),
        refuse_every in 1u64..4,
    ) {
        // Sizes off the page grid, so that freed blocks share pages with live ones.
        let sizes: Vec<u64> = sizes.iter().map(|&(m, k)| m * MIB + k * 4096).collect();
        let mut pool = fragmented(&sizes, keep, emptied);
        let core = &mut pool.core;
        // Refuse blocks by address: some of every walk, sometimes all of them.
        let may_take = |b: &Block| !(b.addr >> 21).is_multiple_of(refuse_every + 1);
        for want in wants {
            // With the free pages given back, what is left free is pieces of chunks: ask for
            // sizes they hold, so that the walks are long.
            let bytes = if emptied { (want % 160 + 1) * MIB / 8 } else { want * MIB / 8 };
            let req = request(bytes);
            let searches = core.large.searches;
            let expected = set_aside_and_search_again(core, &req, may_take);
            let counted = core.large.searches - searches;
            if let Some(id) = expected {
                core.large.insert(id, &core.blocks[id]);
            }
            let found = get_free_block_where(core, &req, true, may_take);
            let counted_again = core.large.searches - searches - counted;
            // Put back before asserting: a block out of the index trips the pool's drop.
            if let Some(id) = found {
                core.large.insert(id, &core.blocks[id]);
            }
            prop_assert_eq!(found, expected, "{} bytes", req.size);
            prop_assert_eq!(counted_again, counted);
        }
    }
}
