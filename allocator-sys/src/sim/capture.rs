//! Graph capture on the simulated device: which calls a capture refuses, and what happens to
//! the captures and events involved.
//!
//! # Rules
//!
//! [`SimDevice::begin_capture`] starts a capture of a stream in a [`CaptureMode`], remembering
//! the thread that began it; [`SimDevice::end_capture`] ends it. While a capture is underway
//! (begun and not ended, whether still active or invalidated):
//!
//! - A counted call refused by [`CaptureMode::forbids`] for some underway capture (given
//!   whether the calling thread is the one that began it) fails with
//!   [`DeviceError::capture_unsupported`] (driver code 900). Global mode refuses `malloc`,
//!   `free`, `query_event` and `synchronize_event` on every thread, thread-local mode only on
//!   the capturing thread, relaxed mode none of them; `synchronize_device` is refused by every
//!   capture on every thread.
//! - A refused call invalidates every underway capture that refuses it (the first such call is
//!   remembered) and changes nothing else: no memory is acquired or released, no work
//!   completes, no fault of the fault plan is consumed (the capture is checked first).
//! - `record_event` on a capturing stream succeeds but submits no work: the driver would add an
//!   event node to the graph, which the simulated device does not run. The event keeps its last
//!   record outside a capture and is marked *captured*; `query_event` and `synchronize_event` of
//!   a captured event fail with driver code 1 ([`CAPTURED_EVENT`]) until the event is recorded
//!   again on a stream that is not capturing. The mark outlives the capture.
//! - `end_capture` of an invalidated capture ends it and fails with driver code 901
//!   ([`CAPTURE_INVALIDATED`]), naming the call that invalidated it; ending a stream that is not
//!   being captured is [`DeviceError::InvalidArgument`], and so is beginning a capture of a stream
//!   already captured, of the legacy default stream (`0` or `1`) or of another device's stream.
//!
//! # Invariants (checked by [`SimDevice::check_invariants`])
//!
//! - A stream has at most one capture underway, and none is of a legacy default stream or of
//!   another device's stream.
//! - An invalidated capture names a call that its mode refuses on some thread.
//! - Every captured event is a live event.

use std::thread::{self, ThreadId};

use super::ids::{IdMap, IdSet};
use super::SimDevice;
use crate::device::{
    Call, CaptureMode, DeviceError, DeviceResult, StreamId, CAPTURED_EVENT, CAPTURE_INVALIDATED,
};

/// One capture underway.
#[derive(Debug)]
struct Capture {
    mode: CaptureMode,
    /// The thread that began it.
    thread: ThreadId,
    /// The first call it refused, if any: then it is invalidated.
    invalidated_by: Option<Call>,
}

/// The captures underway and the captured events; part of the device's locked state.
#[derive(Debug, Default)]
pub(super) struct Captures {
    streams: IdMap<StreamId, Capture>,
    /// Events whose last record was on a capturing stream.
    events: IdSet<u64>,
}

impl Captures {
    /// True while a capture of `stream` is underway.
    pub(super) fn is_capturing(&self, stream: StreamId) -> bool {
        self.streams.contains_key(&stream)
    }

    /// Refuses `call`, made from the current thread, if an underway capture forbids it; every
    /// capture that forbids it is invalidated.
    pub(super) fn check(&mut self, call: Call) -> DeviceResult<()> {
        if self.streams.is_empty() {
            return Ok(());
        }
        let me = thread::current().id();
        let mut refused = false;
        for capture in self.streams.values_mut() {
            if capture.mode.forbids(call, capture.thread == me) {
                capture.invalidated_by.get_or_insert(call);
                refused = true;
            }
        }
        match refused {
            true => Err(DeviceError::capture_unsupported(call.name())),
            false => Ok(()),
        }
    }

    /// Notes a record of `event` on `stream`: true (and the event marked captured) when the
    /// stream is capturing, false (and the mark cleared) otherwise.
    pub(super) fn record(&mut self, event: u64, stream: StreamId) -> bool {
        if self.is_capturing(stream) {
            self.events.insert(event);
            true
        } else {
            self.events.remove(&event);
            false
        }
    }

    /// Refuses to query or wait for a captured event (driver code 1, [`CAPTURED_EVENT`]).
    pub(super) fn check_event(&self, call: Call, event: u64) -> DeviceResult<()> {
        if !self.events.contains(&event) {
            return Ok(());
        }
        Err(DeviceError::Driver {
            call: call.name(),
            code: CAPTURED_EVENT,
            message: "operation not permitted on an event last recorded in a capturing stream"
                .into(),
        })
    }

    /// Forgets a destroyed event.
    pub(super) fn forget_event(&mut self, event: u64) {
        self.events.remove(&event);
    }

    /// Asserts the invariants in the module documentation; `live` says whether an event is
    /// live, `foreign` whether a stream belongs to another device.
    pub(super) fn check_invariants(
        &self,
        live: impl Fn(u64) -> bool,
        foreign: impl Fn(StreamId) -> bool,
    ) {
        for (&stream, capture) in &self.streams {
            assert!(stream.0 > 1 && !foreign(stream), "capture of {stream}");
            if let Some(call) = capture.invalidated_by {
                let refuses = [true, false].map(|same| capture.mode.forbids(call, same));
                assert!(refuses.contains(&true), "{stream} invalidated by {call:?}");
            }
        }
        for &event in &self.events {
            assert!(live(event), "captured event {event} is not live");
        }
    }
}

impl SimDevice {
    /// Begins a capture of `stream` in `mode` on the calling thread (`cuStreamBeginCapture`);
    /// see the rules in [`crate::sim`]'s `capture` module documentation, summed up in
    /// [`CaptureMode::forbids`]. Not a counted call.
    pub fn begin_capture(&self, stream: StreamId, mode: CaptureMode) -> DeviceResult<()> {
        let mut s = self.state.lock();
        let problem = match stream {
            _ if stream.0 <= 1 => "the legacy default stream cannot be captured",
            _ if s.foreign.contains(&stream) => "the stream belongs to another device",
            _ if s.captures.is_capturing(stream) => "the stream is already being captured",
            _ => "",
        };
        if !problem.is_empty() {
            let message = format!("{stream}: {problem}");
            return Err(DeviceError::invalid("begin_capture", message));
        }
        let thread = thread::current().id();
        let capture = Capture {
            mode,
            thread,
            invalidated_by: None,
        };
        s.captures.streams.insert(stream, capture);
        Ok(())
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`). Fails with driver code 901 when a
    /// refused call invalidated the capture (the capture is ended all the same), and with
    /// [`DeviceError::InvalidArgument`] when `stream` is not being captured. Not a counted call.
    pub fn end_capture(&self, stream: StreamId) -> DeviceResult<()> {
        let Some(capture) = self.state.lock().captures.streams.remove(&stream) else {
            let message = format!("{stream} is not being captured");
            return Err(DeviceError::invalid("end_capture", message));
        };
        match capture.invalidated_by {
            None => Ok(()),
            Some(call) => Err(DeviceError::Driver {
                call: "end_capture",
                code: CAPTURE_INVALIDATED,
                message: format!(
                    "the capture of {stream} was invalidated by {}, which is not permitted \
                     while a stream is capturing",
                    call.name()
                ),
            }),
        }
    }
}
