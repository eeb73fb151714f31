//! Cross-stream ordering for one [`super::Buffer`]: which streams touched it, and the events
//! that let the next user wait for them.
//!
//! The buffer's *owner* is the stream it was allocated on (and will be freed on). Work on the
//! owner needs nothing: the stream orders it. Other (*foreign*) streams get one slot each, with
//! an event recorded on that stream after every use (through the `SyncOnDrop` returned to
//! cudarc). The owner itself records an event (the *mark*) only when a foreign stream has to
//! wait for it, and only if it touched the buffer since the last mark; the mark then covers
//! everything queued on the owner so far, including the block's previous life in the pool.
//!
//! | use | waits for | records |
//! | --- | --- | --- |
//! | read on the owner | the last foreign writer | nothing |
//! | write on the owner | every foreign slot | nothing; the slots are then forgotten |
//! | read on foreign `S` | the mark if the owner wrote last, else the last writer's slot | `S`'s slot |
//! | write on foreign `S` | the mark and every other slot | `S`'s slot; `S` is the last writer |
//! | free (drop) | the owner waits for every slot | nothing |
//!
//! Nothing is allocated until a foreign stream shows up; a buffer used on its own stream only
//! costs one atomic load per use. Like cudarc's `CudaSlice`, foreign uses are tracked only while
//! the owner's context manages stream synchronization
//! (`CudaContext::is_managing_stream_synchronization`: event tracking on and a stream created
//! with `new_stream`/`fork`); otherwise ordering across streams is the caller's business. Slots
//! that exist are always honoured by owner uses and by the free.
//!
//! When events cannot be created (a driver error), more than [`SLOTS`] foreign streams use the
//! buffer before the owner writes it again, or the foreign stream is the per-thread default
//! stream (handle 0x2 on every thread, for a different stream on each, so no slot can stand
//! for it), a use falls back to waiting on the host: the owner and every slot are
//! synchronized before, and the using stream after, the operation. `Buffer::record_stream` of
//! the per-thread default stream waits on the host at once for the work queued on it so far
//! (on the calling thread's stream).

use cudarc::driver::{CudaEvent, CudaStream, DriverError, SyncOnDrop};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Foreign streams one buffer can track at a time.
pub(super) const SLOTS: usize = 8;

/// `last_writer` value meaning the owner stream.
const OWNER: usize = usize::MAX;

/// The per-buffer state; empty (one null pointer) while only the owner has used the buffer.
#[derive(Debug, Default)]
pub(super) struct Tracker {
    shared: OnceLock<Box<Shared>>,
    /// Streams named through `Buffer::record_stream`, kept alive until the buffer is freed.
    recorded: Mutex<Vec<Arc<CudaStream>>>,
}

#[derive(Debug)]
struct Shared {
    /// Recorded on the owner when a foreign stream must wait for the owner's work.
    mark: CudaEvent,
    /// Serializes refreshing and waiting on `mark`, so no waiter sees a half-done refresh.
    mark_lock: Mutex<()>,
    /// The owner used the buffer since `mark` was last recorded (true at first: the block's
    /// previous life on the owner stream counts).
    owner_dirty: AtomicBool,
    slots: [OnceLock<Slot>; SLOTS],
    /// [`OWNER`] or the slot index of the stream that wrote last.
    last_writer: AtomicUsize,
}

#[derive(Debug)]
struct Slot {
    /// The stream's [`key`].
    stream: (usize, usize),
    /// Recorded on `stream` after each use there.
    event: CudaEvent,
}

enum Trouble {
    Driver(DriverError),
    Full,
    /// The per-thread default stream: no slot can stand for it.
    PerThread,
}

/// The handle of the per-thread default stream (`CU_STREAM_PER_THREAD`).
const PER_THREAD: usize = 2;

fn per_thread(stream: &CudaStream) -> bool {
    stream.cu_stream() as usize == PER_THREAD
}

impl From<DriverError> for Trouble {
    fn from(e: DriverError) -> Self {
        Trouble::Driver(e)
    }
}

/// A stream's identity: its context and its raw `CUstream` handle (the legacy default stream is
/// handle 0 in every context).
fn key(stream: &CudaStream) -> (usize, usize) {
    (
        stream.context().cu_ctx() as usize,
        stream.cu_stream() as usize,
    )
}

