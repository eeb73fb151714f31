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
/// `keep`th allocation stays live), with the garbage-collection clock running.
fn fragmented(sizes_mib: &[u64], keep: usize) -> Pool<SimDevice, TorchExpandable> {
    let cfg = PoolConfig {
        garbage_collection_threshold: 0.5,
        ..PoolConfig::default()
    };
    let sim = SimDevice::new(SimConfig::with_capacity(64 << 30));
    let mut pool = Pool::with_policy(sim, cfg, TorchExpandable).unwrap();
    pool.set_limit(Some(60 << 30));
    let held: Vec<_> = sizes_mib
        .iter()
        .map(|&m| pool.allocate(m * MIB + 4096, S).unwrap())
        .collect();
    for (i, a) in held.into_iter().enumerate() {
        if i % keep != 0 {
            pool.free(a).unwrap();
        }
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
        sizes_mib in proptest::collection::vec(2u64..300, 4..40),
        keep in 2usize..5,
        wants_mib in proptest::collection::vec(2u64..400, 1..12),
        refuse_every in 1u64..4,
    ) {
        let mut pool = fragmented(&sizes_mib, keep);
        let core = &mut pool.core;
        // Refuse blocks by address: some of every walk, sometimes all of them.
        let may_take = |b: &Block| !(b.addr >> 21).is_multiple_of(refuse_every + 1);
        for want in wants_mib {
            let req = request(want * MIB);
            let searches = core.large.searches;
            let expected = set_aside_and_search_again(core, &req, may_take);
            let counted = core.large.searches - searches;
            if let Some(id) = expected {
                core.large.insert(id, &core.blocks[id]);
            }
            let found = get_free_block_where(core, &req, true, may_take);
            prop_assert_eq!(found, expected, "{} MiB", want);
            prop_assert_eq!(core.large.searches - searches - counted, counted);
            if let Some(id) = found {
                core.large.insert(id, &core.blocks[id]);
            }
        }
    }
}
