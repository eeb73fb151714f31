//! Writing our trace format: CSV with the header `action,addr,size,stream,time_us` (see
//! `shared/traces/README.md`), one event a line, numbers in decimal. `cudalloc-trace` reads it
//! back.

use super::event::Event;
use std::io::Write;

/// The header line.
pub const HEADER: &str = "action,addr,size,stream,time_us";

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
    use crate::record::event::Action;

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
}
