//! PyTorch memory snapshots: the pickle `torch.cuda.memory._dump_snapshot()` writes, or the
//! dict `torch.cuda.memory._snapshot()` returns saved with `pickle.dump` (the same shape).
//!
//! One device's `device_traces[device]` is read: a list of dicts, one per event, with the keys
//! `action`, `addr`, `size`, `stream` and `time_us`; other keys (`frames`, `compile_context`,
//! ...) are ignored. Entry `i` (1-based) is pushed into the [`TraceBuilder`] as line `i`, after
//! the allocations that were live before the history began ([`super::prehistory`]: from its
//! frees, and from the blocks that the snapshot's `segments` of that device hold). Of a segment
//! (a dict), `address` and `blocks` (a list) are read, and `device` and `stream` when present
//! (else 0); of a block (a dict), `size` and `state` (a str), and `address` and
//! `requested_size` when present (else the address after the previous block's, and the size).
//! The rest of the snapshot is ignored.
//!
//! Which device ([`read_snapshot`]; [`read_snapshot_device`] reads the one it is given): device 0
//! when its list has events; otherwise the only device whose list has events; otherwise (no
//! device has any, or `device_traces` is empty) an empty trace, device 0's entry being checked
//! like a chosen one's (a list). When device 0's list has none and several others do, that is a
//! [`TraceError`] listing each device with events and how many, rather than a guess.
//! Annotations (below) are not events: PyTorch 2.4 put the `user_defined` entries of threads
//! without a device in device 0's list, which must not hide the device that allocated.
//!
//! Guarantees, shared with the Python converter `python/cudalloc_trace/convert.py` (both turn
//! one snapshot into the same events):
//! - Every action PyTorch writes is accepted (`TraceEntry::Action`, in
//!   `c10/cuda/CUDACachingAllocator.h`, later `c10/core/CachingDeviceAllocator.h`). Those of
//!   [`Action`] are events, counted in [`Trace::events`] as in cudalloc's CSV; `snapshot`,
//!   `segment_map` and `segment_unmap` among them change no live allocation. Those of
//!   [`ANNOTATIONS`] are not allocator events and have no [`Action`]: they are skipped whatever
//!   their other keys (only `action` is read), not counted in the trace (the converter prints
//!   how many it skipped).
//! - `oom` entries carry `device_free` instead of `addr`; it becomes the event's address (as in
//!   PyTorch's own `TraceEntry`), or 0 when absent. Every other action needs `addr`.
//! - `time_us` is optional (older PyTorch versions lack it) and reads as 0 when absent.
//! - `stream` is PyTorch's `int64` cast of the handle: a negative value is read as its 64-bit
//!   two's complement.
//! - A missing key, a value of the wrong type or an unknown action is a [`TraceError`] whose line
//!   is the entry number and whose message names the entry and the key (and shows a bad value as
//!   Python would print it). Bytes that are not a pickle (garbage, a truncated file: "truncated")
//!   are a [`TraceError`] of the file, not a panic, and so are values nested deeper than
//!   `pickle_scan::MAX_DEPTH` (checked before decoding, as decoding them would overflow the stack).
//!
//! Why `serde-pickle`: it decodes every pickle protocol (0-5) in pure Rust into a dynamic
//! [`Value`], so no Python is needed, and it never runs anything from the file. With
//! `replace_unresolved_globals` an object of a class it does not know (a snapshot may hold torch
//! objects) decodes as `None` instead of failing the whole file. The cost: the whole pickle is
//! decoded in memory before the first event is read, about 1.3 KB and 6 us per trace entry in a
//! release build (a 1.4 M-event snapshot: ~1.8 GB, ~9 s). For snapshots that large, convert once
//! with `python -m cudalloc_trace.convert` and read the CSV, which streams.

use super::prehistory::{self, Held};
use super::{Action, Event, Position, Trace, TraceBuilder, TraceError};
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::BTreeMap;
use std::path::Path;

type Dict = BTreeMap<HashableValue, Value>;

/// Actions PyTorch writes into `device_traces` that annotate the trace rather than record an
/// allocator event: `user_defined`, a `record_function` range (PyTorch 2.4 only; 2.5 moved them
/// to the snapshot's `external_annotations`), and `annotate`, metadata attached to a live
/// allocation by `torch.cuda.memory._annotate_memory`. The reader skips them.
pub const ANNOTATIONS: [&str; 2] = ["user_defined", "annotate"];

/// Reads the `device_traces` of a snapshot pickle's device chosen as the module documentation
/// says.
pub fn read_snapshot(path: &Path, bytes: &[u8]) -> Result<Trace, TraceError> {
    read_entries(path, bytes, Device::Chosen)
}

