"""Writes the PyTorch-snapshot fixtures of `allocator/trace/tests/readers/trace_formats.rs` (no torch needed).

    python3 allocator/tests/data/make_fixtures.py

- snapshot.pickle: a dict shaped like `torch.cuda.memory._snapshot()`, pickled with the default
  protocol as `_dump_snapshot()` does, with traces of two devices, frames, an `oom` entry that
  carries `device_free` instead of `addr`, address reuse, two streams, and an object of a class
  the Rust reader cannot resolve (it must be ignored);
- snapshot_p2.pickle: the same dict pickled with protocol 2;
- snapshot.csv: device 0's trace converted by `python/cudalloc_trace` (the Rust test checks that
  reading the pickle and reading this CSV give the same trace);
- snapshot_annotated.pickle: the same snapshot with annotation entries, which are not allocator
  events, between device 0's events: `user_defined` entries as PyTorch 2.4 wrote them for
  `record_function` (addr, size and stream 0, the name in `frames`), one without `addr`, `size`
  and `stream`, and an `annotate` entry (`torch.cuda.memory._annotate_memory`, 2026). Both
  readers must turn it into exactly the events of snapshot.csv (`allocator/trace/tests/readers/snapshot_actions.rs`,
  `python/tests/test_convert.py`).

- snapshot_late.pickle / snapshot_late.csv: a snapshot whose history began after the model was
  loaded: it frees two tensors it never saw allocated, and its segments hold blocks it never
  mentions (one given by address, one placed after the previous block, one waiting for stream
  events), beside blocks that must not count (inactive, on device 1, allocated in the history);
  the CSV is the Python converter's output, which starts with those allocations
  (`allocator/tests/snapshot_prehistory.rs` reads both).

torch211_snapshot.pickle is not made here: it is a real `_dump_snapshot()` of PyTorch 2.11 on an
H200, of the workload `TORCH_WORKLOAD` below, recorded with no stack traces by

    python3 -m cudalloc_trace.record --out rec.csv.gz -- work.py torch211_snapshot.pickle
    python3 -m cudalloc_trace.convert torch211_snapshot.pickle torch211_snapshot.csv
"""

import pathlib
import pickle
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "python"))

from cudalloc_trace.convert import device_events, write_csv  # noqa: E402

MIB = 1 << 20
SEG_A = 0x7F2A_0000_0000  # above 2^32: pickled as an 8-byte long
SEG_B = 0x7F2A_0200_0000
STREAM = 0x5581_2D3A_9F10

