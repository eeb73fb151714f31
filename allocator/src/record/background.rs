//! A writer whose writes happen on a thread of their own, so that a slow sink (a gzip encoder,
//! a network file) costs the recording thread a copy instead of the compression.
//!
//! [`BackgroundWriter`] hands each `write` to its thread as one owned buffer through a bounded
//! channel ([`QUEUED_BUFFERS`] deep): when the thread falls that far behind, `write` waits for
//! it, so nothing is dropped and memory stays bounded. Callers should write large buffers
//! (the CSV [`super::csv::Writer`] hands over 64 KiB at a time).
//!
//! Invariants:
//! - bytes reach the sink in the order they were written, and all of them or none after the
//!   first error: the thread keeps the first error and drops later buffers;
//! - once the thread has failed, the next `write` or `flush` returns an error (a copy of the
//!   first one's kind and text), and [`BackgroundWriter::finish`] returns the error itself;
//! - `flush` returns after the thread has written and flushed everything written before it.

use std::io::{self, Write};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Buffers that may wait for the writer thread before `write` blocks.
pub const QUEUED_BUFFERS: usize = 32;

/// What the recording side sends to the writer thread.
enum Message {
    Bytes(Vec<u8>),
    /// Flush the sink, then answer.
    Flush(SyncSender<()>),
}

/// The first error of the writer thread, as the recording side sees it.
type Failure = Arc<Mutex<Option<(io::ErrorKind, String)>>>;

/// A [`Write`] that writes on its own thread; see the module documentation.
pub struct BackgroundWriter<W: Write + Send + 'static> {
    tx: Option<SyncSender<Message>>,
    thread: Option<JoinHandle<(W, io::Result<()>)>>,
    failure: Failure,
}

impl<W: Write + Send + 'static> BackgroundWriter<W> {
    /// Starts the writer thread, which owns `sink` until [`BackgroundWriter::finish`].
    pub fn new(sink: W) -> io::Result<Self> {
        let (tx, rx) = sync_channel(QUEUED_BUFFERS);
        let failure = Failure::default();
        let seen = Arc::clone(&failure);
        let thread = std::thread::Builder::new()
            .name("cudalloc-trace-writer".into())
            .spawn(move || drain(sink, rx, &seen))?;
        Ok(BackgroundWriter {
            tx: Some(tx),
            thread: Some(thread),
            failure,
        })
    }

    /// Writes out everything, stops the thread and returns the sink, or the first error.
    pub fn finish(mut self) -> io::Result<W> {
        self.tx = None; // the thread ends when the channel closes
        let thread = self.thread.take().expect("finish takes the thread once");
        let (sink, result) = thread
            .join()
            .map_err(|_| io::Error::other("the trace writer thread panicked"))?;
        result.map(|()| sink)
    }

    /// A copy of the thread's first error, if it has failed.
    fn failed(&self) -> io::Result<()> {
        match self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            Some((kind, text)) => Err(io::Error::new(*kind, text.clone())),
            None => Ok(()),
        }
    }

    fn send(&self, m: Message) -> io::Result<()> {
        self.failed()?;
        let tx = self.tx.as_ref().expect("the channel is open until finish");
        tx.send(m)
            .map_err(|_| io::Error::other("the trace writer thread has stopped"))
    }
}

impl<W: Write + Send + 'static> Write for BackgroundWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send(Message::Bytes(buf.to_vec()))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let (done_tx, done_rx) = sync_channel(1);
        self.send(Message::Flush(done_tx))?;
        // The thread answers after flushing; it drops the sender unanswered once it has failed
        // (after storing the failure) or if it panicked.
        match done_rx.recv() {
            Ok(()) => Ok(()),
            Err(_) => {
                self.failed()?;
                Err(io::Error::other("the trace writer thread has stopped"))
            }
        }
    }
}

impl<W: Write + Send + 'static> Drop for BackgroundWriter<W> {
    /// Without [`BackgroundWriter::finish`], still writes everything out before returning.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The writer thread: writes each buffer until the first error, which it keeps.
fn drain<W: Write>(mut sink: W, rx: Receiver<Message>, failure: &Failure) -> (W, io::Result<()>) {
    let mut first: io::Result<()> = Ok(());
    for m in rx {
        if first.is_err() {
            continue; // a Flush's sender, dropped unanswered, tells its caller
        }
        let (r, done) = match m {
            Message::Bytes(b) => (sink.write_all(&b), None),
            Message::Flush(done) => (sink.flush(), Some(done)),
        };
        match r {
            Ok(()) => {
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
            Err(e) => {
                // Stored before `done` is dropped (at the end of this iteration).
                *failure.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((e.kind(), e.to_string()));
                first = Err(e);
            }
        }
    }
    if first.is_ok() {
        first = sink.flush();
    }
    (sink, first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that fails every write after the first `ok` bytes.
    #[derive(Debug)]
    struct FailAfter {
        ok: usize,
        got: Vec<u8>,
    }

    impl Write for FailAfter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.got.len() + buf.len() > self.ok {
                return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
            }
            self.got.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A sink whose flush fails.
    #[derive(Debug)]
    struct FlushFails;

    impl Write for FlushFails {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(io::Error::new(io::ErrorKind::BrokenPipe, "flush failed"))
        }
    }

    /// A sink that panics on its first write.
    #[derive(Debug)]
    struct Panics;

    impl Write for Panics {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            panic!("sink panicked");
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A failed flush is reported: the failure is stored before the answer is sent (sending
    /// first made `flush` report success in most runs of this test).
    #[test]
    fn flush_reports_a_failed_flush_and_a_dead_thread() {
        for _ in 0..200 {
            let mut w = BackgroundWriter::new(FlushFails).unwrap();
            w.write_all(b"x").unwrap();
            assert_eq!(w.flush().unwrap_err().kind(), io::ErrorKind::BrokenPipe);
            assert!(w.finish().is_err());
        }
        let mut w = BackgroundWriter::new(Panics).unwrap();
        let _ = w.write_all(b"x"); // the thread dies on it
        assert!(w.flush().is_err(), "a panicked writer thread flushed");
        assert!(w.finish().unwrap_err().to_string().contains("panicked"));
    }

    #[test]
    fn everything_written_arrives_in_order() {
        let mut w = BackgroundWriter::new(Vec::new()).unwrap();
        let mut expected = Vec::new();
        for i in 0..10_000u32 {
            let line = format!("{i}\n");
            w.write_all(line.as_bytes()).unwrap();
            expected.extend_from_slice(line.as_bytes());
        }
        w.flush().unwrap();
        assert_eq!(w.finish().unwrap(), expected);
    }

    #[test]
    fn the_first_error_reaches_later_writes_and_finish() {
        let mut w = BackgroundWriter::new(FailAfter {
            ok: 10,
            got: Vec::new(),
        })
        .unwrap();
        w.write_all(b"0123456789").unwrap();
        w.write_all(b"x").unwrap(); // fails on the thread
        let e = w.flush().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert!(w.write_all(b"y").is_err());
        let e = w.finish().unwrap_err();
        assert_eq!(e.to_string(), "disk full");
    }
}
