"""Tests of cudalloc_trace's snapshot conversion (no torch needed).

Run with ``python3 -m unittest discover -s python/tests`` or ``python3 -m pytest python/tests``.
"""

import contextlib
import gzip
import io
import os
import pathlib
import pickle
import sys
import tempfile
import types
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if not os.environ.get("CUDALLOC_TEST_INSTALLED"):  # else: the package pip installed
    sys.path.insert(0, str(ROOT / "python"))

from cudalloc_trace import convert as conv  # noqa: E402
from cudalloc_trace import record  # noqa: E402

FIXTURES = ROOT / "allocator" / "tests" / "data"


def entry(action, addr, size, stream=0, time_us=0, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us}
    e.update(extra)
    return e


def snapshot(*devices):
    return {"segments": [], "device_traces": [list(d) for d in devices]}


class Sneaky:
    """Unpickling this with plain pickle would call os.getcwd; the safe loader must not."""

    def __reduce__(self):
        return (os.getcwd, ())


class ConvertTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_rows(self):
        snap = snapshot(
            [
                entry("segment_alloc", 1 << 40, 2 << 20, frames=[{"filename": "a.py", "line": 1}]),
                entry("alloc", 1 << 40, 100, time_us=7),
                {"action": "oom", "device_free": 5, "size": 9, "stream": 0},
                {"action": "free_completed", "addr": 1 << 40, "size": 100, "stream": -1},
            ]
        )
        rows = list(conv.device_events(snap))
        self.assertEqual(
            rows,
            [
                ("segment_alloc", 1 << 40, 2 << 20, 0, 0),
                ("alloc", 1 << 40, 100, 0, 7),
                ("oom", 5, 9, 0, 0),
                ("free_completed", 1 << 40, 100, (1 << 64) - 1, 0),
            ],
        )

    def test_errors_name_entry_and_key(self):
        bad = snapshot([entry("alloc", 1, 2), {"action": "alloc", "addr": 3, "stream": 0}])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 2: missing key `size`"):
            list(conv.device_events(bad))
        bad = snapshot([entry("alloc", 1, "2")])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: key `size` is a str"):
            list(conv.device_events(bad))
        bad = snapshot([entry("alloc", 1, True)])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: key `size` is a bool"):
            list(conv.device_events(bad))
        bad = snapshot([entry("alloc", -1, 2)])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: key `addr`"):
            list(conv.device_events(bad))
        bad = snapshot([entry("realloc", 1, 2)])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: unknown action `realloc`"):
            list(conv.device_events(bad))
        bad = snapshot([{"action": "alloc", "size": 1, "stream": 0}])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: missing key `addr`"):
            list(conv.device_events(bad))

    def test_device_choice(self):
        snap = snapshot([entry("alloc", 1, 2)], [entry("alloc", 3, 4)])
        self.assertEqual(list(conv.device_events(snap, 1)), [("alloc", 3, 4, 0, 0)])
        with self.assertRaisesRegex(conv.SnapshotError, "device 2"):
            list(conv.device_events(snap, 2))
        with self.assertRaisesRegex(conv.SnapshotError, "device_traces"):
            list(conv.device_events({"segments": []}))
        # Without a device: 0 when it has events, else the only one that has, else none; several
        # without device 0 are an error listing them (the Rust reader's rule).
        self.assertEqual(list(conv.device_events(snapshot([entry("alloc", 1, 2)], [entry("alloc", 3, 4)]))), [("alloc", 1, 2, 0, 0)])
        self.assertEqual(list(conv.device_events(snapshot([], [entry("alloc", 3, 4)]))), [("alloc", 3, 4, 0, 0)])
        self.assertEqual(list(conv.device_events(snapshot([], []))), [])
        self.assertEqual(list(conv.device_events(snapshot())), [])
        with self.assertRaisesRegex(conv.SnapshotError, "device 1: 1 entries, device 2: 2 entries"):
            list(conv.device_events(snapshot([], [entry("alloc", 3, 4)], [entry("alloc", 5, 6), entry("alloc", 7, 8)])))

    def test_convert_plain_and_gzip(self):
        snap = snapshot([entry("alloc", 4096, 10, time_us=1), entry("free_completed", 4096, 10, time_us=2)])
        src = self.dir / "snap.pickle"
        src.write_bytes(pickle.dumps(snap))
        expected = "action,addr,size,stream,time_us\nalloc,4096,10,0,1\nfree_completed,4096,10,0,2\n"
        self.assertEqual(conv.convert(src, self.dir / "t.csv"), 2)
        self.assertEqual((self.dir / "t.csv").read_text(), expected)
        self.assertEqual(conv.main([str(src), str(self.dir / "t.csv.gz")]), 0)
        self.assertEqual(gzip.decompress((self.dir / "t.csv.gz").read_bytes()).decode(), expected)

    def test_failed_conversion_leaves_no_file(self):
        src = self.dir / "bad.pickle"
        src.write_bytes(pickle.dumps(snapshot([entry("alloc", 1, 2), {"action": "alloc"}])))
        out = self.dir / "t.csv.gz"
        self.assertEqual(conv.main([str(src), str(out)]), 1)
        self.assertEqual(list(self.dir.iterdir()), [src])

    def test_errors_name_the_file_at_fault(self):
        text = self.dir / "notes.txt"
        text.write_text("hello\n")
        future = self.dir / "p9.pickle"
        future.write_bytes(b"\x80\x09" + b"x" * 10)
        good = FIXTURES / "torch211_snapshot.pickle"
        corrupt = self.dir / "corrupt.pickle"
        corrupt.write_bytes(b"\x80\x04\x95" + b"\xff" * 8)
        cases = [
            ([text, self.dir / "o.csv"], "notes.txt: not a pickle"),
            ([corrupt, self.dir / "o.csv"], "corrupt.pickle: not a pickle"),
            (
                [future, self.dir / "o.csv"],
                "p9.pickle: not a pickle written by torch.cuda.memory._dump_snapshot() "
                "(unsupported pickle protocol",
            ),
            (
                [good, self.dir / "no" / "o.csv"],
                f"{self.dir / 'no' / 'o.csv'}: there is no folder {self.dir / 'no'}",
            ),
            ([self.dir / "missing.pickle", self.dir / "o.csv"], "missing.pickle: No such file"),
        ]
        for args, says in cases:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(conv.main([str(a) for a in args]), 1, args)
            self.assertIn(says, err.getvalue())
            self.assertNotIn(".part", err.getvalue())

    def test_loader_runs_no_code(self):
        src = self.dir / "sneaky.pickle"
        snap = snapshot([entry("alloc", 1, 2)])
        snap["sneaky"] = Sneaky()
        snap["pool"] = {(1, 2)}  # protocol 2 rebuilds a set through builtins.set
        src.write_bytes(pickle.dumps(snap, protocol=2))
        loaded = conv.load_snapshot(src)
        self.assertIsInstance(loaded["sneaky"], conv.Opaque)
        self.assertEqual(loaded["pool"], {(1, 2)})
        self.assertEqual(list(conv.device_events(loaded)), [("alloc", 1, 2, 0, 0)])

    def test_committed_fixture(self):
        out = self.dir / "fixture.csv"
        conv.convert(FIXTURES / "snapshot.pickle", out)
        self.assertEqual(out.read_text(), (FIXTURES / "snapshot.csv").read_text())
        out2 = self.dir / "fixture_p2.csv"
        conv.convert(FIXTURES / "snapshot_p2.pickle", out2)
        self.assertEqual(out2.read_text(), out.read_text())

    def test_a_gzipped_snapshot_reads_as_the_plain_one(self):
        gz = self.dir / "snapshot.pickle.gz"
        gz.write_bytes(gzip.compress((FIXTURES / "snapshot.pickle").read_bytes()))
        out = self.dir / "from_gz.csv"
        conv.convert(gz, out)
        self.assertEqual(out.read_text(), (FIXTURES / "snapshot.csv").read_text())
        cut = self.dir / "cut.pickle.gz"
        cut.write_bytes(gz.read_bytes()[:40])
        with self.assertRaises(conv.SnapshotError) as e:
            conv.load_snapshot(cut)
        self.assertIn("not a gzip'd pickle", str(e.exception))

    def test_real_torch_snapshot(self):
        out = self.dir / "torch.csv"
        self.assertEqual(conv.convert(FIXTURES / "torch211_snapshot.pickle", out), 167)
        self.assertEqual(out.read_text(), (FIXTURES / "torch211_snapshot.csv").read_text())


