//! Where a replay's driver calls go: the operations that made any, each with what it was, the
//! live and reserved bytes after it and the calls of each kind it made
//! ([`ReplayOptions::calls`](crate::replay::ReplayOptions::calls)). For finding which phase of a
//! trace and which request sizes cost a policy its calls. The built-in policies make their
//! calls in allocations only (a free makes none; pages a growth gives back are unmapped by the
//! allocation that finds their stream's work done, on the simulated device the same one), so
//! every row is an allocation today; a policy that calls the driver in a free gets free rows.
//! A failed allocation's calls (an out-of-memory ladder) are kept too.
//!
//! Each step also says whether its allocation took the live bytes to a new high of the replay
//! (`new_high`, against the most live bytes after any earlier operation, with or without
//! calls).
//!
//! Invariants: the steps of one replay marked `new_high` are allocations whose live bytes rise
//! strictly from one to the next. The calls of the steps of one replay add up to the replay's
//! own counts ([`ReplayResult`](crate::replay::ReplayResult)'s `device_*` fields), less what
//! freeing the allocations a trace leaves live costs after its last operation (not an operation
//! of the trace; nothing under the built-in policies).

use crate::replay::Target;
use crate::Op;
use cudalloc::stats::DriverCalls;
use cudalloc::Allocation;

/// One operation of a replay that made at least one driver call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallStep {
    /// The operation's index in the trace.
    pub op: usize,
    /// True for an allocation, false for a free.
    pub alloc: bool,
    /// The bytes the allocation asked for, or that the freed allocation had asked for.
    pub bytes: u64,
    /// The index of the stream in the trace's stream list.
    pub stream: u32,
    /// Live (requested) bytes after the operation.
    pub live: u64,
    /// Reserved bytes after the operation.
    pub reserved: u64,
    /// The calls the operation made, by kind.
    pub calls: DriverCalls,
    /// An allocation that took the live bytes above every figure they had reached before in
    /// this replay: its calls come with live bytes the pool never held before (its growth's
    /// maps, and what the budget gave back for it). Other rows grow past what the pool reserved
    /// before (room fragmentation needs), map again what was given back, or give back.
    pub new_high: bool,
}

/// The steps of one replay, kept as it runs.
#[derive(Default)]
pub(crate) struct CallLog {
    pub steps: Vec<CallStep>,
    /// Calls counted before the current operation.
    before: DriverCalls,
    /// The current operation's bytes and stream.
    what: (u64, u32),
    /// The most live bytes after any operation so far.
    high: u64,
}

impl CallLog {
    /// Notes what operation `op` is about to do (a free's bytes are gone once it ran).
    pub fn before(
        &mut self,
        op: &Op,
        slots: &[Option<Allocation>],
        streams: &[u64],
        pool: &impl Target,
    ) {
        self.before = pool.stats().calls;
        self.what = match *op {
            Op::Alloc { size, stream, .. } => (size, stream),
            Op::Free { slot } => match &slots[slot as usize] {
                Some(a) => (a.size(), stream_index(streams, a.stream().0)),
                None => (0, 0),
            },
        };
    }

    /// Keeps operation `i` when it made calls.
    pub fn after(&mut self, i: usize, op: &Op, pool: &impl Target) {
        let s = pool.stats();
        let live = s.requested_bytes.0[0].current as u64;
        let new_high = matches!(op, Op::Alloc { .. }) && live > self.high;
        self.high = self.high.max(live);
        let (now, was) = (s.calls, self.before);
        let calls = DriverCalls {
            mallocs: now.mallocs - was.mallocs,
            frees: now.frees - was.frees,
            maps: now.maps - was.maps,
            unmaps: now.unmaps - was.unmaps,
        };
        if calls.total() == 0 {
            return;
        }
        self.steps.push(CallStep {
            op: i,
            alloc: matches!(op, Op::Alloc { .. }),
            bytes: self.what.0,
            stream: self.what.1,
            live,
            reserved: s.reserved_bytes.0[0].current as u64,
            calls,
            new_high,
        });
    }
}

/// The index of stream `id` in the trace's list (0 when it is not there).
fn stream_index(streams: &[u64], id: u64) -> u32 {
    streams.iter().position(|&s| s == id).unwrap_or(0) as u32
}
