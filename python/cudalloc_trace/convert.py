"""Convert a PyTorch memory snapshot to cudalloc's trace CSV.

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns (``_dump_snapshot()`` pickles
it). ``snapshot["device_traces"][device]`` is converted: a list of dicts, one per event, with the
keys ``action``, ``addr``, ``size``, ``stream`` and ``time_us``; other keys (``frames``, ...)
are ignored. Before its events come the allocations that were live before the history began
(:func:`prehistory`): those it only shows being freed, and the blocks the snapshot's
``segments`` of that device hold but the history never mentions (a history recorded after the
model was loaded, or whose start PyTorch dropped). Of a segment (a dict), ``address`` and
``blocks`` (a list) are read, and ``device`` and ``stream`` when present (else 0); of a block (a
dict), ``size`` and ``state`` (a str), and ``address`` and ``requested_size`` when present (else
the address after the previous block's, and the size). Without ``--device``: device 0 when its list has events, otherwise the only device
whose list has events, otherwise device 0 (which must still be a list) or, with no device at
all, an empty trace; when device 0's list has none and several others do,
:class:`SnapshotError` lists them (as the Rust reader does). Annotation entries
(below) are not events, so a device whose list holds only annotations counts as empty.

What this module guarantees (the Rust reader ``allocator/trace/src/pytorch.rs`` follows the same
rules, so both turn one snapshot into the same events):

- Every action PyTorch writes is accepted. Those of :data:`ACTIONS` are events of cudalloc's
  format (``snapshot``, ``segment_map`` and ``segment_unmap`` change no live allocation, but are
  written, as PyTorch recorded them). Those of :data:`ANNOTATIONS` are not allocator events and
  have no place in the format: they are skipped whatever their other keys (only ``action`` is
  read), and ``python -m cudalloc_trace.convert`` says how many it skipped.
- ``oom`` entries carry ``device_free`` instead of ``addr``; it is written as the address (as in
  PyTorch's own ``TraceEntry``), or 0 when absent. Every other action needs ``addr``.
- ``time_us`` is optional (older PyTorch versions lack it) and is written as 0 when absent.
- ``stream`` is PyTorch's ``int64`` cast of the stream handle; a negative value is written as its
  64-bit two's complement.
- A missing key, a value of the wrong type or an unknown action raises :class:`SnapshotError`
  naming the entry (1-based) and the key.
- Loading a pickle never runs code from it: only plain containers and numbers are rebuilt; any
  other global (a torch class, a function) becomes an inert :class:`Opaque` object, so torch is
  not needed to read a snapshot.

Usage: ``python -m cudalloc_trace.convert snapshot.pickle out.csv.gz [--device N]`` (the
snapshot plain or gzip'd, as ``cudalloc replay`` reads it).
"""

import argparse
import builtins
import codecs
import gzip
import os
import pickle
import sys

HEADER = "action,addr,size,stream,time_us"

ACTIONS = frozenset(
    [
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "snapshot",
        "oom",
    ]
)

# Entries PyTorch writes into device_traces that are annotations, not allocator events:
# `user_defined`: a record_function range (PyTorch 2.4; 2.5 moved them to `external_annotations`),
# `annotate`: metadata attached to a live allocation by torch.cuda.memory._annotate_memory.
ANNOTATIONS = frozenset(["user_defined", "annotate"])

U64 = (1 << 64) - 1

# The key of the count of allocations put before the history in device_events' `skipped`.
BEFORE_HISTORY = "before history"

# Globals a snapshot pickle may use to rebuild plain data; every other global becomes `Opaque`.
_SAFE_BUILTINS = frozenset(
    ["set", "frozenset", "bytearray", "list", "dict", "tuple", "int", "float", "str", "bytes", "bool"]
)


class SnapshotError(ValueError):
    """A snapshot that cannot be converted; the message names the entry and key."""