def user_defined(name, stage):
    """A ``record_function`` annotation as PyTorch 2.4 wrote it into ``device_traces``."""
    return entry("user_defined", 0, 0, time_us=1, frames=[{"name": stage, "filename": name, "line": 0}])


class AnnotationTest(unittest.TestCase):
    """Annotation entries (``user_defined``, ``annotate``) are not allocator events: skipped, and
    counted by action when asked; the Rust reader does the same (``allocator/trace/tests/readers/snapshot_actions.rs``)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_annotations_are_skipped_whatever_fields_they_have(self):
        alloc, free = entry("alloc", 4096, 100, time_us=2), entry("free_completed", 4096, 100, time_us=3)
        plain = list(conv.device_events(snapshot([alloc, free])))
        annotated = snapshot(
            [
                user_defined("ProfilerStep#0", "START"),
                {"action": "user_defined"},
                alloc,
                {"action": "annotate", "addr": 4096, "user_metadata": "kept by autograd"},
                {"action": "user_defined", "addr": "not an int", "size": None, "name": "## forward ##"},
                free,
                user_defined("ProfilerStep#0", "END"),
            ]
        )
        skipped = {}
        self.assertEqual(list(conv.device_events(annotated, skipped=skipped)), plain)
        self.assertEqual(skipped, {"user_defined": 4, "annotate": 1})
        self.assertEqual(list(conv.device_events(annotated)), plain)

    def test_snapshot_and_segment_map_stay_events(self):
        seg = 1 << 30
        trace = [entry("segment_map", seg, 2 << 20), entry("snapshot", 0, 0), entry("segment_unmap", seg, 2 << 20)]
        rows = list(conv.device_events(snapshot(trace)))
        self.assertEqual([r[0] for r in rows], ["segment_map", "snapshot", "segment_unmap"])

    def test_device_with_only_annotations_does_not_hide_the_one_with_events(self):
        notes = [user_defined("gloo:broadcast", "START"), user_defined("gloo:broadcast", "END")]
        events = [user_defined("ProfilerStep#0", "START"), entry("alloc", 4096, 100)]
        self.assertEqual(list(conv.device_events(snapshot(notes, [], events))), [("alloc", 4096, 100, 0, 0)])
        with self.assertRaisesRegex(conv.SnapshotError, "device 1: 1 entries, device 2: 1 entries"):
            list(conv.device_events(snapshot(notes, events, events)))
        self.assertEqual(list(conv.device_events(snapshot(notes, notes))), [])

    def test_unknown_action_is_still_an_error(self):
        bad = snapshot([user_defined("x", "START"), entry("alloc", 1, 2), entry("realloc", 1, 2)])
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 3: unknown action `realloc`"):
            list(conv.device_events(bad))
        with self.assertRaisesRegex(conv.SnapshotError, r"entry 1: key `action` is a int"):
            list(conv.device_events(snapshot([{"action": 9}])))

    def test_annotated_fixture_converts_to_the_plain_csv(self):
        out = self.dir / "annotated.csv"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(conv.main([str(FIXTURES / "snapshot_annotated.pickle"), str(out)]), 0)
        self.assertEqual(out.read_text(), (FIXTURES / "snapshot.csv").read_text())
        self.assertIn("wrote 14 events", err.getvalue())
        self.assertIn("skipped 5 annotation entries (user_defined: 4, annotate: 1)", err.getvalue())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(conv.main([str(FIXTURES / "snapshot.pickle"), str(out)]), 0)
        self.assertNotIn("skipped", err.getvalue())


class PrehistoryTest(unittest.TestCase):
    """A history that began after loading starts with what was live before it."""

    def test_the_late_fixture_converts_to_its_csv(self):
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d) / "late.csv"
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(conv.main([str(FIXTURES / "snapshot_late.pickle"), str(out)]), 0)
            self.assertEqual(out.read_text(), (FIXTURES / "snapshot_late.csv").read_text())
            self.assertIn("wrote 12 events", err.getvalue())
            self.assertIn("5 allocations live before the history began were put first", err.getvalue())

    def test_frees_before_allocs_and_unmentioned_held_blocks_come_first(self):
        segment = {
            "device": 0,
            "address": 0x1000,
            "stream": 5,
            "blocks": [
                {"address": 0x1000, "size": 512, "requested_size": 500, "state": "active_allocated"},
                {"size": 512, "state": "active_awaiting_free"},  # at 0x1200, its size
                {"address": 0x1400, "size": 512, "requested_size": 0, "state": "inactive"},
                {"address": 0x1600, "size": 512, "requested_size": 9, "state": "active_allocated"},
            ],
        }
        snap = snapshot(
            [
                entry("free_completed", 0x9000, 64, stream=3),
                entry("alloc", 0x1600, 9),  # mentioned: not added again
                entry("free_completed", 0x9000, 64, stream=3),  # a second free stays a free
            ]
        )
        snap["segments"] = [segment, dict(segment, device=1, address=0x5000)]
        rows = list(conv.device_events(snap))
        self.assertEqual(
            rows[:3],
            [("alloc", 0x1000, 500, 5, 0), ("alloc", 0x1200, 512, 5, 0), ("alloc", 0x9000, 64, 3, 0)],
        )
        self.assertEqual(len(rows), 6)

    def test_a_malformed_segment_is_named(self):
        block = lambda state: {"size": 512, "state": state}  # noqa: E731
        cases = [
            ([3], "segment 1: a int, not a dict"),
            ([{"blocks": []}], "segment 1: missing key `address`"),
            ([{"address": 0}], "segment 1: missing key `blocks`"),
            ([{"address": 0, "blocks": []}, {"address": 0, "blocks": 1}], "segment 2: key `blocks` is a int, not a list"),
            ([{"address": 0, "blocks": [block("inactive"), block(1)]}], "segment 1: block 2: key `state` is a int, not a str"),
            ([{"address": 0, "blocks": [{"state": "inactive"}]}], "segment 1: block 1: missing key `size`"),
            (5, "`segments` is a int, not a list"),
        ]
        for segments, want in cases:
            snap = snapshot([entry("alloc", 4096, 1, time_us=1)])
            snap["segments"] = segments
            with self.assertRaises(conv.SnapshotError) as e:
                list(conv.device_events(snap))
            self.assertEqual(str(e.exception), want)


class MessagesTest(unittest.TestCase):
    def test_messages_match_the_rust_reader(self):
        """The same words as allocator/cli/tests/bad_input/trace_input_errors.rs
        (none_and_a_stream_past_64_bits_are_worded_as_the_converter_words_them)."""
        good = entry("alloc", 4096, 4096)
        cases = [
            (snapshot([dict(good, time_us=None)]), "trace entry 1: key `time_us` is a NoneType, not an int"),
            (snapshot([dict(good, stream=1 << 64)]), "trace entry 1: key `stream` = 18446744073709551616 does not fit 64 bits"),
            (
                snapshot([dict(good, stream=-(1 << 63) - 1)]),
                "trace entry 1: key `stream` = -9223372036854775809 does not fit 64 bits",
            ),
            (dict(snapshot([good]), segments=None), "`segments` is a NoneType, not a list"),
            (snapshot([None]), "trace entry 1: a NoneType, not a dict"),
        ]
        for snap, want in cases:
            with self.assertRaises(conv.SnapshotError) as e:
                list(conv.device_events(snap))
            self.assertEqual(str(e.exception), want)


class FakeMemory:
    """Stands in for torch.cuda.memory: remembers the calls, returns a fixed snapshot (by
    default, one allocation on device 0)."""

    def __init__(self):
        self.calls = []
        self.max_entries = None
        self.snap = snapshot([entry("alloc", 4096, 10, time_us=1)], [])

    def _record_memory_history(self, enabled="all", context="all", max_entries=0):
        self.calls.append(("history", enabled, context))
        if enabled:
            self.max_entries = max_entries

    def _snapshot(self):
        self.calls.append(("snapshot",))
        return self.snap


class RecordTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)
        self.memory = FakeMemory()
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(memory=self.memory)
        self.saved = (sys.modules.get("torch"), list(sys.argv), list(sys.path))
        sys.modules["torch"] = torch

    def tearDown(self):
        torch, sys.argv[:], sys.path[:] = self.saved
        if torch is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = torch
        self.tmp.cleanup()

    def test_script_runs_under_recording_and_trace_is_written(self):
        script = self.dir / "prog.py"
        script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\nsys.exit(3)\n")
        out, marker = self.dir / "t.csv.gz", self.dir / "marker"
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit) as exit:
                record.main(["--out", str(out), "--", str(script), str(marker)])
        self.assertEqual(exit.exception.code, 3)
        self.assertEqual(marker.read_text(), "ran")
        self.assertEqual(
            self.memory.calls,
            [("history", "all", None), ("snapshot",), ("history", None, "all")],
        )
        text = gzip.decompress(out.read_bytes()).decode()
        self.assertEqual(text, "action,addr,size,stream,time_us\nalloc,4096,10,0,1\n")


    def script(self):
        """A program that leaves a marker file, and the marker's path."""
        script, marker = self.dir / "prog.py", self.dir / "marker"
        script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        return script, marker

    def test_an_output_folder_that_does_not_exist_stops_before_the_program(self):
        script, marker = self.script()
        out = self.dir / "no" / "t.csv.gz"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(record.main(["--out", str(out), "--", str(script)]), 1)
        self.assertFalse(marker.exists(), "the program ran")
        self.assertEqual(self.memory.calls, [], "recording started")
        self.assertIn(f"there is no folder {self.dir / 'no'}", err.getvalue())
        self.assertNotIn(".part", err.getvalue())

    def test_an_output_that_is_a_folder_stops_before_the_program(self):
        script, marker = self.script()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(record.main(["--out", str(self.dir), "--", str(script)]), 1)
        self.assertFalse(marker.exists(), "the program ran")
        self.assertEqual(self.memory.calls, [], "recording started")
        self.assertIn("is a folder", err.getvalue())

    def test_without_device_the_device_with_events_is_written(self):
        self.memory.snap = snapshot([], [entry("alloc", 8192, 20, time_us=2)])
        script, _ = self.script()
        out = self.dir / "t.csv"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(record.main(["--out", str(out), "--", str(script)]), 0)
        self.assertEqual(out.read_text(), "action,addr,size,stream,time_us\nalloc,8192,20,0,2\n")
        self.assertIn("wrote 1 events", err.getvalue())

    def test_a_device_without_a_trace_is_one_line_after_the_job(self):
        script, marker = self.script()
        out = self.dir / "t.csv"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(record.main(["--out", str(out), "--device", "5", "--", str(script)]), 1)
        self.assertTrue(marker.exists(), "the program did not run")
        self.assertFalse(out.exists())
        self.assertIn("the trace was not written: device 5 asked for", err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())

    def test_a_failing_program_keeps_its_error_when_the_trace_fails_too(self):
        script = self.dir / "fails.py"
        script.write_text("raise ValueError('the job broke')\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with self.assertRaisesRegex(ValueError, "the job broke"):
                record.main(["--out", str(self.dir / "t.csv"), "--device", "5", "--", str(script)])
        self.assertIn("the trace was not written: device 5 asked for", err.getvalue())

    def test_max_entries_reaches_pytorch(self):
        script, _ = self.script()
        with contextlib.redirect_stderr(io.StringIO()):
            record.main(["--out", str(self.dir / "t.csv"), "--max-entries", "77", "--", str(script)])
        self.assertEqual(self.memory.max_entries, 77)


class RecordArgsTest(unittest.TestCase):
    def test_split_at_double_dash(self):
        args = record.parse_args(
            ["--out", "t.csv.gz", "--device", "1", "--max-entries", "9", "--", "train.py", "--lr", "3"]
        )
        self.assertEqual(args.out, "t.csv.gz")
        self.assertEqual(args.device, 1)
        self.assertEqual(args.max_entries, 9)
        self.assertEqual(args.target, ["train.py", "--lr", "3"])

    def test_module_target(self):
        args = record.parse_args(["--out", "t.csv", "--", "-m", "pkg.train"])
        self.assertEqual(args.target, ["-m", "pkg.train"])

    def test_no_program_is_an_error(self):
        with open(os.devnull, "w") as devnull:
            saved, sys.stderr = sys.stderr, devnull
            try:
                with self.assertRaises(SystemExit):
                    record.parse_args(["--out", "t.csv"])
            finally:
                sys.stderr = saved


if __name__ == "__main__":
    unittest.main()
