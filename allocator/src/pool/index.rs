//! The free-block indexes of one pool.
//!
//! `free` orders free mapped blocks by (stream, size, address): the first entry at or after
//! (stream, size, 0) is PyTorch's best fit. `unmapped` orders unmapped blocks of expandable
//! segments by (stream, address). A block is in at most one of the two, and only while it is
//! neither allocated nor waiting for events.

use super::block::{Block, BlockId};
use std::collections::BTreeMap;
use std::ops::Bound;

/// Free and unmapped blocks of one pool.
#[derive(Default)]
pub struct FreeIndex {
    free: BTreeMap<(u64, u64, u64), BlockId>,
    unmapped: BTreeMap<(u64, u64), BlockId>,
    /// How many times a free block was searched for (garbage-collection clock).
    pub searches: u64,
}

impl FreeIndex {
    /// Adds a free mapped block.
    pub fn insert(&mut self, id: BlockId, b: &Block) {
        let old = self.free.insert((b.stream.0, b.size, b.addr), id);
        debug_assert!(old.is_none(), "block already in the free index");
    }

    /// Removes a free mapped block; returns whether it was there.
    pub fn remove(&mut self, b: &Block) -> bool {
        self.free.remove(&(b.stream.0, b.size, b.addr)).is_some()
    }

    /// The first free block of `stream` with at least `size` bytes, and the ones after it in order.
    pub fn at_least(&self, stream: u64, size: u64) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.free
            .range((stream, size, 0)..)
            .take_while(move |(k, _)| k.0 == stream)
            .map(|(k, id)| (k.1, *id))
    }

    /// Free blocks of `stream` smaller than `size`, largest first.
    pub fn below(&self, stream: u64, size: u64) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.free
            .range((stream, 0, 0)..(stream, size, 0))
            .rev()
            .map(|(k, id)| (k.1, *id))
    }

    /// Every free block id (any stream), smallest first.
    pub fn all_free(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.values().copied()
    }

    /// Number of free blocks.
    pub fn free_len(&self) -> usize {
        self.free.len()
    }

    /// Adds an unmapped block.
    pub fn insert_unmapped(&mut self, id: BlockId, b: &Block) {
        let old = self.unmapped.insert((b.stream.0, b.addr), id);
        debug_assert!(old.is_none(), "block already in the unmapped index");
    }

    /// Removes an unmapped block.
    pub fn remove_unmapped(&mut self, b: &Block) -> bool {
        self.unmapped.remove(&(b.stream.0, b.addr)).is_some()
    }

    /// Unmapped blocks of `stream` in address order.
    pub fn unmapped_of(&self, stream: u64) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped
            .range((
                Bound::Included((stream, 0)),
                Bound::Included((stream, u64::MAX)),
            ))
            .map(|(_, id)| *id)
    }

    /// Every unmapped block id (any stream).
    pub fn all_unmapped(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped.values().copied()
    }

    /// Number of unmapped blocks.
    pub fn unmapped_len(&self) -> usize {
        self.unmapped.len()
    }
}
