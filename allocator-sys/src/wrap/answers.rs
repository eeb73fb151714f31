//! [`RecordAnswers`] and [`PlayAnswers`]: what a device answered when asked whether an event's
//! work was done, kept from a real run and given again in a replay.
//!
//! The one thing a replay on the simulated device cannot know is how far the real device ran
//! behind the host: whether, when the allocator asked (`query_event`), the work before an event
//! was done. The answer decides what a policy does with pages on their way back, so a run and
//! its replay part where the answers differ. [`RecordAnswers`] keeps the answers of a run (the
//! C library writes them into its trace); [`PlayAnswers`] gives them again, each in the
//! operation of the trace it was given in.
//!
//! Invariants:
//! - only `query_event` answers (`Ok(true)` done, `Ok(false)` pending) are kept or given; every
//!   other call, and a `query_event` that fails, goes to the inner device unchanged;
//! - [`RecordAnswers`] keeps an answer only when it is given on the thread running
//!   [`RecordAnswers::record`], while that runs: the answers of one recorded call, never those of
//!   another pool on the same device or of a call on another thread;
//! - each answer names the stream the event was last recorded on (both wrappers watch
//!   `record_event`; an event never recorded through the wrapper names [`StreamId::DEFAULT`]),
//!   so that a query about a stream's work never gets an answer given about another stream's;
//! - [`PlayAnswers`] asks the inner device first, so an unknown event fails as it would there,
//!   and then gives the first answer not given yet that was recorded in the current operation
//!   about the same stream; a query with none gets the inner device's answer and is counted
//!   ([`AnswerUse::unrecorded`]); answers left in an operation the replay has passed are never
//!   given ([`AnswerUse::used`] counts those given).

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};

use parking_lot::Mutex;

use crate::device::{Device, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId};

