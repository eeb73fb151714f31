//! Our trace format: CSV with the header `action,addr,size,stream,time_us` (see
//! `shared/traces/README.md`), plain or gzip, the header optionally after a UTF-8 BOM. Lines are
//! parsed from a reused byte buffer; a malformed line is an error naming the file and line.
//! Numbers are decimal digits only: anything else is "not a non-negative integer", and digits
//! whose value passes `u64::MAX` "overflow 64 bits", whatever their count.

use super::{Action, Event, Trace, TraceBuilder, TraceError};
use std::io::{BufRead, Write};
use std::path::Path;

/// The header line.
pub const HEADER: &str = "action,addr,size,stream,time_us";

/// Reads our CSV format from `r` (already decompressed).
pub fn read(path: &Path, mut r: impl BufRead) -> Result<Trace, TraceError> {
    let mut b = TraceBuilder::new(super::trace_name(path));
    let mut line = Vec::with_capacity(128);
    let mut n = 0u64;
    loop {
        line.clear();
        let got = super::read_line(path, &mut r, n + 1, &mut line)?;
        if got == 0 {
            break;
        }
        n += 1;
        let text = trim(&line);
        if n == 1 {
            if super::strip_bom(text) != HEADER.as_bytes() {
                return Err(TraceError::at(
                    path,
                    1,
                    format!("expected the header `{HEADER}`"),
                ));
            }
            continue;
        }
        if text.is_empty() {
            continue;
        }
        let e = parse_line(text).map_err(|m| TraceError::at(path, n, m))?;
        b.push(e, n);
    }
    if n == 0 {
        return Err(TraceError::file(path, "empty file (no header)"));
    }
    Ok(b.finish())
}

fn trim(line: &[u8]) -> &[u8] {
    let mut end = line.len();
    while end > 0 && (line[end - 1] == b'\n' || line[end - 1] == b'\r') {
        end -= 1;
    }
    &line[..end]
}

/// Parses one data line.
pub fn parse_line(text: &[u8]) -> Result<Event, String> {
    let mut fields = text.split(|&c| c == b',');
    let mut next = |name: &str| {
        fields
            .next()
            .ok_or_else(|| format!("missing field `{name}` (expected 5 fields)"))
    };
    let action_text = next("action")?;
    let action = std::str::from_utf8(action_text)
        .ok()
        .and_then(Action::parse)
        .ok_or_else(|| format!("unknown action `{}`", String::from_utf8_lossy(action_text)))?;
    let addr = number(next("addr")?, "addr")?;
    let size = number(next("size")?, "size")?;
    let stream = number(next("stream")?, "stream")?;
    let time_us = number(next("time_us")?, "time_us")?;
    if fields.next().is_some() {
        return Err("more than 5 fields".to_string());
    }
    Ok(Event {
        action,
        addr,
        size,
        stream,
        time_us,
    })
}

fn number(field: &[u8], name: &str) -> Result<u64, String> {
    let shown = || String::from_utf8_lossy(field);
    if field.is_empty() || !field.iter().all(u8::is_ascii_digit) {
        return Err(format!(
            "field `{name}` is not a non-negative integer: `{}`",
            shown()
        ));
    }
    field
        .iter()
        .try_fold(0u64, |v, &c| {
            v.checked_mul(10)?.checked_add(u64::from(c - b'0'))
        })
        .ok_or_else(|| format!("field `{name}` overflows 64 bits: `{}`", shown()))
}

/// Bytes a [`Writer`] collects before it writes them to its output in one call.
pub const WRITE_CHUNK: usize = 64 << 10;

/// Writes events in our format. Lines are collected and written to the output in chunks of
/// [`WRITE_CHUNK`] bytes (one `write_all` each), so a slow output such as a gzip encoder is
/// called once per thousand or so events, not once per field; [`Writer::flush`] and
/// [`Writer::finish`] write out the rest, and so does dropping the writer (errors ignored).
pub struct Writer<W: Write> {
    /// `None` only after [`Writer::finish`].
    out: Option<W>,
    buf: Vec<u8>,
}

