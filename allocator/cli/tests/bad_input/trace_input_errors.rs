//! Trace input at the edges of the formats, each read through `trace::read` (and the
//! `cudalloc` binary where a crash or the exit status is the point):
//! - pickles nested a million levels deep through opcodes that nest (`TUPLE1..3`, marks,
//!   `TUPLE`, `LIST`, `APPEND(S)`, `SETITEM(S)`, `ADDITEMS`, `REDUCE`, through memo references):
//!   an error saying so, never a stack overflow (`cudalloc replay` exits 2); nesting under the
//!   limit still reads;
//! - a UTF-8 BOM before the header of our CSV and of an RMM log, plain and gzip'd;
//! - snapshot pickles of protocols 0 and 1 (no `PROTO` opcode); a pickle cut short, of any
//!   protocol, says it is truncated;
//! - which device of a snapshot is read when only another one has events, or several do;
//! - messages: ints shown as Python prints them, any all-digit number too large "overflows 64
//!   bits", a truncated gzip stream and trailing data after one say so, with file and line; a
//!   text field's control characters are shown escaped, and a long field cut;
//! - a `free_completed` whose size or stream is not its allocation's is counted;
//! - a pickle whose memo references multiply what it decodes to is an error (exit 2); a line
//!   longer than 4 KiB is an error naming it; bytes after a pickle's STOP are ignored.

use cudalloc_trace::{self as trace, pytorch, Anomalies, Op, Trace, TraceError};
use serde_pickle::{HashableValue, SerOptions, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-input-errors");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = scratch(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

fn read(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    trace::read(&write(name, bytes))
}

/// The error of reading `bytes` as file `name`, whose text names the file.
fn read_err(name: &str, bytes: &[u8]) -> TraceError {
    let e = read(name, bytes).expect_err(name);
    assert!(e.to_string().contains(name), "{e}");
    e
}

/// `cudalloc replay` of a file: (exit status, stderr).
fn replay(path: &Path) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(["replay", "--policy", "default"])
        .arg(path)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn alloc(slot: u32, stream: u32, size: u64) -> Op {
    Op::Alloc { slot, stream, size }
}

// ---- nesting ------------------------------------------------------------------------------------

const LEVELS: u32 = 1_000_000;

/// `{'device_traces': V}` where V is `LEVELS` levels of `before` + (the level below) + `after`,
/// the level below got from the memo (id k - 1) and each level put under id k.
fn memo_chain(before: &[u8], after: &[u8]) -> Vec<u8> {
    let mut b = b"\x80\x04Nr\x00\x00\x00\x000".to_vec();
    for k in 1..=LEVELS {
        b.extend_from_slice(before);
        b.push(b'j');
        b.extend((k - 1).to_le_bytes());
        b.extend_from_slice(after);
        b.push(b'r');
        b.extend(k.to_le_bytes());
        b.push(b'0');
    }
    b.extend(b"}X\x0d\x00\x00\x00device_tracesj");
    b.extend(LEVELS.to_le_bytes());
    b.extend(b"s.");
    b
}

/// Pickles nested `LEVELS` deep, by name.
fn deep_pickles() -> Vec<(&'static str, Vec<u8>)> {
    let n = LEVELS as usize;
    let dict = b"\x80\x02}X\x0d\x00\x00\x00device_traces";
    vec![
        (
            "tuple1",
            [&b"\x80\x02]"[..], &b"\x85".repeat(n), b"."].concat(),
        ),
        (
            "tuple1_dict",
            [&dict[..], b")", &b"\x85".repeat(n), b"s."].concat(),
        ),
        (
            "tuple2",
            [&b"\x80\x02N"[..], &b"N\x86".repeat(n), b"."].concat(),
        ),
        (
            "tuple3",
            [&b"\x80\x02N"[..], &b"NN\x87".repeat(n), b"."].concat(),
        ),
        (
            "marks",
            [&b"\x80\x02"[..], &b"(".repeat(n), &b"l".repeat(n), b"."].concat(),
        ),
        ("append", memo_chain(b"]", b"a")),
        ("appends", memo_chain(b"](", b"e")),
        ("setitem", memo_chain(b"}N", b"s")),
        ("setitems", memo_chain(b"}(N", b"u")),
        ("additems", memo_chain(b"\x8f(", b"\x90")),
        ("tuple", memo_chain(b"(", b"t")),
        ("list", memo_chain(b"(", b"l")),
        (
            "reduce",
            memo_chain(b"c__builtin__\nfrozenset\n(", b"l\x85R"),
        ),
    ]
}

#[test]
fn deeply_nested_pickles_are_an_error_not_a_stack_overflow() {
    for (name, bytes) in deep_pickles() {
        let e = read_err(&format!("deep_{name}.pickle"), &bytes);
        assert!(e.message.contains("nested more than"), "{name}: {e}");
    }
}

#[test]
fn cli_replay_of_a_deeply_nested_pickle_exits_2() {
    for (name, bytes) in deep_pickles().into_iter().take(2) {
        let p = write(&format!("cli_{name}.pickle"), &bytes);
        let (code, err) = replay(&p);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains("nested more than"), "{name}: {err}");
        assert!(err.contains(&*p.to_string_lossy()), "{name}: {err}");
    }
}

