//! The events of a trace: what happened ([`Action`], in PyTorch's spelling, and two of ours)
//! and where ([`Event`]). The recorder writes them; the readers of `cudalloc-trace` parse them.

/// PyTorch's trace actions, and the device's answers to the allocator's event queries
/// (`event_done`, `event_pending`: ours; PyTorch writes none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The program dropped the tensor.
    FreeRequested,
    /// The block went back to the pool.
    FreeCompleted,
    /// PyTorch called `cudaMalloc`.
    SegmentAlloc,
    /// PyTorch called `cudaFree`.
    SegmentFree,
    /// PyTorch mapped pages of an expandable segment.
    SegmentMap,
    /// PyTorch unmapped pages of an expandable segment.
    SegmentUnmap,
    /// A snapshot was taken.
    Snapshot,
    /// An allocation failed.
    Oom,
    /// The allocator asked whether an event's work was done, in the call the next allocation
    /// or free event records, and the device answered yes.
    EventDone,
    /// As [`Action::EventDone`], and the device answered that the work was pending.
    EventPending,
}

impl Action {
    /// Every action with its spelling.
    pub const NAMES: [(Action, &'static str); 11] = [
        (Action::Alloc, "alloc"),
        (Action::FreeRequested, "free_requested"),
        (Action::FreeCompleted, "free_completed"),
        (Action::SegmentAlloc, "segment_alloc"),
        (Action::SegmentFree, "segment_free"),
        (Action::SegmentMap, "segment_map"),
        (Action::SegmentUnmap, "segment_unmap"),
        (Action::Snapshot, "snapshot"),
        (Action::Oom, "oom"),
        (Action::EventDone, "event_done"),
        (Action::EventPending, "event_pending"),
    ];

    /// Parses PyTorch's spelling.
    pub fn parse(s: &str) -> Option<Action> {
        Action::NAMES.iter().find(|(_, n)| *n == s).map(|(a, _)| *a)
    }

    /// PyTorch's spelling.
    pub fn name(self) -> &'static str {
        Action::NAMES
            .iter()
            .find(|(a, _)| *a == self)
            .map(|(_, n)| *n)
            .unwrap_or("?")
    }
}

/// One trace event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub action: Action,
    /// Device address.
    pub addr: u64,
    /// Requested bytes (`alloc`, `free_*`) or segment bytes (`segment_*`).
    pub size: u64,
    /// CUDA stream handle.
    pub stream: u64,
    /// Timestamp in microseconds.
    pub time_us: u64,
}
