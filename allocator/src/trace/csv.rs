//! Our trace format: CSV with the header `action,addr,size,stream,time_us` (see
//! `shared/traces/README.md`), plain or gzip. Lines are parsed from a reused byte buffer; a
//! malformed line is an error naming the file and line.

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
        let got = r
            .read_until(b'\n', &mut line)
            .map_err(|e| TraceError::at(path, n + 1, format!("read failed: {e}")))?;
        if got == 0 {
            break;
        }
        n += 1;
        let text = trim(&line);
        if n == 1 {
            if text != HEADER.as_bytes() {
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
    if field.is_empty() || field.len() > 20 {
        return Err(format!(
            "field `{name}` is not a non-negative integer: `{}`",
            String::from_utf8_lossy(field)
        ));
    }
    let mut v: u64 = 0;
    for &c in field {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            return Err(format!(
                "field `{name}` is not a non-negative integer: `{}`",
                String::from_utf8_lossy(field)
            ));
        }
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(d as u64))
            .ok_or_else(|| format!("field `{name}` overflows 64 bits"))?;
    }
    Ok(v)
}

/// Writes events in our format.
pub struct Writer<W: Write> {
    out: W,
}

impl<W: Write> Writer<W> {
    /// Writes the header.
    pub fn new(mut out: W) -> std::io::Result<Self> {
        writeln!(out, "{HEADER}")?;
        Ok(Writer { out })
    }

    /// Writes one event.
    pub fn write(&mut self, e: &Event) -> std::io::Result<()> {
        writeln!(
            self.out,
            "{},{},{},{},{}",
            e.action.name(),
            e.addr,
            e.size,
            e.stream,
            e.time_us
        )
    }

    /// Flushes and returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}
