"""tools/capped_table.py's repeats (--repeat, for replays through the driver), without a GPU or
the cudalloc binary: the replays are stand-ins."""

import contextlib
import io
import pathlib
import sys
import unittest
from unittest import mock

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import capped_table  # noqa: E402


def row(policy, ns_per_event, maps=10, completed=True, waits=0):
    return {"policy": policy, "ns_per_event": ns_per_event, "events": 1000, "device_maps": maps,
            "device_unmaps": 0, "device_mallocs": 0, "device_frees": 0, "completed": completed,
            "device_waits": waits}


def replays(*runs):
    """A stand-in for `capped_table.replay` giving these runs in turn."""
    it = iter(runs)
    return lambda binary, trace, args: next(it)


class Repeats(unittest.TestCase):
    def test_the_median_time_of_the_repeats_is_kept_with_every_run(self):
        runs = [{"default": row("default", ns), "torch-expandable": row("torch-expandable", 2 * ns)}
                for ns in (3000, 1000, 2000)]
        with mock.patch.object(capped_table, "replay", replays(*runs)):
            out = capped_table.capped("bin", "t.csv.gz", 1 << 30, True, 3)
        d = out["default"]
        self.assertEqual(d["seconds_runs"], [3e-3, 1e-3, 2e-3])
        self.assertEqual(d["seconds"], 2e-3)
        self.assertEqual((d["calls"], d["completed"], d["device_waits"]), (10, True, 0))
        self.assertFalse(d["repeats_differ"])
        self.assertEqual(out["torch-expandable"]["seconds"], 4e-3)

    def test_repeats_that_disagree_keep_the_first_run_and_say_so(self):
        runs = [{"default": row("default", 1000, maps=10)},
                {"default": row("default", 1000, maps=12, waits=1)}]
        err = io.StringIO()
        with mock.patch.object(capped_table, "replay", replays(*runs)), \
                contextlib.redirect_stderr(err):
            d = capped_table.capped("bin", "t.csv.gz", 1 << 30, True, 2)["default"]
        self.assertTrue(d["repeats_differ"])
        self.assertEqual((d["calls"], d["device_waits"]), (10, 0))
        self.assertIn("repeats differ", err.getvalue())

    def test_repeat_is_refused_without_cuda_or_below_one(self):
        for argv in (["--repeat", "2"], ["--cuda", "--repeat", "0"]):
            err = io.StringIO()
            with mock.patch.object(sys, "argv", ["capped_table.py", *argv]), \
                    contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
                capped_table.main()
            self.assertEqual(e.exception.code, 2, argv)
            self.assertIn("--repeat", err.getvalue())


if __name__ == "__main__":
    unittest.main()