/// Reads the `device_traces` of device `device` of a snapshot pickle.
pub fn read_snapshot_device(path: &Path, bytes: &[u8], device: usize) -> Result<Trace, TraceError> {
    read_entries(path, bytes, Device::Given(device))
}

/// The device whose trace to read.
#[derive(Clone, Copy)]
enum Device {
    /// By the rule of the module documentation.
    Chosen,
    /// This one, even when its list is empty.
    Given(usize),
}

fn read_entries(path: &Path, bytes: &[u8], device: Device) -> Result<Trace, TraceError> {
    let d = decode(bytes, device).map_err(|m| TraceError::file(path, m))?;
    let keys = Keys::new();
    let mut events = Vec::with_capacity(d.entries.len());
    for (i, entry) in d.entries.into_iter().enumerate() {
        let line = i as u64 + 1;
        let e = parse_entry(&keys, &entry)
            .map_err(|m| TraceError::at(path, line, format!("trace entry {line}: {m}")))?;
        if let Some(e) = e {
            events.push((e, line));
        }
    }
    let held = held_blocks(d.segments.as_ref(), d.device).map_err(|m| TraceError::file(path, m))?;
    let mut b = TraceBuilder::new(super::trace_name(path));
    b.set_position(Position::Entry);
    for e in prehistory::allocations(events.iter().map(|(e, _)| e), &held) {
        b.push_before_history(e);
    }
    for (e, line) in events {
        b.push(e, line);
    }
    Ok(b.finish())
}

/// Stack of the thread that decodes a pickle: ample for values nested
/// `pickle_scan::MAX_DEPTH` levels (the most the scan lets through), in a debug build too.
const DECODE_STACK: usize = 512 << 20;

/// What is read of a snapshot: one device's entries and the segments.
struct Decoded {
    device: usize,
    entries: Vec<Value>,
    segments: Option<Value>,
}

/// Decodes the pickle (on a thread with a large stack, after the nesting check) and takes out
/// the entry list of one device, and the segments.
fn decode(bytes: &[u8], device: Device) -> Result<Decoded, String> {
    super::pickle_scan::check_nesting(bytes)
        .map_err(|m| format!("not a readable snapshot pickle: {m}"))?;
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("pickle".into())
            .stack_size(DECODE_STACK)
            .spawn_scoped(s, || decode_entries(bytes, device))
            .map_err(|e| format!("cannot start the pickle decoder: {e}"))?
            .join()
            .map_err(|panic| {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|m| m.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                format!("the pickle decoder failed: {why}")
            })?
    })
}

fn decode_entries(bytes: &[u8], device: Device) -> Result<Decoded, String> {
    let opts = DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    // Bytes after the pickle's STOP are ignored, as Python's `pickle.load` (and so PyTorch's
    // tools and `cudalloc_trace.convert`) ignores them.
    let value = serde_pickle::Deserializer::new(bytes, opts)
        .deserialize_value()
        .map_err(|e| unreadable(&e, bytes.len()))?;
    let Value::Dict(mut top) = value else {
        return Err(format!(
            "expected a dict at the top, found {}",
            kind(&value)
        ));
    };
    let traces = top
        .remove(&key("device_traces"))
        .ok_or("the snapshot has no `device_traces` key")?;
    let Value::List(mut devices) = traces else {
        return Err(format!(
            "`device_traces` is a {}, not a list",
            kind(&traces)
        ));
    };
    let device = match device {
        Device::Given(d) => d,
        // No device with events: device 0, whose list must still be a list (as the Python
        // converter has it), or nothing at all.
        Device::Chosen => match choose_device(&devices)? {
            Some(d) => d,
            None if devices.is_empty() => {
                return Ok(Decoded {
                    device: 0,
                    entries: Vec::new(),
                    segments: None,
                })
            }
            None => 0,
        },
    };
    if device >= devices.len() {
        return Err(format!(
            "device {device} asked for; the snapshot has traces of {} device(s)",
            devices.len()
        ));
    }
    match devices.swap_remove(device) {
        Value::List(entries) => Ok(Decoded {
            device,
            entries,
            segments: top.remove(&key("segments")),
        }),
        other => Err(format!(
            "`device_traces[{device}]` is a {}, not a list",
            kind(&other)
        )),
    }
}

