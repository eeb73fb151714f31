//! Our trace format: CSV with the header `action,addr,size,stream,time_us` (the actions
//! and fields: `docs/cli.md`, *Trace formats*), plain or gzip, the header optionally after a UTF-8 BOM. Lines are
//! parsed from a reused byte buffer; a malformed line is an error naming the file and line, and
//! the field and its value (control characters escaped: `super::shown`).
//! Numbers are decimal digits only: anything else is "not a non-negative integer", and digits
//! whose value passes `u64::MAX` "overflow 64 bits", whatever their count. The writer is the
//! recorder's (`cudalloc::record::csv`), re-exported here.

use super::{Action, Event, Trace, TraceBuilder, TraceError};
use std::io::BufRead;
use std::path::Path;

pub use cudalloc::record::csv::{Writer, HEADER, WRITE_CHUNK};

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
        .ok_or_else(|| format!("unknown action `{}`", super::shown(action_text)))?;
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
    let shown = || super::shown(field);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Action;

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
