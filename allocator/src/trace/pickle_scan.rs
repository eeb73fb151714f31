//! A pre-scan of a pickle's opcodes that bounds how deeply its values can nest, so that a
//! hostile or corrupt file is an error rather than a stack overflow in the decoder.
//!
//! It tracks the pickle machine's stack height and mark depth without building any value;
//! a value cannot nest deeper than the stack was high when it was built (memo tricks aside:
//! the decoder also runs on a thread with a large stack). PyTorch snapshots stay below a
//! height of 20. Unknown opcodes end the scan: the decoder reports them.

/// Stack height (and mark depth) above which a pickle is refused.
pub const MAX_HEIGHT: usize = 10_000;

/// Checks that the pickle's stack never grows beyond [`MAX_HEIGHT`].
pub fn check_nesting(b: &[u8]) -> Result<(), String> {
    let mut i = 0;
    let mut height: usize = 0;
    let mut marks: Vec<usize> = Vec::new();
    while i < b.len() {
        let op = b[i];
        i += 1;
        i = skip_argument(op, b, i);
        match op {
            b'(' => {
                marks.push(height);
                height += 1;
            }
            b'e' | b'u' | 0x90 | b'1' => height = marks.pop().unwrap_or(0),
            b'l' | b'd' | b't' | 0x91 | b'o' | b'i' => height = marks.pop().unwrap_or(0) + 1,
            b'.' => return Ok(()),
            _ => height = (height as isize + effect(op)).max(0) as usize,
        }
        if height > MAX_HEIGHT || marks.len() > MAX_HEIGHT {
            return Err(format!(
                "values are nested more than {MAX_HEIGHT} levels deep"
            ));
        }
        if effect(op) == UNKNOWN {
            return Ok(());
        }
    }
    Ok(())
}

const UNKNOWN: isize = isize::MIN;

/// Net stack effect of opcodes that do not deal with marks.
fn effect(op: u8) -> isize {
    match op {
        b'N' | 0x88 | 0x89 | b'K' | b'M' | b'J' | b'I' | b'L' | b'F' | b'G' | b'S' | b'T'
        | b'U' | b'V' | b'X' | b'B' | b'C' | 0x8a | 0x8b | 0x8c | 0x8d | 0x8e | 0x96 | b']'
        | b'}' | b')' | 0x8f | b'g' | b'h' | b'j' | b'c' | 0x82 | 0x83 | 0x84 | b'P' | 0x97
        | b'2' => 1,
        0x93 | b'a' | 0x86 | b'R' | b'b' | 0x81 | b'0' => -1,
        b's' | 0x87 | 0x92 => -2,
        0x85 | b'Q' | b'p' | b'q' | b'r' | 0x94 | 0x98 | 0x80 | 0x95 => 0,
        b'(' | b'e' | b'u' | 0x90 | b'1' | b'l' | b'd' | b't' | 0x91 | b'o' | b'i' | b'.' => 0,
        _ => UNKNOWN,
    }
}

/// Index after the opcode's argument (clamped to the end of the input).
fn skip_argument(op: u8, b: &[u8], i: usize) -> usize {
    let fixed = |n: usize| (i + n).min(b.len());
    let prefixed = |n: usize| {
        let Some(len) = b.get(i..i + n) else {
            return b.len();
        };
        let mut v = 0usize;
        for (k, &x) in len.iter().enumerate() {
            v |= (x as usize) << (8 * k);
        }
        i.saturating_add(n).saturating_add(v).min(b.len())
    };
    let lines = |n: usize| {
        let mut j = i;
        for _ in 0..n {
            j = b[j.min(b.len())..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| j + p + 1);
        }
        j
    };
    match op {
        b'K' | b'h' | b'q' | 0x82 | 0x80 => fixed(1),
        b'M' | 0x83 => fixed(2),
        b'J' | b'j' | b'r' | 0x84 => fixed(4),
        b'G' | 0x95 => fixed(8),
        b'U' | b'C' | 0x8c | 0x8a => prefixed(1),
        b'T' | b'B' | b'X' | 0x8b => prefixed(4),
        0x8d | 0x8e | 0x96 => prefixed(8),
        b'I' | b'L' | b'F' | b'S' | b'V' | b'g' | b'p' | b'P' => lines(1),
        b'c' | b'i' => lines(2),
        _ => i,
    }
}
