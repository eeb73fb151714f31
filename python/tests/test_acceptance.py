"""The acceptance runner's comparison and table (python/acceptance/run.py), without torch or a
GPU: the programs themselves run on the GPU machine."""

import ast
import pathlib
import sys
import types
import unittest
from unittest import mock

ACCEPTANCE = pathlib.Path(__file__).resolve().parents[1] / "acceptance"
sys.path.insert(0, str(ACCEPTANCE))

import run  # noqa: E402


def program_names():
    """The keys of PROGRAMS in programs.py, read without importing torch."""
    tree = ast.parse((ACCEPTANCE / "programs.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "PROGRAMS":
            return [k.value for k in node.value.keys]
    raise AssertionError("no PROGRAMS in programs.py")


class Compare(unittest.TestCase):
    def test_losses_are_bit_identical_close_or_different(self):
        ref = {"ok": True, "losses": [1.0, 2.0]}
        self.assertEqual(run.compare({"ok": True, "losses": [1.0, 2.0]}, ref), "bit-identical")
        self.assertTrue(run.compare({"ok": True, "losses": [1.0, 2.0000001]}, ref).startswith("close"))
        self.assertTrue(run.compare({"ok": True, "losses": [1.0, 2.5]}, ref).startswith("DIFFERENT"))
        self.assertEqual(run.compare(ref, ref), "ref")

    def test_more_runs_with_another_output_than_the_reference_differ(self):
        ref = {"ok": True, "losses": [1.0], "differing_runs": 1}
        same = {"ok": True, "losses": [1.0], "differing_runs": 1}
        more = {"ok": True, "losses": [1.0], "differing_runs": 2}
        self.assertEqual(run.compare(same, ref), "bit-identical, differing_runs=1")
        self.assertTrue(run.compare(more, ref).startswith("DIFFERENT runs"), run.compare(more, ref))
        self.assertFalse(run.passed({("p", "torch"): ref, ("p", "c"): more}, ["p"], ["torch", "c"]))

    def test_results_of_another_length_differ(self):
        ref = {"ok": True, "losses": [1.0, 2.0]}
        self.assertTrue(run.compare({"ok": True, "losses": [1.0]}, ref).startswith("DIFFERENT"))
        self.assertTrue(run.compare({"ok": True, "losses": []}, {"ok": True, "losses": []}).startswith("DIFFERENT"))

    def test_the_suite_fails_on_a_difference_or_a_failure(self):
        ref = {"ok": True, "losses": [1.0]}
        good = {("p", "torch"): ref, ("p", "c"): {"ok": True, "losses": [1.0]}}
        self.assertTrue(run.passed(good, ["p"], ["torch", "c"]))
        bad = {("p", "torch"): ref, ("p", "c"): {"ok": True, "losses": [3.0]}}
        self.assertFalse(run.passed(bad, ["p"], ["torch", "c"]))
        failed = {("p", "torch"): ref, ("p", "c"): {"ok": False, "error": "x"}}
        self.assertFalse(run.passed(failed, ["p"], ["torch", "c"]))

    def test_losses_come_first_then_the_other_results(self):
        ref = {"ok": True, "losses": [1.0]}
        got = run.compare({"ok": True, "losses": [1.0], "restores": 3}, ref)
        self.assertEqual(got, "bit-identical, restores=3")
        got = run.compare({"ok": True, "losses": [2.0], "restores": 3}, ref)
        self.assertTrue(got.startswith("DIFFERENT"), got)

    def test_a_traced_cudalloc_run_turns_thread_caches_off_and_names_its_file(self):
        self.assertEqual(run.cudalloc_conf("cudalloc:default", None), "policy:default")
        self.assertEqual(run.cudalloc_conf("cudalloc:default+thread_cache_large:0", None),
                         "policy:default,thread_cache_large:0")
        self.assertEqual(run.cudalloc_conf("cudalloc:torch-expandable", "/t"),
                         "policy:torch-expandable,thread_cache:False")
        self.assertEqual(run.trace_path("/t", "train_near_cap", "cudalloc:default"),
                         "/t/train_near_cap.default.csv.gz")
        self.assertEqual(run.partial("/t/train_near_cap.default.csv.gz"),
                         "/t/train_near_cap.default.part.csv.gz")
        self.assertIn("memory_history", run.UNTRACED)

    def test_replayed_traces_are_judged_only_where_the_column_is_the_whole_run(self):
        import replay_traces as rt
        results = [
            {"program": "side_stream", "mode": "cudalloc:default", "ok": True,
             "trace": "/t/side_stream.default.csv.gz", "peak_reserved": 100 << 20},
            {"program": "train_near_cap", "mode": "cudalloc:default", "ok": True,
             "trace": "/t/train_near_cap.default.csv.gz", "peak_reserved": 100 << 20},
            {"program": "serve_loop", "mode": "torch", "ok": True, "peak_reserved": 1},
            {"program": "generate_kv", "mode": "cudalloc:default", "ok": False,
             "trace": "/t/generate_kv.default.csv.gz"},
        ]
        runs = list(rt.traced(results))
        self.assertEqual([r[0] for r in runs], ["side_stream", "train_near_cap"])
        replay = {"completed": True, "peak_reserved_bytes": 100 << 20,
                  "answers": {"used": 3, "recorded": 3, "unrecorded": 0}}
        line, bad = rt.row("side_stream", "default", 100 << 20, replay)
        self.assertFalse(bad)
        self.assertIn("same", line)
        self.assertIn("3/3 answers", line)
        more = dict(replay, peak_reserved_bytes=110 << 20)
        line, bad = rt.row("side_stream", "default", 100 << 20, more)
        self.assertTrue(bad)
        self.assertIn("1.1000", line)
        line, bad = rt.row("train_near_cap", "default", 100 << 20, more)
        self.assertFalse(bad)
        self.assertIn("not judged", line)
        self.assertTrue(rt.row("side_stream", "default", 100 << 20, None)[1])

    def test_traces_moved_since_the_run_and_traces_without_answers(self):
        import gzip
        import tempfile
        import replay_traces as rt
        results = [{"program": "side_stream", "mode": "cudalloc:default", "ok": True,
                    "trace": "/gone/side_stream.default.csv.gz", "peak_reserved": 1}]
        with tempfile.TemporaryDirectory() as d:
            moved = list(rt.traced(results, d))
            self.assertEqual(moved[0][2], f"{d}/side_stream.default.csv.gz")
            header = "action,addr,size,stream,time_us\nalloc,0,512,0,1\n"
            plain = pathlib.Path(d) / "a.csv"
            plain.write_text(header)
            self.assertFalse(rt.has_answers(str(plain)))
            asked = pathlib.Path(d) / "b.csv.gz"
            with gzip.open(asked, "wt") as f:
                f.write(header + "event_pending,0,0,7,2\nalloc,512,512,0,3\n")
            self.assertTrue(rt.has_answers(str(asked)))
            cut = pathlib.Path(d) / "c.csv.gz"
            cut.write_bytes(asked.read_bytes()[:20])
            self.assertTrue(rt.has_answers(str(cut)), "an unreadable trace is left to the replay")
            bad = bytearray(asked.read_bytes())
            bad[12:20] = b"\xff" * 8
            cut.write_bytes(bytes(bad))
            self.assertTrue(rt.has_answers(str(cut)), "a corrupt trace is left to the replay")

    def test_a_cpu_list_reads_items_and_ranges_and_names_a_bad_one(self):
        self.assertEqual(run.cpu_list("2,3"), {2, 3})
        self.assertEqual(run.cpu_list("4-6,1"), {1, 4, 5, 6})
        for bad in ("x", "3-1", "2,", "-1"):
            with self.assertRaises(ValueError) as e:
                run.cpu_list(bad)
            self.assertIn(repr(bad), str(e.exception))

    def test_a_failed_run_names_its_error(self):
        got = run.compare({"ok": False, "error": "RuntimeError: boom"}, None)
        self.assertEqual(got, "FAILED: RuntimeError: boom")

    def test_other_results_are_listed(self):
        got = run.compare({"ok": True, "fitted": 11, "went_on": True}, {"ok": True})
        self.assertEqual(got, "fitted=11, went_on=True")

    def test_skipped_steps_and_tokens_must_be_the_references_and_a_repeats(self):
        ref = {"ok": True, "losses": [1.0], "skipped_steps": 4, "tokens": [6363, 10507]}
        same = {"ok": True, "losses": [1.0], "skipped_steps": 4, "tokens": [6363, 10507]}
        self.assertEqual(run.compare(same, ref), "bit-identical, skipped_steps=4")
        # A token id one off is within the losses' tolerance, but another token.
        near = dict(same, tokens=[6363, 10508])
        self.assertTrue(run.compare(near, ref).startswith("DIFFERENT tokens"))
        more = dict(same, skipped_steps=5)
        self.assertTrue(run.compare(more, ref).startswith("DIFFERENT skipped_steps"))
        self.assertFalse(run.passed({("p", "torch"): ref, ("p", "cudalloc:default"): more},
                                    ["p"], ["torch", "cudalloc:default"]))
        r = run.merge(None, {"ok": True, "losses": [1.0], "skipped_steps": 4})
        other = run.merge(r, {"ok": True, "losses": [1.0], "skipped_steps": 5})
        self.assertFalse(other["ok"], "a repeat that skipped other steps fails the pair")

    def test_the_table_has_a_row_per_program_and_mode(self):
        results = {("p", "torch"): {"ok": True, "peak_reserved": 2 << 20, "wall_s": 1.0},
                   ("p", "cudalloc:default"): {"ok": False, "error": "exit -6", "backend": "extension"}}
        lines = run.table(results, ["p"], ["torch", "cudalloc:default"]).splitlines()
        self.assertEqual(len(lines), 4)  # the header, two rows, torch's memory summary
        self.assertIn("2 MiB", lines[1])
        self.assertIn("cudalloc:default (extension)", lines[2])
        self.assertIn("FAILED: exit -6", lines[2])

    def test_calls_are_cudallocs_driver_calls_over_pytorchs_mallocs(self):
        ref = {"ok": True, "num_device_alloc": 40, "num_device_free": 3}
        self.assertEqual(run.calls_cell(ref, ref), "40+3")
        self.assertEqual(run.calls_cell({"ok": True, "driver_calls": 130}, ref), "130 (3.2x)")
        self.assertEqual(run.calls_cell({"ok": True, "driver_calls": 7}, None), "7")
        self.assertEqual(run.calls_cell({"ok": False}, ref), "-")
        results = {("a", "torch"): ref, ("a", "c"): {"ok": True, "driver_calls": 120},
                   ("b", "torch"): {"ok": True, "num_device_alloc": 10},
                   ("b", "c"): {"ok": True, "driver_calls": 31},
                   ("d", "torch"): {"ok": False}, ("d", "c"): {"ok": True, "driver_calls": 5}}
        lines = run.calls_summary(results, ["a", "b", "d"], ["torch", "c"])
        self.assertEqual(
            lines, ["c: driver calls within 3x PyTorch's cudaMallocs on 1 of 2 programs"])

    def test_cudallocs_calls_add_its_private_pools_and_pytorchs_come_from_its_stats(self):
        torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
            current_device=lambda: 0,
            memory_stats=lambda: {"num_device_alloc": 40, "num_device_free": 3}))
        stats = {"driver_calls": {"total": 100, "device_waits": 1, "lent_blocks": 7,
                                  "lends_refused_busy": 4},
                 "capi": {"private_pools": {"driver_calls": 23, "device_waits": 2}}}
        lib = types.SimpleNamespace(stats=lambda device: stats)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            self.assertEqual(run.device_calls(lib), {"driver_calls": 123, "device_waits": 3,
                                                     "lent_blocks": 7, "lends_refused_busy": 4})
            self.assertEqual(run.device_calls(None),
                             {"num_device_alloc": 40, "num_device_free": 3})

    def test_step_times_are_shown_beside_pytorchs(self):
        ref = {"ok": True, "step_ms": 10.0}
        self.assertEqual(run.step_time({"ok": True, "step_ms": 10.3}, ref), "10.30 (+3.0%)")
        self.assertEqual(run.step_time(ref, ref), "10.00")
        self.assertEqual(run.step_time({"ok": True}, ref), "-")

    def test_the_memory_summary_has_a_geometric_mean_and_the_expandable_count(self):
        results = {
            ("a", "torch"): {"ok": True, "peak_reserved": 100},
            ("a", "torch-expandable"): {"ok": True, "peak_reserved": 80},
            ("a", "c"): {"ok": True, "peak_reserved": 25},
            ("b", "torch"): {"ok": True, "peak_reserved": 100},
            ("b", "torch-expandable"): {"ok": True, "peak_reserved": 90},
            ("b", "c"): {"ok": True, "peak_reserved": 100},
        }
        lines = run.memory_summary(results, ["a", "b"], ["torch", "torch-expandable", "c"])
        self.assertIn("c: peak reserved / PyTorch's, geometric mean 0.500 over 2 programs", lines[2])
        self.assertIn("at most PyTorch's expandable on 1 of 2", lines[2])


    def test_repeats_keep_the_first_results_and_the_median_step_time(self):
        r = run.merge(None, {"ok": True, "losses": [1.0], "step_ms": 5.0})
        r = run.merge(r, {"ok": True, "losses": [1.0], "step_ms": 9.0})
        r = run.merge(r, {"ok": True, "losses": [1.0], "step_ms": 6.0})
        self.assertEqual(r["step_ms_runs"], [5.0, 9.0, 6.0])
        self.assertEqual(r["step_ms"], 6.0)
        failed = run.merge(r, {"ok": False, "error": "boom"})
        self.assertFalse(failed["ok"], "a failed repeat fails the pair")
        self.assertEqual(failed["step_ms_runs"], [5.0, 9.0, 6.0])
        other = run.merge(r, {"ok": True, "losses": [2.0], "step_ms": 6.0})
        self.assertFalse(other["ok"], "a repeat with other losses fails the pair")
        self.assertIn("losses", other["error"])

    def test_repeats_hold_losses_to_the_tolerance_of_the_comparison_with_pytorch(self):
        # Seen on the H200: train_autocast's losses moved in the sixth digit from one repeat to
        # the next under PyTorch's own allocator as under cudalloc's.
        first = [10.975967407226562, 10.974181175231934]
        again = [10.975967407226562, 10.974197387695312]
        r = run.merge(None, {"ok": True, "losses": first})
        r = run.merge(r, {"ok": True, "losses": again})
        self.assertTrue(r["ok"], r.get("error"))
        self.assertEqual(r["losses"], first, "the first run's losses are kept")
        self.assertEqual(r["repeat_rel_diff"], abs(again[1] - first[1]) / first[1])
        empty = run.merge(run.merge(None, {"ok": True, "losses": []}), {"ok": True, "losses": []})
        self.assertTrue(empty["ok"], "two runs without losses agree")
        off = run.merge(r, {"ok": True, "losses": [10.975967407226562, 11.0]})
        self.assertFalse(off["ok"], "losses beyond the tolerance fail the pair")
        shorter = run.merge(r, {"ok": True, "losses": first[:1]})
        self.assertFalse(shorter["ok"], "fewer losses fail the pair")
        checks = run.merge(run.merge(None, {"ok": True, "checks": 3}), {"ok": True, "checks": 4})
        self.assertFalse(checks["ok"], "other results must repeat exactly")

    def test_a_failed_first_run_stays_failed_whatever_the_repeats_give(self):
        failed = run.merge(None, {"ok": False, "error": "boom"})
        for again in ({"ok": True, "losses": [1.0], "step_ms": 5.0},
                      {"ok": True, "losses": []}, {"ok": True, "max_abs_diff": 1e-6}):
            r = run.merge(failed, again)
            self.assertFalse(r["ok"], again)
            self.assertNotIn("repeat_rel_diff", r)

    def test_repeats_keep_the_largest_difference_a_program_reported(self):
        r = run.merge(None, {"ok": True, "overwritten": 0, "max_abs_diff": 1e-6})
        r = run.merge(r, {"ok": True, "overwritten": 0, "max_abs_diff": 4e-6})
        r = run.merge(r, {"ok": True, "overwritten": 0, "max_abs_diff": 2e-6})
        self.assertTrue(r["ok"], r.get("error"))
        self.assertEqual(r["max_abs_diff"], 4e-6)

    def test_differing_runs_add_up_over_repeats(self):
        r = run.merge(None, {"ok": True, "losses": [1.0], "differing_runs": 0})
        r = run.merge(r, {"ok": True, "losses": [1.0], "differing_runs": 1})
        r = run.merge(r, {"ok": True, "losses": [1.0], "differing_runs": 2})
        self.assertEqual(r["differing_runs"], 3)


    def test_capped_figures_are_shown_not_judged(self):
        ref = {"ok": True, "losses": [1.0], "steps_1.10x": "16/16", "steps_1.03x": "3/16"}
        got = run.compare({"ok": True, "losses": [1.0], "steps_1.10x": "16/16",
                           "steps_1.03x": "16/16", "syncs_1.03x": 2}, ref)
        self.assertEqual(got, "bit-identical, steps_1.10x=16/16, steps_1.03x=16/16, syncs_1.03x=2")


class NearCap(unittest.TestCase):
    def test_capped_losses_must_be_the_uncapped_ones(self):
        import capped

        capped._check_losses([2.5, 2.4], [2.5, 2.4, 2.3], 1.03)  # fewer steps, the same losses
        capped._check_losses([2.5 * (1 + 1e-4)], [2.5], 1.03)  # within the tolerance
        for bad in ([2.6], [float("nan")], [float("inf")]):
            with self.assertRaises(RuntimeError, msg=bad):
                capped._check_losses(bad, [2.5], 1.03)


class Programs(unittest.TestCase):
    def test_every_program_is_documented(self):
        doc = ast.get_docstring(ast.parse((ACCEPTANCE / "programs.py").read_text()))
        for name in program_names():
            self.assertIn(f"``{name}``", doc, name)


if __name__ == "__main__":
    unittest.main()