/// 84 bytes that ask the decoder for 2^40 values (each DUP + APPEND doubles a list): an error
/// naming the file, not an aborted allocation.
#[test]
fn cli_replay_of_a_pickle_that_copies_containers_exits_2() {
    let bomb = [&b"\x80\x02]"[..], &b"2a".repeat(40), b"."].concat();
    let p = write("cli_dup_bomb.pickle", &bomb);
    let (code, err) = replay(&p);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("DUP") && err.contains(&*p.to_string_lossy()),
        "{err}"
    );
}

/// A 300 KB pickle of a list of 100,000 memo references to a list of 100,000 values: the
/// decoder would copy the list for each reference (10^10 values, more memory than the host
/// has): an error naming the file.
#[test]
fn cli_replay_of_a_pickle_whose_memo_references_multiply_exits_2() {
    let n = 100_000;
    let bomb = [
        &b"\x80\x02]q\x00("[..],
        &b"N".repeat(n),
        b"e](",
        &b"h\x00".repeat(n),
        b"e.",
    ]
    .concat();
    let p = write("cli_memo_bomb.pickle", &bomb);
    let (code, err) = replay(&p);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("memo references") && err.contains(&*p.to_string_lossy()),
        "{err}"
    );
}

/// One enormous line (a file of another kind, a JSON dump gzip'd) is refused at its first
/// 4 KiB, naming the line, rather than read whole into memory first.
#[test]
fn a_line_longer_than_any_trace_line_is_refused() {
    let long = |header: &str| format!("{header}\n{}\n", "x".repeat(1 << 20));
    let e = read_err("long_line.csv", long(trace::csv::HEADER).as_bytes());
    assert!(e.to_string().contains(":2: longer than 4096 bytes"), "{e}");
    let e = read_err(
        "long_first_line.csv.gz",
        &gzip(long("action").replace('\n', "").as_bytes()),
    );
    assert!(e.to_string().contains(":1: longer than 4096 bytes"), "{e}");
    let rmm = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n{}",
        "1,".repeat(1 << 19)
    );
    let e = read_err("long_line.rmm.csv", rmm.as_bytes());
    assert!(e.to_string().contains(":2: longer than 4096 bytes"), "{e}");
}

/// Bytes after the pickle's STOP (a newline, a second pickle) are ignored, as Python's
/// `pickle.load` and the converter ignore them; the reader refused the file before.
#[test]
fn bytes_after_a_snapshot_pickle_are_ignored() {
    let one = snapshot(&[3]);
    let want = read("one.pickle", &one).unwrap().ops;
    for (name, tail) in [("newline", &b"\n"[..]), ("second", &one[..])] {
        let t = read(
            &format!("trailing_{name}.pickle"),
            &[&one[..], tail].concat(),
        )
        .unwrap();
        assert_eq!(t.ops, want, "{name}");
    }
}

#[test]
fn nesting_under_the_limit_still_reads() {
    // {'device_traces': [[]], 'deep': ((...(None,)...),)} with 990 tuples.
    let mut b = b"\x80\x02}(X\x0d\x00\x00\x00device_traces]]aX\x04\x00\x00\x00deepN".to_vec();
    b.extend(b"\x85".repeat(990));
    b.extend(b"u.");
    assert_eq!(read("under_limit.pickle", &b).unwrap().events, 0);
}

// ---- detection ----------------------------------------------------------------------------------

const BOM: &[u8] = b"\xef\xbb\xbf";
const OURS: &[u8] =
    b"action,addr,size,stream,time_us\nalloc,4096,100,0,1\nfree_completed,4096,100,0,2\n";
const RMM: &[u8] = b"Thread,Time,Action,Pointer,Size,Stream\n\
      1,08:00:00.000001,allocate,0x1000,100,0x0\n\
      1,08:00:00.000002,free,0x1000,100,0x0\n";

