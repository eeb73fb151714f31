//! Every action PyTorch writes into a snapshot's `device_traces`, through the pickle reader.
//!
//! PyTorch's actions (`TraceEntry::Action` in `c10/cuda/CUDACachingAllocator.h`, later
//! `c10/core/CachingDeviceAllocator.h`): `alloc`, `free_requested`, `free_completed`,
//! `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `snapshot`, `oom`; and two
//! annotations that are not allocator events: `user_defined` (a `record_function` range, PyTorch
//! 2.4 only; 2.5 moved them to `external_annotations`) and `annotate` (metadata attached to a
//! live allocation by `torch.cuda.memory._annotate_memory`).
//!
//! Checks that:
//! - the committed `snapshot_annotated.pickle` (`snapshot.pickle` with annotations between its
//!   device 0 events, made by `allocator/tests/data/make_fixtures.py`) reads into exactly the trace of
//!   `snapshot.pickle` and of `snapshot.csv`, the Python converter's output without them (ops,
//!   streams, slots, events, segments, peak, anomalies): annotations are skipped, not counted;
//! - a snapshot built here with annotations (one without `addr`, `size` and `stream`, one whose
//!   fields have other types) reads like the same snapshot without them;
//! - `snapshot`, `segment_map` and `segment_unmap` are read as events (counted in
//!   [`Trace::events`], as in cudalloc's CSV) that change no live allocation;
//! - the device choice ignores annotations: a device 0 holding only `user_defined` entries (as
//!   PyTorch 2.4 left them from threads without a device) does not hide the device with events;
//! - with no device given and no events anywhere, device 0 is read and must be a list (as the
//!   Python converter has it);
//! - a history that began late starts with what was live before it (the fixture
//!   `snapshot_late.pickle` reads as the Python converter's `snapshot_late.csv`), the blocks of
//!   the device read only, and a malformed segment is an error naming segment, block and key;
//! - an unknown action, or an annotation's `action` of the wrong type, is still an error naming
//!   the entry and the action.

use cudalloc_trace::{self as trace, pytorch, Op, Trace};
use serde_pickle::{HashableValue, SerOptions, Value};
use std::path::{Path, PathBuf};

use crate::common;
use common::assert_same_trace;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

fn s(text: &str) -> Value {
    Value::String(text.to_string())
}

fn int(n: i64) -> Value {
    Value::I64(n)
}

fn dict(fields: &[(&str, Value)]) -> Value {
    let d = fields
        .iter()
        .map(|(k, v)| (HashableValue::String(k.to_string()), v.clone()));
    Value::Dict(d.collect())
}

/// An entry with every key PyTorch writes.
fn event(action: &str, addr: i64, size: i64, time_us: i64) -> Value {
    dict(&[
        ("action", s(action)),
        ("addr", int(addr)),
        ("size", int(size)),
        ("stream", int(0)),
        ("time_us", int(time_us)),
    ])
}

/// A `record_function` annotation as PyTorch 2.4 wrote it into `device_traces`.
fn user_defined(name: &str, stage: &str) -> Value {
    let frame = dict(&[("name", s(stage)), ("filename", s(name)), ("line", int(0))]);
    dict(&[
        ("action", s("user_defined")),
        ("addr", int(0)),
        ("size", int(0)),
        ("stream", int(0)),
        ("time_us", int(1)),
        ("frames", Value::List(vec![frame])),
    ])
}

/// A pickled snapshot with these device traces.
fn snapshot(devices: Vec<Vec<Value>>) -> Vec<u8> {
    let devices = devices.into_iter().map(Value::List).collect();
    let top = [(
        HashableValue::String("device_traces".to_string()),
        Value::List(devices),
    )];
    serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new()).unwrap()
}

fn read(entries: Vec<Value>) -> Trace {
    pytorch::read_snapshot(Path::new("made.pickle"), &snapshot(vec![entries])).unwrap()
}

#[test]
fn the_annotated_fixture_reads_like_the_one_without_annotations() {
    let annotated = trace::read(&data("snapshot_annotated.pickle")).unwrap();
    let plain = trace::read(&data("snapshot.pickle")).unwrap();
    let csv = trace::read(&data("snapshot.csv")).unwrap();
    assert_same_trace(&annotated, &plain);
    assert_same_trace(&annotated, &csv);
    assert_eq!(annotated.events, 14);
}