class Opaque:
    """Stands in for any object of a class the loader does not rebuild."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:
            return getattr(builtins, name)
        if (module, name) == ("_codecs", "encode"):
            return codecs.encode
        return Opaque


def load_snapshot(path):
    """Loads a snapshot pickle, plain or gzip'd (as ``cudalloc replay`` reads it), without
    running any code from it; a file that is not a pickle raises :class:`SnapshotError`."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as f:
        try:
            return _SafeUnpickler(f).load()
        except SnapshotError:
            raise
        except Exception as e:  # a corrupt pickle can raise almost anything while it is read
            what = "a gzip'd pickle" if gzipped else "a pickle"
            raise SnapshotError(
                f"not {what} written by torch.cuda.memory._dump_snapshot() ({e})"
            ) from e


def is_annotation(entry):
    """Whether a trace entry is one of :data:`ANNOTATIONS` (not an allocator event)."""
    if not isinstance(entry, dict):
        return False
    action = entry.get("action")
    return isinstance(action, str) and action in ANNOTATIONS


def _events_in(entries):
    """How many of a device's entries are events (not annotations); 0 for a non-list."""
    if not isinstance(entries, list):
        return 0
    return sum(1 for e in entries if not is_annotation(e))


def choose_device(traces):
    """The device to read when none was given (see the module docs); 0 when none has events."""
    with_entries = [(d, n) for d, n in ((d, _events_in(e)) for d, e in enumerate(traces)) if n]
    if not with_entries:
        return 0
    if with_entries[0][0] == 0 or len(with_entries) == 1:
        return with_entries[0][0]
    listed = ", ".join(f"device {d}: {n} entries" for d, n in with_entries)
    raise SnapshotError(
        f"device 0 has no trace entries and several devices do ({listed}); pick one with --device N"
    )


def device_entries(snapshot, device=None):
    """The trace entries of one device (``None``: as :func:`choose_device` picks)."""
    return _chosen_entries(snapshot, device)[1]


def _chosen_entries(snapshot, device):
    """``(device, its entries)``; the device is ``None`` when the snapshot has no device."""
    if not isinstance(snapshot, dict):
        raise SnapshotError(f"expected a dict at the top, found {type(snapshot).__name__}")
    if "device_traces" not in snapshot:
        raise SnapshotError("the snapshot has no `device_traces` key")
    traces = snapshot["device_traces"]
    if not isinstance(traces, list):
        raise SnapshotError(f"`device_traces` is a {type(traces).__name__}, not a list")
    if device is None:
        if not traces:
            return None, []
        device = choose_device(traces)
    if device < 0 or device >= len(traces):
        raise SnapshotError(f"device {device} asked for; the snapshot has traces of {len(traces)} device(s)")
    entries = traces[device]
    if not isinstance(entries, list):
        raise SnapshotError(f"`device_traces[{device}]` is a {type(entries).__name__}, not a list")
    return device, entries