/// What is said of a pickle of `len` bytes that the decoder refused with `e`. One that ends
/// before its `STOP` (a file cut short) says so: the decoder reads past the end, or (protocol 0)
/// finds a literal cut by the end invalid, where its own words are `EOF while parsing` and
/// `literal is invalid`.
fn unreadable(e: &serde_pickle::Error, len: usize) -> String {
    use serde_pickle::{Error, ErrorCode};
    match e {
        Error::Eval(ErrorCode::EOFWhileParsing, _) => {}
        Error::Eval(ErrorCode::InvalidLiteral(_), at) if *at >= len => {}
        _ => return format!("not a readable snapshot pickle: {e}"),
    }
    format!(
        "not a readable snapshot pickle: truncated (the file ends inside the pickle, after \
         {len} bytes)"
    )
}

/// The device to read when none was given: see the module documentation (`None`: no device
/// has events).
fn choose_device(devices: &[Value]) -> Result<Option<usize>, String> {
    let action = key("action");
    let with_entries: Vec<(usize, usize)> = devices
        .iter()
        .enumerate()
        .map(|(d, v)| (d, events_in(v, &action)))
        .filter(|&(_, n)| n > 0)
        .collect();
    match with_entries.as_slice() {
        [] => Ok(None),
        [(0, _), ..] | [_] => Ok(Some(with_entries[0].0)),
        several => Err(several_devices(several)),
    }
}

/// How many entries of a device's list are events (not annotations); 0 for a non-list.
fn events_in(entries: &Value, action: &HashableValue) -> usize {
    match entries {
        Value::List(entries) => entries.iter().filter(|e| !is_annotation(e, action)).count(),
        _ => 0,
    }
}

/// Whether an entry is a dict whose `action` (the key given) is one of [`ANNOTATIONS`].
fn is_annotation(entry: &Value, action: &HashableValue) -> bool {
    let Value::Dict(d) = entry else {
        return false;
    };
    matches!(d.get(action), Some(Value::String(a)) if ANNOTATIONS.contains(&a.as_str()))
}

fn several_devices(devices: &[(usize, usize)]) -> String {
    let list: Vec<String> = devices
        .iter()
        .map(|(d, n)| format!("device {d}: {n} entries"))
        .collect();
    format!(
        "device 0 has no trace entries and several devices do ({}); pick one with `--device N` \
         (`cudalloc replay`, `cudalloc stats`, `python -m cudalloc_trace.convert`)",
        list.join(", ")
    )
}

/// The dict keys, built once.
struct Keys {
    action: HashableValue,
    addr: HashableValue,
    device_free: HashableValue,
    size: HashableValue,
    stream: HashableValue,
    time_us: HashableValue,
}

impl Keys {
    fn new() -> Keys {
        Keys {
            action: key("action"),
            addr: key("addr"),
            device_free: key("device_free"),
            size: key("size"),
            stream: key("stream"),
            time_us: key("time_us"),
        }
    }
}

/// The blocks `device`'s segments hold (allocated, or waiting for stream events), with what
/// [`Held`] needs; a malformed segment or block is an error naming it (1-based) and the key.
fn held_blocks(segments: Option<&Value>, device: usize) -> Result<Vec<Held>, String> {
    let segments = match segments {
        None => return Ok(Vec::new()),
        Some(Value::List(s)) => s,
        Some(other) => return Err(format!("`segments` is a {}, not a list", kind(other))),
    };
    let mut held = Vec::new();
    for (i, seg) in segments.iter().enumerate() {
        segment_blocks(seg, device, &mut held).map_err(|m| format!("segment {}: {m}", i + 1))?;
    }
    Ok(held)
}

/// Adds the held blocks of one segment, if it is of `device`.
fn segment_blocks(seg: &Value, device: usize, held: &mut Vec<Held>) -> Result<(), String> {
    let Value::Dict(d) = seg else {
        return Err(format!("a {}, not a dict", kind(seg)));
    };
    let on = d.get(&key("device")).map_or(Ok(0), |v| uint(v, "device"))?;
    if on != device as u64 {
        return Ok(());
    }
    let mut addr = uint(required(d, &key("address"), "address")?, "address")?;
    let stream = d.get(&key("stream")).map_or(Ok(0), stream)?;
    let blocks = match required(d, &key("blocks"), "blocks")? {
        Value::List(b) => b,
        other => return Err(format!("key `blocks` is a {}, not a list", kind(other))),
    };
    for (j, block) in blocks.iter().enumerate() {
        let b = block_of(block, addr).map_err(|m| format!("block {}: {m}", j + 1))?;
        addr = b.0.saturating_add(b.1);
        if b.3 {
            held.push(Held {
                addr: b.0,
                size: b.2,
                stream,
            });
        }
    }
    Ok(())
}