#[test]
fn a_bom_before_the_header_is_skipped() {
    for (name, text) in [("ours", OURS), ("rmm", RMM)] {
        let with_bom = [BOM, text].concat();
        let plain = read(&format!("{name}_bom.csv"), &with_bom).unwrap();
        let gz = read(&format!("{name}_bom.csv.gz"), &gzip(&with_bom)).unwrap();
        for t in [&plain, &gz] {
            assert_eq!(t.events, 2, "{name}");
            assert_eq!(t.ops, [alloc(0, 0, 100), Op::Free { slot: 0 }], "{name}");
        }
    }
}

// SNAPSHOT = {'device_traces': [[
//     {'action': 'alloc', 'addr': 4096, 'size': 10, 'stream': -1, 'time_us': 5,
//      'frames': [{'filename': 'a.py', 'line': 3, 'name': 'f'}]},
//     {'action': 'free_completed', 'addr': 4096, 'size': 10, 'stream': -1, 'time_us': 7,
//      'frames': []},
//     {'action': 'oom', 'device_free': 123, 'size': 2**40, 'stream': 0}]],
//   'segments': [], 'allocator_settings': {'x': True, 'y': 1.5}}

/// `pickle.dumps(SNAPSHOT, protocol=0)`: see [`snapshot_protocols_0_and_1_are_read`].
const PROTOCOL_0: &[u8] =
    b"(dp0\nVdevice_traces\np1\n(lp2\n(lp3\n(dp4\nVaction\np5\nValloc\np6\nsVaddr\n\
      p7\nI4096\nsVsize\np8\nI10\nsVstream\np9\nI-1\nsVtime_us\np10\nI5\nsVframes\n\
      p11\n(lp12\n(dp13\nVfilename\np14\nVa.py\np15\nsVline\np16\nI3\nsVname\n\
      p17\nVf\np18\nsasa(dp19\ng5\nVfree_completed\np20\nsg7\nI4096\nsg8\nI10\n\
      sg9\nI-1\nsg10\nI7\nsg11\n(lp21\nsa(dp22\ng5\nVoom\np23\nsVdevice_free\n\
      p24\nI123\nsg8\nL1099511627776L\nsg9\nI0\nsaasVsegments\np25\n(lp26\nsVallocator_settings\n\
      p27\n(dp28\nVx\np29\nI01\nsVy\np30\nF1.5\nss.";

/// `pickle.dumps(SNAPSHOT, protocol=1)`: see [`snapshot_protocols_0_and_1_are_read`].
const PROTOCOL_1: &[u8] =
    b"}q\x00(X\x0d\x00\x00\x00device_tracesq\x01]q\x02]q\x03(}q\x04(X\x06\x00\x00\x00actionq\x05\
      X\x05\x00\x00\x00allocq\x06X\x04\x00\x00\x00addrq\x07M\x00\x10X\x04\x00\x00\x00sizeq\x08\
      K\nX\x06\x00\x00\x00streamq\x09J\xff\xff\xff\xffX\x07\x00\x00\x00time_usq\n\
      K\x05X\x06\x00\x00\x00framesq\x0b]q\x0c}q\x0d(X\x08\x00\x00\x00filenameq\x0eX\x04\x00\x00\
      \x00a.pyq\x0fX\x04\x00\x00\x00lineq\x10K\x03X\x04\x00\x00\x00nameq\x11X\x01\x00\x00\x00\
      fq\x12uau}q\x13(h\x05X\x0e\x00\x00\x00free_completedq\x14h\x07M\x00\x10h\x08K\n\
      h\x09J\xff\xff\xff\xffh\nK\x07h\x0b]q\x15u}q\x16(h\x05X\x03\x00\x00\x00oomq\x17X\x0b\x00\
      \x00\x00device_freeq\x18K{h\x08L1099511627776L\nh\x09K\x00ueaX\x08\x00\x00\x00segmentsq\x19\
      ]q\x1aX\x12\x00\x00\x00allocator_settingsq\x1b}q\x1c(X\x01\x00\x00\x00xq\x1dI01\n\
      X\x01\x00\x00\x00yq\x1eG?\xf8\x00\x00\x00\x00\x00\x00uu.";