def _uint_value(value, key, where):
    """``value`` as a 64-bit unsigned int; ``where`` starts the error message."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{where}: key `{key}` is a {type(value).__name__}, not an int")
    if value < 0 or value > U64:
        raise SnapshotError(f"{where}: key `{key}` = {value} is not a 64-bit unsigned value")
    return value


def _uint(entry, key, index):
    return _uint_value(entry[key], key, f"trace entry {index}")


def _require(entry, key, index):
    if key not in entry:
        raise SnapshotError(f"trace entry {index}: missing key `{key}`")


def _action(entry, index):
    _require(entry, "action", index)
    action = entry["action"]
    if not isinstance(action, str):
        raise SnapshotError(f"trace entry {index}: key `action` is a {type(action).__name__}, not a str")
    if action not in ACTIONS and action not in ANNOTATIONS:
        raise SnapshotError(f"trace entry {index}: unknown action `{action}`")
    return action


def _addr(entry, action, index):
    if "addr" in entry:
        return _uint(entry, "addr", index)
    if action == "oom":
        return _uint(entry, "device_free", index) if "device_free" in entry else 0
    raise SnapshotError(f"trace entry {index}: missing key `addr`")


def _stream_value(value, where):
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{where}: key `stream` is a {type(value).__name__}, not an int")
    if value < -(1 << 63) or value > U64:
        raise SnapshotError(f"{where}: key `stream` = {value} does not fit 64 bits")
    return value & U64


def _stream(entry, index):
    _require(entry, "stream", index)
    return _stream_value(entry["stream"], f"trace entry {index}")


def entry_to_row(entry, index):
    """One trace entry (a dict) as the tuple ``(action, addr, size, stream, time_us)``, or
    ``None`` for an annotation (:data:`ANNOTATIONS`), whose other keys are not read.

    ``index`` is the entry's 1-based position, used in error messages.
    """
    if not isinstance(entry, dict):
        raise SnapshotError(f"trace entry {index}: a {type(entry).__name__}, not a dict")
    action = _action(entry, index)
    if action in ANNOTATIONS:
        return None
    addr = _addr(entry, action, index)
    _require(entry, "size", index)
    size = _uint(entry, "size", index)
    stream = _stream(entry, index)
    time_us = _uint(entry, "time_us", index) if "time_us" in entry else 0
    return (action, addr, size, stream, time_us)


# Block states of a snapshot's segments that hold the block: allocated, or freed and waiting for
# stream events (`active_pending_free` in older PyTorch versions).
HELD_STATES = frozenset(["active_allocated", "active_awaiting_free", "active_pending_free"])


def _segment_blocks(seg, device, where):
    """The held blocks ``(addr, requested size, stream)`` of one segment, if it is of ``device``."""
    if not isinstance(seg, dict):
        raise SnapshotError(f"{where}: a {type(seg).__name__}, not a dict")
    on = _uint_value(seg["device"], "device", where) if "device" in seg else 0
    if on != device:
        return []
    if "address" not in seg:
        raise SnapshotError(f"{where}: missing key `address`")
    addr = _uint_value(seg["address"], "address", where)
    stream = _stream_value(seg["stream"], where) if "stream" in seg else 0
    if "blocks" not in seg:
        raise SnapshotError(f"{where}: missing key `blocks`")
    blocks = seg["blocks"]
    if not isinstance(blocks, list):
        raise SnapshotError(f"{where}: key `blocks` is a {type(blocks).__name__}, not a list")
    held = []
    for j, block in enumerate(blocks, start=1):
        at = f"{where}: block {j}"
        if not isinstance(block, dict):
            raise SnapshotError(f"{at}: a {type(block).__name__}, not a dict")
        start = _uint_value(block["address"], "address", at) if "address" in block else addr
        if "size" not in block:
            raise SnapshotError(f"{at}: missing key `size`")
        size = _uint_value(block["size"], "size", at)
        requested = _uint_value(block["requested_size"], "requested_size", at) if "requested_size" in block else 0
        if "state" not in block:
            raise SnapshotError(f"{at}: missing key `state`")
        state = block["state"]
        if not isinstance(state, str):
            raise SnapshotError(f"{at}: key `state` is a {type(state).__name__}, not a str")
        addr = min(start + size, U64)
        if state in HELD_STATES:
            held.append((start, requested or size, stream))
    return held


def held_blocks(snapshot, device):
    """The blocks ``(addr, requested size, stream)`` the snapshot's segments of ``device`` hold
    (allocated, or waiting for stream events); a malformed segment or block raises
    :class:`SnapshotError` naming it (1-based) and the key."""
    segments = snapshot.get("segments")
    if segments is None and "segments" not in snapshot:
        return []
    if not isinstance(segments, list):
        raise SnapshotError(f"`segments` is a {type(segments).__name__}, not a list")
    held = []
    for i, seg in enumerate(segments, start=1):
        held.extend(_segment_blocks(seg, device, f"segment {i}"))
    return held


def prehistory(rows, held):
    """The ``alloc`` rows (time 0, in address order) of the allocations live before the history
    ``rows`` began: an address whose first ``free_completed`` comes before any ``alloc`` of it
    (size and stream of that free), and a held block (:func:`held_blocks`) whose address no
    ``alloc`` and no ``free_completed`` mentions. The Rust reader
    (``allocator/trace/src/prehistory.rs``) adds the same."""
    allocated, mentioned, before = set(), set(), []
    for action, addr, size, stream, _ in rows:
        if action == "alloc":
            allocated.add(addr)
            mentioned.add(addr)
        elif action == "free_completed":
            mentioned.add(addr)
            if addr not in allocated:
                allocated.add(addr)
                before.append(("alloc", addr, size, stream, 0))
    for addr, size, stream in held:
        if addr not in mentioned:
            mentioned.add(addr)
            before.append(("alloc", addr, size, stream, 0))
    before.sort(key=lambda row: row[1])
    return before


def device_events(snapshot, device=None, skipped=None):
    """Yields the rows of one device's trace, in order, without its annotation entries and after
    the allocations live before its history began (:func:`prehistory`); when ``skipped`` is a
    dict, it counts the annotations by action, and those allocations under ``"before history"``."""
    device, entries = _chosen_entries(snapshot, device)
    rows = []
    for i, entry in enumerate(entries, start=1):
        row = entry_to_row(entry, i)
        if row is not None:
            rows.append(row)
        elif skipped is not None:
            skipped[entry["action"]] = skipped.get(entry["action"], 0) + 1
    held = held_blocks(snapshot, device) if device is not None else []
    before = prehistory(rows, held)
    if skipped is not None and before:
        skipped[BEFORE_HISTORY] = len(before)
    yield from before
    yield from rows


def skipped_note(skipped):
    """What the counts of :func:`device_events` say: annotations skipped and allocations added
    before the history; "" for none."""
    notes = []
    before = skipped.get(BEFORE_HISTORY, 0)
    if before:
        notes.append(f"; {before} allocations live before the history began were put first")
    annotations = {a: n for a, n in skipped.items() if a != BEFORE_HISTORY}
    total = sum(annotations.values())
    if total:
        counts = ", ".join(f"{a}: {n}" for a, n in annotations.items())
        notes.append(f"; skipped {total} annotation entries ({counts}), which are not allocator events")
    return "".join(notes)


def write_csv(rows, out_path):
    """Writes rows in cudalloc's CSV format (gzip'd when ``out_path`` ends in ``.gz``).

    Returns the number of rows written. The rows go to a temporary file beside ``out_path``,
    renamed to it once complete: on an error no partial trace is left under that name.
    """
    out_path = os.fspath(out_path)
    tmp_path = out_path + ".part"
    opener = gzip.open if out_path.endswith(".gz") else open
    n = 0
    try:
        with opener(tmp_path, "wt", encoding="ascii", newline="\n") as out:
            out.write(HEADER + "\n")
            for row in rows:
                out.write("%s,%d,%d,%d,%d\n" % row)
                n += 1
        os.replace(tmp_path, out_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return n


def convert(snapshot_path, out_path, device=None, skipped=None):
    """Converts a snapshot pickle to a trace file; returns the number of events (``skipped``:
    as in :func:`device_events`)."""
    return write_csv(device_events(load_snapshot(snapshot_path), device, skipped), out_path)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m cudalloc_trace.convert",
        description="Convert a torch.cuda.memory snapshot pickle to cudalloc's trace CSV.",
    )
    p.add_argument("snapshot", help="pickle written by torch.cuda.memory._dump_snapshot()")
    p.add_argument("out", help="output trace (.csv or .csv.gz)")
    p.add_argument(
        "--device",
        type=int,
        default=None,
        help="device whose trace to write (default: device 0 if it has events, else the only one that has)",
    )
    args = p.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        print(f"{args.out}: there is no folder {folder}", file=sys.stderr)
        return 1
    skipped = {}
    try:
        n = convert(args.snapshot, args.out, args.device, skipped)
    except SnapshotError as e:
        print(f"{args.snapshot}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # Reading the snapshot or writing the trace (the file named is the one that failed).
        name = args.snapshot if e.filename == args.snapshot else args.out
        print(f"{name}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {n} events to {args.out}{skipped_note(skipped)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