fn managing(owner: &CudaStream) -> bool {
    owner.context().is_managing_stream_synchronization()
}

/// Stores a driver error in the owner's context (cudarc's `check_err` reports it later).
fn note<T>(owner: &CudaStream, r: Result<T, DriverError>) {
    owner.context().record_err(r);
}

impl Shared {
    fn new(owner: &CudaStream) -> Result<Shared, DriverError> {
        Ok(Shared {
            mark: owner.context().new_event(None)?,
            mark_lock: Mutex::new(()),
            owner_dirty: AtomicBool::new(true),
            slots: Default::default(),
            last_writer: AtomicUsize::new(OWNER),
        })
    }

    /// The slot of `stream`, taking a free one (and creating its event) if needed.
    fn slot_for(&self, stream: &CudaStream) -> Result<(usize, &Slot), Trouble> {
        let k = key(stream);
        for (i, cell) in self.slots.iter().enumerate() {
            if cell.get().is_none() {
                let event = stream.context().new_event(None)?;
                // Losing a race for this cell is fine: the winner's slot is checked below.
                let _ = cell.set(Slot { stream: k, event });
            }
            match cell.get() {
                Some(slot) if slot.stream == k => return Ok((i, slot)),
                _ => continue,
            }
        }
        Err(Trouble::Full)
    }

    fn filled(&self) -> impl Iterator<Item = (usize, &Slot)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.get().map(|s| (i, s)))
    }

    /// Makes `on` wait for everything queued on the owner so far (if the owner touched the
    /// buffer since the last mark, the mark is recorded again first).
    fn wait_owner(&self, owner: &CudaStream, on: &CudaStream) -> Result<(), DriverError> {
        let _g = self.mark_lock.lock();
        if self.owner_dirty.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.mark.record(owner) {
                self.owner_dirty.store(true, Ordering::Release);
                return Err(e);
            }
        }
        on.wait(&self.mark)
    }

    fn last_writer_slot(&self) -> Option<&Slot> {
        match self.last_writer.load(Ordering::Acquire) {
            OWNER => None,
            i => self.slots.get(i).and_then(OnceLock::get),
        }
    }
}

impl Tracker {
    fn shared(&self, owner: &CudaStream) -> Result<&Shared, DriverError> {
        if let Some(s) = self.shared.get() {
            return Ok(s);
        }
        let fresh = Box::new(Shared::new(owner)?);
        // A racing thread may have set it meanwhile; then `fresh` is dropped.
        Ok(self.shared.get_or_init(|| fresh))
    }