/// Implements every [`Device`] method but `query_event` as the inner device's.
macro_rules! forward_all_but_query {
    () => {
        forward! {
            ordinal() -> usize;
            granularity() -> DeviceResult<u64>;
            check_stream(stream: StreamId) -> DeviceResult<()>;
            can_share() -> DeviceResult<bool>;
            malloc(size: u64) -> DeviceResult<DevicePtr>;
            free(ptr: DevicePtr, size: u64) -> DeviceResult<()>;
            mem_info() -> DeviceResult<(u64, u64)>;
            reserve(size: u64) -> DeviceResult<DevicePtr>;
            unreserve(va: DevicePtr, size: u64) -> DeviceResult<()>;
            create_page(size: u64) -> DeviceResult<PageHandle>;
            create_shareable_page(size: u64) -> DeviceResult<PageHandle>;
            release_page(page: PageHandle) -> DeviceResult<()>;
            map(va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()>;
            unmap(va: DevicePtr, size: u64) -> DeviceResult<()>;
            set_access(va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()>;
            create_event() -> DeviceResult<EventHandle>;
            synchronize_event(event: EventHandle) -> DeviceResult<()>;
            synchronize_device() -> DeviceResult<()>;
            is_capturing(stream: StreamId) -> DeviceResult<bool>;
            alloc_host(size: u64) -> DeviceResult<HostPtr>;
            free_host(ptr: HostPtr, size: u64) -> DeviceResult<()>;
            copy_to_host_async(dst: HostPtr, src: DevicePtr, size: u64, stream: StreamId)
                -> DeviceResult<()>;
            copy_to_device_async(dst: DevicePtr, src: HostPtr, size: u64, stream: StreamId)
                -> DeviceResult<()>;
            copy_device_async(dst: DevicePtr, src: DevicePtr, size: u64, stream: StreamId)
                -> DeviceResult<()>;
            open_stream() -> DeviceResult<StreamId>;
            close_stream(stream: StreamId) -> DeviceResult<()>;
            wait_event(stream: StreamId, event: EventHandle) -> DeviceResult<()>;
            export_page(page: PageHandle) -> DeviceResult<OwnedFd>;
            import_page(fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle>;
        }
    };
}

/// Shards of [`Recorded`]'s map, so that streams recording events at once seldom meet.
const RECORDED_SHARDS: usize = 16;

/// The stream each live event was last recorded on, in shards by handle.
#[derive(Debug, Default)]
struct Recorded([Mutex<HashMap<EventHandle, StreamId>>; RECORDED_SHARDS]);

impl Recorded {
    fn shard(&self, event: EventHandle) -> &Mutex<HashMap<EventHandle, StreamId>> {
        // Handles are driver pointers (aligned) or small counters: mix the low bits in.
        let h = event.0 ^ (event.0 >> 7);
        &self.0[(h % RECORDED_SHARDS as u64) as usize]
    }

    fn record<D: Device>(&self, d: &D, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        d.record_event(event, stream)?;
        self.shard(event).lock().insert(event, stream);
        Ok(())
    }

    fn destroy<D: Device>(&self, d: &D, event: EventHandle) -> DeviceResult<()> {
        d.destroy_event(event)?;
        self.shard(event).lock().remove(&event);
        Ok(())
    }

    fn stream_of(&self, event: EventHandle) -> StreamId {
        let known = self.shard(event).lock().get(&event).copied();
        known.unwrap_or(StreamId::DEFAULT)
    }
}

/// Implements `record_event` and `destroy_event` through the wrapper's [`Recorded`].
macro_rules! watch_records {
    () => {
        fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
            self.recorded.record(&self.inner, event, stream)
        }

        fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
            self.recorded.destroy(&self.inner, event)
        }
    };
}

/// An answer: the stream of the event asked about, and whether its work was done.
pub type Given = (StreamId, bool);

thread_local! {
    /// The [`RecordAnswers`] (by address) whose [`RecordAnswers::record`] runs on this thread,
    /// and the answers its device gave on this thread since.
    static RECORDING: std::cell::RefCell<Option<(usize, Vec<Given>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Keeps the answers of the successful `query_event` calls made on the calling thread while a
/// closure given to [`RecordAnswers::record`] runs: the stream the event was recorded on, and
/// `true` when its work was done, `false` when it was pending. Queries made on other threads
/// (other pools sharing the device, calls not recorded) are not kept.
#[derive(Debug)]
pub struct RecordAnswers<D> {
    inner: D,
    recorded: Recorded,
}

impl<D: Device> RecordAnswers<D> {
    /// Wraps `inner`.
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            recorded: Recorded::default(),
        }
    }

    /// Runs `f`, and returns what it returned with the answers the device gave it on this
    /// thread, oldest first. A `record` inside `f` keeps its own answers.
    pub fn record<R>(&self, f: impl FnOnce() -> R) -> (R, Vec<Given>) {
        let me = self as *const Self as usize;
        let outer = RECORDING.with(|r| r.replace(Some((me, Vec::new()))));
        let out = f();
        let answers = RECORDING.with(|r| r.replace(outer));
        (out, answers.map(|(_, a)| a).unwrap_or_default())
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }
}

impl<D: Device> Device for RecordAnswers<D> {
    forward_all_but_query!();
    watch_records!();

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let done = self.inner.query_event(event)?;
        let me = self as *const Self as usize;
        RECORDING.with(|r| {
            if let Some((owner, answers)) = r.borrow_mut().as_mut() {
                if *owner == me {
                    answers.push((self.recorded.stream_of(event), done));
                }
            }
        });
        Ok(done)
    }
}

/// One recorded answer: the operation (an index into the replayed operations) it was given in,
/// the stream of the event asked about, and whether the event's work was done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The operation the query was made in.
    pub op: u64,
    /// The stream the event was recorded on.
    pub stream: StreamId,
    /// True: done; false: pending.
    pub done: bool,
}

/// What a [`PlayAnswers`] gave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnswerUse {
    /// Answers it was given.
    pub recorded: u64,
    /// Recorded answers it gave.
    pub used: u64,
    /// Queries with no recorded answer left in their operation (the inner device answered).
    pub unrecorded: u64,
}

/// The recorded answers and where a [`PlayAnswers`] is in them: the current operation's
/// answers are `answers[from..]` up to the first of a later operation.
#[derive(Debug, Default)]
struct Script {
    answers: Vec<Answer>,
    given: Vec<bool>,
    from: usize,
    op: u64,
    finished: bool,
    used: u64,
    unrecorded: u64,
}

impl Script {
    /// The first answer of the current operation about `stream` not given yet, marked given.
    fn next(&mut self, stream: StreamId) -> Option<bool> {
        while self.answers.get(self.from).is_some_and(|a| a.op < self.op) {
            self.from += 1;
        }
        let op = self.op;
        let at = (self.from..self.answers.len())
            .take_while(|&i| self.answers[i].op == op)
            .find(|&i| !self.given[i] && self.answers[i].stream == stream)?;
        self.given[at] = true;
        Some(self.answers[at].done)
    }
}