TORCH_WORKLOAD = """
import sys, torch
xs = []
for i in range(50):
    xs.append(torch.empty((i + 1) * 1000, device="cuda"))
    if i % 3 == 0:
        xs.pop(0)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    y = torch.randn(1 << 20, device="cuda")
del y, xs
try:
    torch.empty(1 << 45, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    pass
z = torch.ones(300000, device="cuda") * 2
if len(sys.argv) > 1:
    torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


class Opaque:
    """Pickled as `__main__.Opaque`, a global no reader can resolve."""

    def __init__(self):
        self.note = "ignored"


def frame(line):
    return {"filename": "train.py", "line": line, "name": "step"}


def entry(action, addr, size, stream=0, time_us=0, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us}
    e.update(extra)
    return e


def device0():
    t = 1_700_000_000_000_000
    return [
        entry("segment_alloc", SEG_A, 2 * MIB, time_us=t, frames=[frame(10)]),
        entry("alloc", SEG_A, 1000, time_us=t + 1, frames=[frame(11)]),
        entry("alloc", SEG_A + 1024, 3000, time_us=t + 2),
        entry("free_requested", SEG_A, 1000, time_us=t + 3),
        entry("free_completed", SEG_A, 1000, time_us=t + 4),
        entry("alloc", SEG_A, 512, time_us=t + 5),  # address reuse
        entry("segment_alloc", SEG_B, 20 * MIB, stream=STREAM, time_us=t + 6),
        entry("alloc", SEG_B, 5 * MIB, stream=STREAM, time_us=t + 7, compile_context="N/A"),
        {"action": "oom", "device_free": 123 * MIB, "size": 64 * MIB, "stream": 0, "time_us": t + 8},
        entry("snapshot", 0, 0, time_us=t + 9),
        entry("free_requested", SEG_B, 5 * MIB, stream=STREAM, time_us=t + 10),
        entry("free_completed", SEG_B, 5 * MIB, stream=STREAM, time_us=t + 11),
        entry("free_completed", SEG_A + 1024, 3000, time_us=t + 12),
        entry("segment_free", SEG_B, 20 * MIB, stream=STREAM, time_us=t + 13),
    ]


def user_defined(name, stage, time_us):
    """A `record_function` annotation as PyTorch 2.4 put it in `device_traces`."""
    frames = [{"name": stage, "filename": name, "line": 0}]
    return entry("user_defined", 0, 0, time_us=time_us, frames=frames)


def device0_annotated():
    """device0() with annotations before, between and after its events."""
    t = 1_700_000_000_000_000
    events = device0()
    notes = {
        0: [user_defined("ProfilerStep#0", "START", t - 2), user_defined("## forward ##", "START", t - 1)],
        2: [entry("annotate", SEG_A, 1000, time_us=t + 1, user_metadata="kept by autograd")],
        # Without addr, size and stream: only `action` may be read.
        8: [{"action": "user_defined", "time_us": t + 8, "name": "## backward ##", "user_metadata": {"stage": "START"}}],
        len(events): [user_defined("ProfilerStep#0", "END", t + 14)],
    }
    out = []
    for i in range(len(events) + 1):
        out.extend(notes.get(i, []))
        if i < len(events):
            out.append(events[i])
    return out


def device1():
    return [
        entry("segment_alloc", SEG_A, 2 * MIB, time_us=5),
        entry("alloc", SEG_A, 4096, time_us=6),
        entry("alloc", SEG_A + 4096, 8192, time_us=7),
    ]


def snapshot():
    segment = {
        "device": 0,
        "address": SEG_A,
        "total_size": 2 * MIB,
        "allocated_size": 3584,
        "active_size": 3584,
        "requested_size": 3512,
        "stream": 0,
        "segment_type": "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [frame(10)],
        "blocks": [{"address": SEG_A, "size": 512, "requested_size": 512, "state": "active_allocated"}],
    }
    return {
        "segments": [segment],
        "device_traces": [device0(), device1()],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
        "external_annotations": [],
        "opaque": Opaque(),
    }


def late_snapshot():
    """A history that began after loading: see the module docs (snapshot_late)."""
    w = SEG_B  # the "weights": a 20 MiB segment, fully used before the history began
    history = [
        entry("alloc", SEG_A, 1000, time_us=10),
        entry("free_requested", w + 4 * MIB, 2 * MIB, time_us=11),
        entry("free_completed", w + 4 * MIB, 2 * MIB, time_us=12),  # allocated before
        entry("free_completed", SEG_A, 1000, time_us=13),
        entry("alloc", w + 4 * MIB, 1 * MIB, time_us=14),  # reuses the freed address
        entry("free_completed", w + 6 * MIB, 3 * MIB, stream=STREAM, time_us=15),  # before too
        entry("free_requested", w + 12 * MIB, 5 * MIB, time_us=16),  # waits for an event
    ]
    blocks = [
        {"address": w, "size": 4 * MIB, "requested_size": 4 * MIB - 100, "state": "active_allocated"},
        {"address": w + 4 * MIB, "size": 1 * MIB, "requested_size": 1 * MIB, "state": "active_allocated"},
        {"address": w + 5 * MIB, "size": 1 * MIB, "requested_size": 0, "state": "inactive"},
        {"address": w + 6 * MIB, "size": 3 * MIB, "requested_size": 0, "state": "inactive"},
        # no address: it starts where the previous block ends (w + 9 MiB); no requested size
        {"size": 3 * MIB, "state": "active_allocated"},
        {"address": w + 12 * MIB, "size": 5 * MIB, "requested_size": 5 * MIB, "state": "active_awaiting_free"},
        {"address": w + 17 * MIB, "size": 3 * MIB, "requested_size": 0, "state": "inactive"},
    ]
    weights = {"device": 0, "address": w, "total_size": 20 * MIB, "stream": 0, "blocks": blocks}
    other = {"device": 1, "address": SEG_A, "stream": 0, "blocks": [{"address": SEG_A, "size": 512, "state": "active_allocated"}]}
    return {"segments": [other, weights], "device_traces": [history, []]}


def main():
    snap = snapshot()
    (HERE / "snapshot.pickle").write_bytes(pickle.dumps(snap))
    (HERE / "snapshot_p2.pickle").write_bytes(pickle.dumps(snap, protocol=2))
    n = write_csv(device_events(snap, 0), HERE / "snapshot.csv")
    annotated = snapshot()
    annotated["device_traces"][0] = device0_annotated()
    (HERE / "snapshot_annotated.pickle").write_bytes(pickle.dumps(annotated))
    late = late_snapshot()
    (HERE / "snapshot_late.pickle").write_bytes(pickle.dumps(late))
    m = write_csv(device_events(late), HERE / "snapshot_late.csv")
    print(
        f"wrote snapshot.pickle, snapshot_p2.pickle, snapshot.csv ({n} events), snapshot_annotated.pickle, "
        f"snapshot_late.pickle, snapshot_late.csv ({m} events)"
    )


if __name__ == "__main__":
    main()