    /// Before a read of the buffer on `on`; the result must be dropped after the read is queued.
    pub(super) fn read<'a>(&'a self, owner: &'a CudaStream, on: &'a CudaStream) -> SyncOnDrop<'a> {
        if on == owner {
            self.owner_read(owner);
            return SyncOnDrop::Record(None);
        }
        if !managing(owner) {
            return SyncOnDrop::Record(None);
        }
        if per_thread(on) {
            return self.fall_back(owner, on, Trouble::PerThread);
        }
        match self.foreign_read(owner, on) {
            Ok(slot) => SyncOnDrop::Record(Some((&slot.event, on))),
            Err(t) => self.fall_back(owner, on, t),
        }
    }

    /// Before a write of the buffer on `on`; the result must be dropped after the write is
    /// queued.
    pub(super) fn write<'a>(
        &'a mut self,
        owner: &'a CudaStream,
        on: &'a CudaStream,
    ) -> SyncOnDrop<'a> {
        if on == owner {
            self.owner_write(owner);
            return SyncOnDrop::Record(None);
        }
        if !managing(owner) {
            return SyncOnDrop::Record(None);
        }
        let this = &*self;
        if per_thread(on) {
            return this.fall_back(owner, on, Trouble::PerThread);
        }
        match this.foreign_write(owner, on) {
            Ok(slot) => SyncOnDrop::Record(Some((&slot.event, on))),
            Err(t) => this.fall_back(owner, on, t),
        }
    }

    /// A read on the owner stream (also what a kernel argument `&Buffer` means).
    pub(super) fn owner_read(&self, owner: &CudaStream) {
        let Some(sh) = self.shared.get() else {
            return;
        };
        sh.owner_dirty.store(true, Ordering::Release);
        if let Some(slot) = sh.last_writer_slot() {
            note(owner, owner.wait(&slot.event));
        }
    }

    /// A write on the owner stream (also what a kernel argument `&mut Buffer` means). Once the
    /// owner waits for every foreign slot, they are all ordered before anything later on the
    /// owner, so the state is dropped and the buffer is back on the fast path.
    pub(super) fn owner_write(&mut self, owner: &CudaStream) {
        let Some(sh) = self.shared.get() else {
            return;
        };
        let mut waited = true;
        for (_, slot) in sh.filled() {
            if let Err(e) = owner.wait(&slot.event) {
                note(owner, Err::<(), _>(e));
                waited = false;
            }
        }
        if waited {
            self.shared.take();
        } else {
            sh.owner_dirty.store(true, Ordering::Release);
            sh.last_writer.store(OWNER, Ordering::Release);
        }
    }

    fn foreign_read(&self, owner: &CudaStream, on: &CudaStream) -> Result<&Slot, Trouble> {
        let sh = self.shared(owner)?;
        let (i, slot) = sh.slot_for(on)?;
        match sh.last_writer.load(Ordering::Acquire) {
            OWNER => sh.wait_owner(owner, on)?,
            w if w != i => {
                if let Some(writer) = sh.slots[w].get() {
                    on.wait(&writer.event)?;
                }
            }
            _ => {}
        }
        Ok(slot)
    }

    fn foreign_write(&self, owner: &CudaStream, on: &CudaStream) -> Result<&Slot, Trouble> {
        let sh = self.shared(owner)?;
        let (i, slot) = sh.slot_for(on)?;
        sh.wait_owner(owner, on)?;
        for (j, other) in sh.filled() {
            if j != i {
                on.wait(&other.event)?;
            }
        }
        sh.last_writer.store(i, Ordering::Release);
        Ok(slot)
    }

    /// No events to be had: wait for everything on the host now, and for `on` after the use.
    fn fall_back<'a>(
        &'a self,
        owner: &'a CudaStream,
        on: &'a CudaStream,
        t: Trouble,
    ) -> SyncOnDrop<'a> {
        if let Trouble::Driver(e) = t {
            note(owner, Err::<(), _>(e));
        }
        note(owner, owner.synchronize());
        if let Some(sh) = self.shared.get() {
            for (_, slot) in sh.filled() {
                note(owner, slot.event.synchronize());
            }
        }
        SyncOnDrop::sync_stream(on)
    }

    /// Keeps `stream` for [`Tracker::take_recorded`] (once per stream); the per-thread default
    /// stream is waited for on the host now instead (it names another stream on the thread
    /// that drops the buffer).
    pub(super) fn record_stream(&self, owner: &CudaStream, stream: &Arc<CudaStream>) {
        if **stream == *owner {
            return;
        }
        if per_thread(stream) {
            note(owner, stream.synchronize());
            return;
        }
        let mut r = self.recorded.lock();
        if !r.iter().any(|s| **s == **stream) {
            r.push(stream.clone());
        }
    }

    /// The streams named through `record_stream`.
    pub(super) fn take_recorded(&mut self) -> Vec<Arc<CudaStream>> {
        std::mem::take(self.recorded.get_mut())
    }

    /// Before the buffer goes back to its pool on the owner stream: the owner waits for every
    /// foreign use, so the free (and any reuse on the owner) comes after them.
    pub(super) fn before_free(&mut self, owner: &CudaStream) {
        let Some(sh) = self.shared.take() else {
            return;
        };
        for (_, slot) in sh.filled() {
            if owner.wait(&slot.event).is_err() {
                // Without the wait, the only safe order is the host's.
                note(owner, slot.event.synchronize());
            }
        }
    }

    /// Number of foreign streams tracked now (for tests and debugging).
    pub(super) fn foreign_streams(&self) -> usize {
        self.shared.get().map_or(0, |sh| sh.filled().count())
    }
}