/// A block's (address, size, requested size, whether it is held); `at` is where it starts when
/// it has no `address`.
fn block_of(block: &Value, at: u64) -> Result<(u64, u64, u64, bool), String> {
    let Value::Dict(d) = block else {
        return Err(format!("a {}, not a dict", kind(block)));
    };
    let addr = d
        .get(&key("address"))
        .map_or(Ok(at), |v| uint(v, "address"))?;
    let size = uint(required(d, &key("size"), "size")?, "size")?;
    let requested = match d.get(&key("requested_size")) {
        Some(v) => uint(v, "requested_size")?,
        None => 0,
    };
    let held = match required(d, &key("state"), "state")? {
        Value::String(s) => HELD_STATES.contains(&s.as_str()),
        other => return Err(format!("key `state` is a {}, not a str", kind(other))),
    };
    let requested = if requested > 0 { requested } else { size };
    Ok((addr, size, requested, held))
}

/// Block states of a snapshot's segments that hold the block: allocated, or freed and waiting
/// for stream events (`active_pending_free` in older PyTorch versions).
pub const HELD_STATES: [&str; 3] = [
    "active_allocated",
    "active_awaiting_free",
    "active_pending_free",
];

fn key(name: &str) -> HashableValue {
    HashableValue::String(name.to_string())
}

/// One trace entry as an [`Event`], or `None` for an annotation (its other keys are not read);
/// the error names the key.
fn parse_entry(k: &Keys, entry: &Value) -> Result<Option<Event>, String> {
    let Value::Dict(d) = entry else {
        return Err(format!("a {}, not a dict", kind(entry)));
    };
    let Some(action) = action(required(d, &k.action, "action")?)? else {
        return Ok(None);
    };
    let addr = match d.get(&k.addr) {
        Some(v) => uint(v, "addr")?,
        None if action == Action::Oom => d
            .get(&k.device_free)
            .map_or(Ok(0), |v| uint(v, "device_free"))?,
        None => return Err("missing key `addr`".to_string()),
    };
    let size = uint(required(d, &k.size, "size")?, "size")?;
    let stream = stream(required(d, &k.stream, "stream")?)?;
    let time_us = d.get(&k.time_us).map_or(Ok(0), |v| uint(v, "time_us"))?;
    Ok(Some(Event {
        action,
        addr,
        size,
        stream,
        time_us,
    }))
}

fn required<'a>(d: &'a Dict, k: &HashableValue, name: &str) -> Result<&'a Value, String> {
    d.get(k).ok_or_else(|| format!("missing key `{name}`"))
}

/// The action of an entry: `None` for one of [`ANNOTATIONS`].
fn action(v: &Value) -> Result<Option<Action>, String> {
    match v {
        Value::String(s) if ANNOTATIONS.contains(&s.as_str()) => Ok(None),
        Value::String(s) => match Action::parse(s) {
            Some(a) => Ok(Some(a)),
            None => Err(format!("unknown action `{s}`")),
        },
        other => Err(format!("key `action` is a {}, not a str", kind(other))),
    }
}

/// A non-negative integer that fits 64 bits.
fn uint(v: &Value, name: &str) -> Result<u64, String> {
    let n = match v {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Int(big) => u64::try_from(big).ok(),
        other => return Err(format!("key `{name}` is a {}, not an int", kind(other))),
    };
    n.ok_or_else(|| {
        format!(
            "key `{name}` = {} is not a 64-bit unsigned value",
            int_text(v)
        )
    })
}

/// An int as Python prints it.
fn int_text(v: &Value) -> String {
    match v {
        Value::I64(i) => i.to_string(),
        Value::Int(big) => big.to_string(),
        other => kind(other).to_string(),
    }
}

/// A stream handle: PyTorch writes `int64_t(stream)`, so negative values wrap; an int outside
/// both 64-bit ranges is refused with the Python converter's words.
fn stream(v: &Value) -> Result<u64, String> {
    match v {
        Value::I64(i) => Ok(*i as u64),
        Value::Int(_) => uint(v, "stream")
            .map_err(|_| format!("key `stream` = {} does not fit 64 bits", int_text(v))),
        _ => uint(v, "stream"),
    }
}

/// Python's name for the type of a value.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "NoneType",
        Value::Bool(_) => "bool",
        Value::I64(_) | Value::Int(_) => "int",
        Value::F64(_) => "float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Set(_) => "set",
        Value::FrozenSet(_) => "frozenset",
        Value::Dict(_) => "dict",
    }
}