#[test]
fn snapshot_protocols_0_and_1_are_read() {
    for (name, bytes) in [("p0.pickle", PROTOCOL_0), ("p1.pickle", PROTOCOL_1)] {
        let t = read(name, bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.events, 3, "{name}");
        assert_eq!(t.ops, [alloc(0, 0, 10), Op::Free { slot: 0 }], "{name}");
        assert_eq!(t.streams, [u64::MAX], "{name}");
        assert_eq!(t.anomalies, Anomalies::default(), "{name}");
        let gz = read(&format!("{name}.gz"), &gzip(bytes)).unwrap();
        assert_eq!(gz.ops, t.ops, "{name}");
    }
}

/// A snapshot pickle cut anywhere before its STOP says it is truncated, whatever the protocol:
/// the decoder's own words were `eval error at offset N: EOF while parsing`, and for a literal
/// of protocol 0 cut by the end `literal is invalid: ` (nothing after). A pickle whole but wrong
/// keeps the decoder's words.
#[test]
fn a_snapshot_pickle_cut_short_says_it_is_truncated() {
    let p3 = snapshot(&[2]);
    for (name, bytes) in [
        ("cut_p0.pickle", PROTOCOL_0),
        ("cut_p1.pickle", PROTOCOL_1),
        ("cut_p3.pickle", &p3),
    ] {
        // Names of their own: tests run in parallel over one scratch folder.
        for cut in 1..bytes.len() {
            let e = read_err(name, &bytes[..cut]);
            assert_eq!(
                e.message,
                format!(
                    "not a readable snapshot pickle: truncated (the file ends inside the \
                     pickle, after {cut} bytes)"
                ),
                "{name} cut at {cut}"
            );
        }
    }
    let e = read_err("stop.pickle", b"\x80\x02.");
    assert!(e.message.ends_with("pickle stack underflow"), "{e}");
}

// ---- which device -------------------------------------------------------------------------------

fn event(addr: i64) -> Value {
    let fields = [
        ("action", Value::String("alloc".into())),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(addr)),
        ("stream", Value::I64(0)),
    ];
    let d = fields
        .into_iter()
        .map(|(k, v)| (HashableValue::String(k.into()), v));
    Value::Dict(d.collect())
}

/// A snapshot whose device `d` has `counts[d]` events.
fn snapshot(counts: &[usize]) -> Vec<u8> {
    let devices = counts
        .iter()
        .map(|&n| Value::List((1..=n as i64).map(|a| event(a * 512)).collect()))
        .collect();
    let top = [(
        HashableValue::String("device_traces".into()),
        Value::List(devices),
    )];
    serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new()).unwrap()
}

#[test]
fn the_device_read_is_0_or_the_only_one_with_events() {
    for (counts, events) in [
        (&[0, 3][..], 3),
        (&[0, 0, 0, 2], 2),
        (&[1, 3], 1),
        (&[2, 0, 5, 7], 2),
        (&[0, 0], 0),
        (&[], 0),
    ] {
        let t = pytorch::read_snapshot(Path::new("s"), &snapshot(counts)).unwrap();
        assert_eq!(t.events, events, "{counts:?}");
        let t = read(&format!("devices{counts:?}.pickle"), &snapshot(counts)).unwrap();
        assert_eq!(t.events, events, "{counts:?}");
    }
    let t = pytorch::read_snapshot_device(Path::new("s"), &snapshot(&[0, 3]), 0).unwrap();
    assert_eq!(t.events, 0, "a device given is read even when empty");
}

#[test]
fn several_devices_with_events_and_none_on_device_0_is_an_error() {
    let p = write("several_devices.pickle", &snapshot(&[0, 4, 0, 2]));
    let e = trace::read(&p).unwrap_err();
    assert!(
        e.message
            .contains("device 1: 4 entries, device 3: 2 entries"),
        "{e}"
    );
    let (code, err) = replay(&p);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--device N"), "{err}");
}

// ---- messages -----------------------------------------------------------------------------------

#[test]
fn pickled_ints_are_shown_as_python_prints_them() {
    for (size, shown) in [
        (Value::I64(-1), "-1"),
        (Value::Int((1u128 << 70).into()), "1180591620717411303424"),
    ] {
        let mut e = event(4096);
        if let Value::Dict(d) = &mut e {
            d.insert(HashableValue::String("size".into()), size);
        }
        let top = [(
            HashableValue::String("device_traces".into()),
            Value::List(vec![Value::List(vec![e])]),
        )];
        let bytes =
            serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new())
                .unwrap();
        let e = read_err("int.pickle", &bytes);
        let want = format!("key `size` = {shown} is not a 64-bit unsigned value");
        assert!(e.message.ends_with(&want), "{e}");
    }
}