#[test]
fn annotations_are_skipped_whatever_fields_they_have() {
    let alloc = event("alloc", 4096, 100, 2);
    let free = event("free_completed", 4096, 100, 3);
    let plain = read(vec![alloc.clone(), free.clone()]);
    let bare = dict(&[("action", s("user_defined"))]);
    let odd = dict(&[
        ("action", s("user_defined")),
        ("addr", s("not an int")),
        ("size", Value::None),
        ("name", s("## forward ##")),
        ("user_metadata", dict(&[("stage", s("START"))])),
    ]);
    let annotate = dict(&[
        ("action", s("annotate")),
        ("addr", int(4096)),
        ("user_metadata", s("kept by autograd")),
    ]);
    let annotated = read(vec![
        user_defined("ProfilerStep#0", "START"),
        bare,
        alloc,
        annotate,
        odd,
        free,
        user_defined("ProfilerStep#0", "END"),
    ]);
    assert_same_trace(&annotated, &plain);
    assert_eq!(plain.events, 2);
    assert_eq!(
        plain.ops,
        [
            Op::Alloc {
                slot: 0,
                stream: 0,
                size: 100
            },
            Op::Free { slot: 0 }
        ]
    );
}

#[test]
fn snapshot_and_segment_map_entries_are_events_without_ops() {
    let alloc = event("alloc", 4096, 100, 2);
    let free = event("free_completed", 4096, 100, 3);
    let plain = read(vec![alloc.clone(), free.clone()]);
    let with = read(vec![
        event("segment_map", 1 << 30, 2 << 20, 1),
        alloc,
        event("snapshot", 0, 0, 2),
        free,
        event("segment_unmap", 1 << 30, 2 << 20, 4),
        event("snapshot", 0, 0, 5),
    ]);
    assert_eq!(with.events, plain.events + 4);
    assert_eq!(with.ops, plain.ops);
    assert_eq!(with.streams, plain.streams);
    assert_eq!(with.peak_live, plain.peak_live);
    assert_eq!(with.segment_sizes, plain.segment_sizes);
    assert_eq!(with.anomalies, plain.anomalies);
}

#[test]
fn a_device_with_only_annotations_does_not_hide_the_one_with_events() {
    let notes = vec![
        user_defined("gloo:broadcast", "START"),
        user_defined("gloo:broadcast", "END"),
    ];
    let events = vec![
        user_defined("ProfilerStep#0", "START"),
        event("alloc", 4096, 100, 2),
    ];
    let bytes = snapshot(vec![notes.clone(), vec![], events.clone()]);
    let t = pytorch::read_snapshot(Path::new("rank2.pickle"), &bytes).unwrap();
    assert_eq!(t.events, 1);
    assert_eq!(
        t.ops,
        [Op::Alloc {
            slot: 0,
            stream: 0,
            size: 100
        }]
    );

    // Several devices with events and none on device 0: the error counts events, not notes.
    let bytes = snapshot(vec![notes.clone(), events.clone(), events]);
    let e = pytorch::read_snapshot(Path::new("ranks.pickle"), &bytes).unwrap_err();
    assert!(
        e.message
            .contains("device 1: 1 entries, device 2: 1 entries"),
        "{e}"
    );

    // Annotations only: an empty trace.
    let bytes = snapshot(vec![notes.clone(), notes]);
    let t = pytorch::read_snapshot(Path::new("notes.pickle"), &bytes).unwrap();
    assert_eq!((t.events, t.ops.len()), (0, 0));
}

#[test]
fn an_unknown_action_is_still_an_error_naming_entry_and_action() {
    let path = Path::new("made.pickle");
    let bytes = snapshot(vec![vec![
        user_defined("ProfilerStep#0", "START"),
        event("alloc", 4096, 100, 2),
        event("realloc", 4096, 100, 3),
    ]]);
    let e = pytorch::read_snapshot(path, &bytes).unwrap_err();
    assert_eq!(e.line, Some(3));
    assert!(
        e.message.contains("entry 3") && e.message.contains("unknown action `realloc`"),
        "{e}"
    );

    let bytes = snapshot(vec![vec![dict(&[("action", int(9))])]]);
    let e = pytorch::read_snapshot(path, &bytes).unwrap_err();
    assert_eq!(e.line, Some(1));
    assert!(e.message.contains("`action` is a int"), "{e}");
}

/// With no device given and none with events, device 0 is read (as the Python converter does),
/// so a device 0 entry that is not a list is an error, not an empty trace; an empty
/// `device_traces` is an empty trace.
#[test]
fn with_no_events_anywhere_device_0_must_still_be_a_list() {
    let top = |devices: Vec<Value>| {
        let top = [(
            HashableValue::String("device_traces".to_string()),
            Value::List(devices),
        )];
        serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new())
            .unwrap()
    };
    let bytes = top(vec![Value::Tuple(vec![event("alloc", 4096, 100, 2)])]);
    let e = pytorch::read_snapshot(Path::new("tuple.pickle"), &bytes).unwrap_err();
    assert!(
        e.message
            .contains("`device_traces[0]` is a tuple, not a list"),
        "{e}"
    );
    let t = pytorch::read_snapshot(Path::new("none.pickle"), &top(vec![])).unwrap();
    assert_eq!((t.events, t.ops.len()), (0, 0));
}