impl<W: Write> Writer<W> {
    /// A writer whose first line is the header.
    pub fn new(out: W) -> std::io::Result<Self> {
        let mut buf = Vec::with_capacity(WRITE_CHUNK + 128);
        buf.extend_from_slice(HEADER.as_bytes());
        buf.push(b'\n');
        Ok(Writer {
            out: Some(out),
            buf,
        })
    }

    /// Writes one event (to the output once a chunk is full).
    pub fn write(&mut self, e: &Event) -> std::io::Result<()> {
        // The longest line: a 14-byte action and four 20-digit numbers with their separators.
        let mut line = [0u8; 100];
        let name = e.action.name().as_bytes();
        line[..name.len()].copy_from_slice(name);
        let mut at = name.len();
        for v in [e.addr, e.size, e.stream, e.time_us] {
            line[at] = b',';
            at = put_decimal(&mut line, at + 1, v);
        }
        line[at] = b'\n';
        self.buf.extend_from_slice(&line[..=at]);
        if self.buf.len() >= WRITE_CHUNK {
            self.write_out()?;
        }
        Ok(())
    }

    /// Writes the collected lines to the output and flushes it.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.write_out()?;
        self.out.as_mut().map_or(Ok(()), Write::flush)
    }

    /// Flushes and returns the output.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.flush()?;
        Ok(self.out.take().expect("the output is there until finish"))
    }

    fn write_out(&mut self) -> std::io::Result<()> {
        let r = match self.out.as_mut() {
            Some(out) => out.write_all(&self.buf),
            None => Ok(()),
        };
        self.buf.clear();
        r
    }
}

impl<W: Write> Drop for Writer<W> {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// "00" to "99", two bytes each.
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// Writes `v` in decimal at `line[at..]`, two digits per step; returns the index after it.
fn put_decimal(line: &mut [u8], at: usize, mut v: u64) -> usize {
    let len = decimal_len(v);
    let mut end = at + len;
    while v >= 100 {
        let p = (v % 100) as usize * 2;
        v /= 100;
        line[end - 2..end].copy_from_slice(&PAIRS[p..p + 2]);
        end -= 2;
    }
    if v >= 10 {
        line[end - 2..end].copy_from_slice(&PAIRS[v as usize * 2..v as usize * 2 + 2]);
    } else {
        line[end - 1] = b'0' + v as u8;
    }
    at + len
}

/// Digits of `v` in decimal.
fn decimal_len(v: u64) -> usize {
    v.checked_ilog10().map_or(1, |d| d as usize + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_rust_formats_them() {
        let mut line = [0u8; 24];
        for v in [
            0,
            9,
            10,
            99,
            100,
            101,
            12_345,
            1 << 40,
            u64::MAX - 1,
            u64::MAX,
        ] {
            let end = put_decimal(&mut line, 2, v);
            assert_eq!(&line[2..end], v.to_string().as_bytes());
        }
    }

    /// A writer dropped without `finish` still writes out what it collected.
    #[test]
    fn dropping_the_writer_writes_out_the_rest() {
        let mut out = Vec::new();
        {
            let mut w = Writer::new(&mut out).unwrap();
            w.write(&Event {
                action: Action::Oom,
                addr: 0,
                size: 1,
                stream: 2,
                time_us: 3,
            })
            .unwrap();
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{HEADER}\noom,0,1,2,3\n")
        );
    }

    #[test]
    fn lines_read_back_whole_across_chunks() {
        let mut w = Writer::new(Vec::new()).unwrap();
        let events: Vec<Event> = (0..5_000u64)
            .map(|i| Event {
                action: if i % 2 == 0 {
                    Action::Alloc
                } else {
                    Action::FreeCompleted
                },
                addr: u64::MAX - i,
                size: i * 512,
                stream: i % 3,
                time_us: i,
            })
            .collect();
        for e in &events {
            w.write(e).unwrap();
        }
        let bytes = w.finish().unwrap();
        assert!(bytes.len() > WRITE_CHUNK);
        let text = String::from_utf8(bytes).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(HEADER));
        for (e, l) in events.iter().zip(lines) {
            assert_eq!(parse_line(l.as_bytes()).unwrap(), *e, "{l}");
        }
    }
}