/// `None` values and a stream outside 64 bits read as the Python converter words them
/// (`python/tests/test_convert.py`: `test_messages_match_the_rust_reader`).
#[test]
fn none_and_a_stream_past_64_bits_are_worded_as_the_converter_words_them() {
    let with = |key: &str, v: Value| {
        let mut e = event(4096);
        if let Value::Dict(d) = &mut e {
            d.insert(HashableValue::String(key.into()), v);
        }
        e
    };
    let top = |segments: Option<Value>, entry: Value| {
        let mut top = vec![(
            HashableValue::String("device_traces".into()),
            Value::List(vec![Value::List(vec![entry])]),
        )];
        if let Some(s) = segments {
            top.push((HashableValue::String("segments".into()), s));
        }
        serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new())
            .unwrap()
    };
    let cases = [
        (
            top(None, with("time_us", Value::None)),
            "trace entry 1: key `time_us` is a NoneType, not an int",
        ),
        (
            top(None, with("stream", Value::Int((1u128 << 64).into()))),
            "trace entry 1: key `stream` = 18446744073709551616 does not fit 64 bits",
        ),
        (
            top(
                None,
                with("stream", Value::Int((-(1i128 << 63) - 1).into())),
            ),
            "trace entry 1: key `stream` = -9223372036854775809 does not fit 64 bits",
        ),
        (
            top(Some(Value::None), event(4096)),
            "`segments` is a NoneType, not a list",
        ),
        (
            top(None, Value::None),
            "trace entry 1: a NoneType, not a dict",
        ),
    ];
    for (bytes, want) in cases {
        let e = read_err("none.pickle", &bytes);
        assert_eq!(e.message, want);
    }
}

#[test]
fn any_all_digit_number_too_large_overflows_64_bits() {
    let header = "action,addr,size,stream,time_us\n";
    for size in [
        "18446744073709551616",
        "99999999999999999999",
        "12345678901234567890123",
    ] {
        let text = format!("{header}alloc,4096,{size},0,1\n");
        let e = read_err("big.csv", text.as_bytes());
        assert_eq!(e.line, Some(2));
        assert_eq!(
            e.message,
            format!("field `size` overflows 64 bits: `{size}`")
        );
    }
    let max = format!("{header}alloc,4096,18446744073709551615,0,1\n");
    assert_eq!(
        read("max.csv", max.as_bytes()).unwrap().ops,
        [alloc(0, 0, u64::MAX)]
    );
    let e = read_err("neg.csv", format!("{header}alloc,4096,-1,0,1\n").as_bytes());
    assert!(
        e.message.contains("not a non-negative integer: `-1`"),
        "{e}"
    );
    let rmm = "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,";
    for (tail, field) in [
        ("123456789012345678901234,0x0", "Size"),
        ("1,0x10000000000000000", "Stream"),
        ("1,99999999999999999999", "Stream"),
    ] {
        let e = read_err("big_rmm.csv", format!("{rmm}{tail}\n").as_bytes());
        assert!(
            e.message
                .starts_with(&format!("field `{field}` overflows 64 bits")),
            "{e}"
        );
    }
    let e = read_err(
        "long_ptr.csv",
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0,free,0x10000000000000000,1,0\n",
    );
    assert!(
        e.message
            .starts_with("field `Pointer` overflows 64 bits: `0x1"),
        "{e}"
    );
}