/// A snapshot whose history began after loading (`allocator/tests/data/snapshot_late.pickle`, made by
/// `make_fixtures.py`): the reader starts the trace with the allocations live before it, and
/// reads exactly what the Python converter wrote (`snapshot_late.csv`).
#[test]
fn a_late_history_starts_with_what_was_live_before_it() {
    let t = trace::read(&data("snapshot_late.pickle")).unwrap();
    assert_same_trace(&t, &trace::read(&data("snapshot_late.csv")).unwrap());
    const MIB: u64 = 1 << 20;
    let before = [4 * MIB - 100, 2 * MIB, 3 * MIB, 3 * MIB, 5 * MIB];
    let sizes: Vec<u64> = t.ops[..5]
        .iter()
        .map(|op| match *op {
            Op::Alloc { size, .. } => size,
            Op::Free { .. } => panic!("a free among the first ops: {:?}", t.ops),
        })
        .collect();
    assert_eq!(sizes, before);
    assert_eq!(t.anomalies, Default::default(), "the frees now match");
    assert_eq!(t.peak_live, before.iter().sum::<u64>() + 1000);
    assert_eq!(
        (t.events, t.before_history),
        (7, 5),
        "7 history entries and 5 allocations before them"
    );
}

/// A segment's `blocks` of a device other than the one read, or without a `device` key (device
/// 0), or in a snapshot without `segments`: only the device read counts.
#[test]
fn held_blocks_count_for_their_own_device_only() {
    let seg = |device: Option<i64>, addr: i64| {
        let mut f = vec![
            ("address", int(addr)),
            (
                "blocks",
                Value::List(vec![dict(&[
                    ("size", int(4096)),
                    ("state", s("active_allocated")),
                ])]),
            ),
        ];
        if let Some(d) = device {
            f.push(("device", int(d)));
        }
        dict(&f)
    };
    let bytes = |segments: Vec<Value>| {
        let top = dict(&[
            ("segments", Value::List(segments)),
            (
                "device_traces",
                Value::List(vec![
                    Value::List(vec![]),
                    Value::List(vec![event("alloc", 1 << 30, 100, 1)]),
                ]),
            ),
        ]);
        serde_pickle::value_to_vec(&top, SerOptions::new()).unwrap()
    };
    let read = |b: &[u8]| pytorch::read_snapshot(Path::new("s.pickle"), b).unwrap();
    // Device 1 is read (the only one with events): device 0's and unmarked segments don't count.
    let t = read(&bytes(vec![
        seg(Some(0), 4096),
        seg(None, 8192),
        seg(Some(1), 1 << 20),
    ]));
    assert_eq!(t.ops.len(), 2);
    assert_eq!(t.peak_live, 4096 + 100);
    let device0 = pytorch::read_snapshot_device(
        Path::new("s.pickle"),
        &bytes(vec![
            seg(Some(0), 4096),
            seg(None, 8192),
            seg(Some(1), 1 << 20),
        ]),
        0,
    )
    .unwrap();
    assert_eq!(device0.peak_live, 2 * 4096);
}

/// Malformed segments are errors naming the segment, the block and the key (the Python
/// converter says the same: `python/tests/test_convert.py`).
#[test]
fn a_malformed_segment_is_named() {
    let block = |state: Value| dict(&[("size", int(512)), ("state", state)]);
    let cases = [
        (Value::List(vec![int(3)]), "segment 1: a int, not a dict"),
        (
            Value::List(vec![dict(&[("blocks", Value::List(vec![]))])]),
            "segment 1: missing key `address`",
        ),
        (
            Value::List(vec![dict(&[("address", int(0))])]),
            "segment 1: missing key `blocks`",
        ),
        (
            Value::List(vec![
                dict(&[("address", int(0)), ("blocks", Value::List(vec![]))]),
                dict(&[("address", int(0)), ("blocks", int(1))]),
            ]),
            "segment 2: key `blocks` is a int, not a list",
        ),
        (
            Value::List(vec![dict(&[
                ("address", int(0)),
                (
                    "blocks",
                    Value::List(vec![block(s("inactive")), block(int(1))]),
                ),
            ])]),
            "segment 1: block 2: key `state` is a int, not a str",
        ),
        (
            Value::List(vec![dict(&[
                ("address", int(0)),
                (
                    "blocks",
                    Value::List(vec![dict(&[("state", s("inactive"))])]),
                ),
            ])]),
            "segment 1: block 1: missing key `size`",
        ),
        (int(5), "`segments` is a int, not a list"),
    ];
    for (segments, want) in cases {
        let top = dict(&[
            ("segments", segments),
            (
                "device_traces",
                Value::List(vec![Value::List(vec![event("alloc", 4096, 1, 1)])]),
            ),
        ]);
        let bytes = serde_pickle::value_to_vec(&top, SerOptions::new()).unwrap();
        let e = pytorch::read_snapshot(Path::new("bad.pickle"), &bytes).unwrap_err();
        assert_eq!(e.line, None);
        assert_eq!(e.message, want);
    }
}