/// Answers `query_event` with recorded answers, each in the operation it was recorded in; the
/// replayer says which operation runs ([`PlayAnswers::at_op`]).
#[derive(Debug)]
pub struct PlayAnswers<D> {
    inner: D,
    recorded: Recorded,
    script: Mutex<Script>,
}

impl<D: Device> PlayAnswers<D> {
    /// Wraps `inner` with `answers`, sorted by operation (stable: the recorded order is kept
    /// within one), at operation 0.
    pub fn new(inner: D, mut answers: Vec<Answer>) -> Self {
        answers.sort_by_key(|a| a.op);
        Self {
            inner,
            recorded: Recorded::default(),
            script: Mutex::new(Script {
                given: vec![false; answers.len()],
                answers,
                ..Script::default()
            }),
        }
    }

    /// Operation `op` runs now: later queries get its answers.
    pub fn at_op(&self, op: u64) {
        self.script.lock().op = op;
    }

    /// The replay's operations are over: later queries (the frees of what a trace leaves
    /// live, the pool's drop) get the inner device's answer and are not counted.
    pub fn finish(&self) {
        self.script.lock().finished = true;
    }

    /// The answers given so far.
    pub fn usage(&self) -> AnswerUse {
        let s = self.script.lock();
        AnswerUse {
            recorded: s.answers.len() as u64,
            used: s.used,
            unrecorded: s.unrecorded,
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }
}

impl<D: Device> Device for PlayAnswers<D> {
    forward_all_but_query!();
    watch_records!();

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let inner = self.inner.query_event(event)?;
        let stream = self.recorded.stream_of(event);
        let mut s = self.script.lock();
        if s.finished {
            return Ok(inner);
        }
        match s.next(stream) {
            Some(done) => {
                s.used += 1;
                Ok(done)
            }
            None => {
                s.unrecorded += 1;
                Ok(inner)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SimConfig, SimDevice};

    fn pending_event(dev: &impl Device) -> EventHandle {
        let ev = dev.create_event().unwrap();
        dev.record_event(ev, StreamId(1)).unwrap();
        ev
    }

    #[test]
    fn recording_keeps_the_answers_given_inside_on_its_thread() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        sim.set_auto_complete(false);
        let dev = RecordAnswers::new(sim);
        let ev = pending_event(&dev);
        assert!(!dev.query_event(ev).unwrap(), "outside record: not kept");
        let s = StreamId(1);
        let (done, answers) = dev.record(|| {
            let first = dev.query_event(ev).unwrap();
            std::thread::scope(|t| {
                t.spawn(|| dev.query_event(ev).unwrap());
            });
            dev.inner().complete_all();
            assert!(dev.query_event(EventHandle(9_999)).is_err());
            let inner = dev.record(|| dev.query_event(ev).unwrap());
            assert_eq!(
                inner,
                (true, vec![(s, true)]),
                "a nested record keeps its own"
            );
            (first, dev.query_event(ev).unwrap())
        });
        assert_eq!(done, (false, true));
        assert_eq!(
            answers,
            [(s, false), (s, true)],
            "not another thread's, nor a failed query"
        );
        let (_, none) = dev.record(|| ());
        assert!(none.is_empty());
    }

    #[test]
    fn playing_gives_each_operation_its_answers_about_each_stream() {
        let answers = [
            (4, 1, false),
            (1, 2, false),
            (1, 1, false),
            (1, 1, true),
            (3, 1, false),
        ]
        .map(|(op, s, done)| Answer {
            op,
            stream: StreamId(s),
            done,
        })
        .to_vec();
        let dev = PlayAnswers::new(SimDevice::default(), answers);
        let ev = pending_event(&dev);
        // Operation 0 has no answer: the simulated device's (done) is given.
        assert!(dev.query_event(ev).unwrap());
        dev.at_op(1);
        assert!(!dev.query_event(ev).unwrap());
        assert!(dev.query_event(ev).unwrap());
        assert!(
            dev.query_event(ev).unwrap(),
            "stream 2's answer is not about this event's stream"
        );
        // Operation 3 makes no query: its answer is never given, not even in operation 4.
        dev.at_op(4);
        assert!(!dev.query_event(ev).unwrap());
        assert!(dev.query_event(EventHandle(9_999)).is_err());
        dev.finish();
        assert!(
            dev.query_event(ev).unwrap(),
            "after the operations: not counted"
        );
        let usage = dev.usage();
        assert_eq!(
            usage,
            AnswerUse {
                recorded: 5,
                used: 3,
                unrecorded: 2
            }
        );
    }
}