/// A control character in a field of a text trace is shown escaped: printed as it is, a NUL or
/// a record separator between digits is invisible, so the error showed a value that looked like
/// a valid number; a file padded with NULs (as a crash leaves one) showed `` as its action,
/// after 4 KiB of NULs on the terminal. A long field is cut.
#[test]
fn control_characters_in_a_field_are_shown_escaped() {
    let header = "action,addr,size,stream,time_us\n";
    let not_int = "is not a non-negative integer";
    // A NUL and a record separator between digits; a backslash and an invisible character that
    // is not a control character are escaped too, so that `12\034` as text and `12`, NUL, `34`
    // do not look alike.
    let fields = [
        ("nul.csv", "alloc,4096,12\x0034,0,1", "size", "`12\\034`"),
        (
            "rs.csv",
            "alloc,4096,1,0,17\x1e96",
            "time_us",
            "`17\\u{1e}96`",
        ),
        ("bs.csv", "alloc,4096,12\\034,0,1", "size", "`12\\\\034`"),
        (
            "zw.csv",
            "alloc,4096,12\u{200b}34,0,1",
            "size",
            "`12\\u{200b}34`",
        ),
    ];
    for (name, line, field, shown) in fields {
        let e = read_err(name, format!("{header}{line}\n").as_bytes());
        assert_eq!(e.line, Some(2), "{name}");
        assert_eq!(e.message, format!("field `{field}` {not_int}: {shown}"));
    }
    let padded = [
        format!("{header}alloc,4096,1,0,1\n").as_bytes(),
        &[0u8; 4096],
    ]
    .concat();
    let e = read_err("padded.csv", &padded);
    assert_eq!(e.line, Some(3));
    let nuls = "\\0".repeat(64);
    assert_eq!(
        e.message,
        format!("unknown action `{nuls}... (4096 bytes)`")
    );
    let long = "9".repeat(300);
    let e = read_err(
        "long.csv",
        format!("{header}alloc,4096,{long},0,1\n").as_bytes(),
    );
    assert_eq!(
        e.message,
        format!(
            "field `size` overflows 64 bits: `{}... (300 bytes)`",
            &long[..64]
        )
    );
    let rmm = "Thread,Time,Action,Pointer,Size,Stream\n1,0,";
    let e = read_err(
        "ctl_rmm.csv",
        format!("{rmm}allocate,0x10\x01,1,0\n").as_bytes(),
    );
    assert_eq!(
        e.message,
        "field `Pointer` is not a hex address: `0x10\\u{1}`"
    );
    let e = read_err(
        "ctl_rmm2.csv",
        format!("{rmm}alloc\x07,0x10,1,0\n").as_bytes(),
    );
    assert_eq!(e.message, "unknown action `alloc\\u{7}`");
    // Through the command line: the same message, and no raw control character on stderr.
    let (code, err) = replay(&scratch("padded.csv"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("padded.csv:3: unknown action `\\0\\0"),
        "{err}"
    );
    assert!(!err.contains('\0'), "{err:?}");
}

#[test]
fn gzip_truncation_and_trailing_data_say_so() {
    let text = [OURS, &b"alloc,8192,1,0,3\n".repeat(20_000)].concat();
    let whole = gzip(&text);
    let e = read_err("cut5.csv.gz", &whole[..5]);
    assert_eq!(e.line, None);
    assert!(e.message.starts_with("truncated gzip stream"), "{e}");
    let e = read_err("cut.csv.gz", &whole[..whole.len() / 2]);
    assert!(e.line.is_some_and(|l| l > 1), "{e}");
    assert!(e.message.starts_with("truncated gzip stream"), "{e}");
    for tail in [&b"garbage\n"[..], b"\0\0\0\0"] {
        let e = read_err("tail.csv.gz", &[&whole[..], tail].concat());
        assert_eq!(e.line, Some(20_004), "{e}");
        assert_eq!(e.message, "trailing data after the gzip stream");
    }
    let e = read_err("tail.pickle.gz", &[&gzip(PROTOCOL_1)[..], b"x"].concat());
    assert_eq!(e.message, "trailing data after the gzip stream");
    let two = [gzip(OURS), gzip(b"alloc,8192,1,0,3\n")].concat();
    assert_eq!(read("two_members.csv.gz", &two).unwrap().events, 3);
}

// ---- mismatched frees ---------------------------------------------------------------------------

#[test]
fn a_free_whose_size_or_stream_differs_is_counted() {
    let text = "action,addr,size,stream,time_us\n\
                alloc,4096,100,7,1\n\
                free_completed,4096,100,7,2\n\
                alloc,4096,100,7,3\n\
                free_completed,4096,99,7,4\n\
                alloc,8192,100,7,5\n\
                free_completed,8192,100,8,6\n\
                free_completed,8192,100,7,7\n";
    let t = read("mismatched.csv", text.as_bytes()).unwrap();
    let want = Anomalies {
        unmatched_frees: 1,
        double_allocs: 0,
        mismatched_frees: 2,
        first_line: Some(5),
    };
    assert_eq!(t.anomalies, want);
    assert_eq!(t.ops.len(), 6, "a mismatched free still frees");
    let rmm = "Thread,Time,Action,Pointer,Size,Stream\n\
               1,0,allocate,0x1000,100,0x0\n\
               1,0,free,0x1000,64,0x0\n";
    let t = read("mismatched_rmm.csv", rmm.as_bytes()).unwrap();
    assert_eq!(t.anomalies.mismatched_frees, 1);
    assert_eq!(t.anomalies.first_line, Some(3));
}
