//! Blocks and the arena that owns them.
//!
//! A block is a sub-range of a segment. Blocks of one segment form a doubly linked list in address
//! order (`prev`/`next`) that tiles the segment exactly. A block is in exactly one state:
//! allocated (handed out, or waiting for stream events), free (mapped, in its pool's free index),
//! releasing (expandable segments only: free, in no index, its pages unmapped once the work its
//! stream queued before has completed: `pool::releasing`; or *moved*, its pages another block's
//! now and only its addresses left to unmap: `pool::moving`) or unmapped (expandable segments
//! only: addresses with no page behind them, in the pool's unmapped index). Blocks are referred to by [`BlockId`], an index into the [`Arena`]; ids of
//! released blocks are reused.

use crate::sizes::PoolKind;
use cudalloc_sys::StreamId;

/// Index of a block in the `Arena`.
pub type BlockId = u32;
/// "No block".
pub const NIL: BlockId = u32::MAX;
/// "No policy mark" ([`Block::mark`]).
pub const NO_MARK: u64 = u64::MAX;
/// "Not in an expandable segment".
pub const NO_SEGMENT: u32 = u32::MAX;

/// The low bits of a handout number (`crate::pool::Handle::serial`): its place in its range.
const SERIAL_SEQ: u64 = 0xFFFF_FFFF;

static NEXT_SERIALS: crate::sync::IdCounter = crate::sync::IdCounter::new(1);

/// A fresh range of handout numbers, process-wide (bits 32 to 62; the top bit is
/// `POOL_SERIAL`'s): no two pools number their handouts alike (for the first 2^31 ranges), so
/// a handle of another pool (a dropped graph pool's, whose addresses a pool may hold since)
/// never matches a block.
pub(crate) fn fresh_serials() -> u64 {
    let id = NEXT_SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (id & 0x7FFF_FFFF) << 32
}

/// The handout number after `last`, from a fresh range once `last`'s is used up.
pub(crate) fn next_serial(last: u64) -> u64 {
    match last & SERIAL_SEQ {
        SERIAL_SEQ => fresh_serials() + 1,
        _ => last + 1,
    }
}

/// One block.
#[derive(Clone, Debug)]
pub struct Block {
    /// First device address.
    pub addr: u64,
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// Bytes the caller asked for, while allocated.
    pub requested: u64,
    /// The stream the block belongs to.
    pub stream: StreamId,
    /// The pool the block belongs to.
    pub pool: PoolKind,
    /// Neighbour at lower addresses in the same segment.
    pub prev: BlockId,
    /// Neighbour at higher addresses in the same segment.
    pub next: BlockId,
    /// Handed out to a caller (or waiting for events after being freed).
    pub allocated: bool,
    /// Backed by device memory (always true outside expandable segments).
    pub mapped: bool,
    /// Index of the expandable segment, or `NO_SEGMENT`.
    pub segment: u32,
    /// Stream events still pending before the block may return to its pool.
    pub event_count: u32,
    /// Streams other than `stream` that used the block (`record_stream`).
    pub stream_uses: Vec<StreamId>,
    /// The pool's free-search counter when the block was last freed (garbage collection age).
    pub gc_base: u64,
    /// A word the policy may set on an allocated block ([`NO_MARK`]: none); the core clears it
    /// when the block returns to its pool, and tells the policy
    /// ([`crate::policy::Policy::on_marked_free`]).
    pub mark: u64,
    /// The handout it serves, while allocated (`crate::pool::Handle::serial`).
    pub serial: u64,
    /// Free, out of the index, its pages to be unmapped once its stream's earlier work has
    /// completed (`pool::releasing`).
    pub releasing: bool,
    /// Releasing, and its pages moved to another block (`pool::moving`): its addresses stay
    /// mapped to them until its event completes, then are unmapped; the pages stay.
    pub moved: bool,
    /// False for a slot of the [`Arena`] whose block was removed.
    live: bool,
}

impl Block {
    /// A fresh unsplit block.
    pub fn new(addr: u64, size: u64, stream: StreamId, pool: PoolKind) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            stream,
            pool,
            prev: NIL,
            next: NIL,
            allocated: false,
            mapped: true,
            segment: NO_SEGMENT,
            event_count: 0,
            stream_uses: Vec::new(),
            gc_base: 0,
            mark: NO_MARK,
            serial: 0,
            releasing: false,
            moved: false,
            live: true,
        }
    }

    /// True while the block, freed by its caller, waits for other streams' work: events pending,
    /// or deferred until a capture ends (`pool::capture`).
    pub fn waits(&self) -> bool {
        self.event_count > 0 || (!self.allocated && !self.stream_uses.is_empty())
    }

    /// True when the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// True when the block lives in an expandable segment.
    pub fn is_expandable(&self) -> bool {
        self.segment != NO_SEGMENT
    }

    /// One past the last address.
    pub fn end(&self) -> u64 {
        self.addr + self.size
    }

    /// True when the block shares a byte with `lo..hi`.
    pub fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.addr < hi && lo < self.end()
    }
}

/// Owner of all blocks; ids stay valid until [`Arena::remove`] or [`Arena::discard`].
///
/// A removed block's slot keeps a dead block (`live` false) until an insert reuses it, so that
/// indexing by a live id, the pool's every step, reads the slot without a check on whether it
/// holds a block; [`Arena::get`] checks, and indexing by a dead id is a bug (a debug build
/// panics on it).
#[derive(Default)]
pub struct Arena {
    slots: Vec<Block>,
    vacant: Vec<BlockId>,
}

impl Arena {
    /// Stores a block and returns its id.
    pub fn insert(&mut self, b: Block) -> BlockId {
        debug_assert!(b.live);
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = b;
            id
        } else {
            self.slots.push(b);
            (self.slots.len() - 1) as BlockId
        }
    }

    /// Drops a block; its id may be reused.
    pub fn remove(&mut self, id: BlockId) -> Block {
        let slot = &mut self.slots[id as usize];
        assert!(slot.live, "removing a block twice");
        let mut dead = Block::new(0, 0, slot.stream, slot.pool);
        dead.live = false;
        self.vacant.push(id);
        std::mem::replace(slot, dead)
    }

    /// Drops a block that holds nothing to drop (no other streams' uses) where it lies: its
    /// slot keeps its fields, marked dead, until an insert reuses it (cheaper than
    /// [`Arena::remove`], which moves it out).
    pub fn discard(&mut self, id: BlockId) {
        let slot = &mut self.slots[id as usize];
        assert!(slot.live, "removing a block twice");
        debug_assert!(slot.stream_uses.is_empty());
        slot.live = false;
        self.vacant.push(id);
    }

    /// The block with this id, if it exists.
    pub fn get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id as usize).filter(|b| b.live)
    }

    /// The block with this id, if it exists, to change.
    pub fn get_mut(&mut self, id: BlockId) -> Option<&mut Block> {
        self.slots.get_mut(id as usize).filter(|b| b.live)
    }

    /// Every live block with its id.
    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, b)| b.live)
            .map(|(i, b)| (i as BlockId, b))
    }

    /// Number of live blocks.
    pub fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }
}

impl std::ops::Index<BlockId> for Arena {
    type Output = Block;
    fn index(&self, id: BlockId) -> &Block {
        let b = &self.slots[id as usize];
        debug_assert!(b.live, "stale block id");
        b
    }
}

impl std::ops::IndexMut<BlockId> for Arena {
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        let b = &mut self.slots[id as usize];
        debug_assert!(b.live, "stale block id");
        b
    }
}
