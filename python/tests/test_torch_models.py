"""Tests of torch_models.py's parent side: workloads, the table, the comparison (no torch
needed; the runs themselves need a GPU and are measured in docs/pytorch.md)."""

import ast
import contextlib
import io
import pathlib
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "examples"))

import torch_models as tm  # noqa: E402


def ok_run(workload, mode, **extra):
    r = {"workload": workload, "mode": mode, "ok": True, "peak_reserved": 3 << 20,
         "peak_allocated": 2 << 20, "step_s": [1.0], "num_device_alloc": 4,
         "num_device_free": 1}
    r.update(extra)
    return r


class Workloads(unittest.TestCase):
    def test_every_recorded_job_is_a_workload(self):
        public = set()
        for name in tm.H200_FILES:
            tree = ast.parse((ROOT / "python" / "examples" / name).read_text())
            public |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                       and not n.name.startswith("_") and n.name != "main"}
        self.assertIn("swin_infer_dynamic", public)  # the fourth set is read too
        self.assertIn("lora_train_varlen", public)  # and the fifth
        self.assertIn("marian_generate", public)  # and the sixth
        self.assertEqual(set(tm.H200_WORKLOADS), public)
        recorded = {p.name.split(".")[0] for p in (ROOT / "traces" / "h200").glob("*.trace.csv.gz")}
        self.assertEqual(set(tm.H200_WORKLOADS), recorded, "a job without its trace or a trace without its job")

    def test_an_unknown_workload_is_refused_by_name(self):
        args = tm.argparse.Namespace(out=tempfile.mkdtemp(), modes="torch", workloads="gpt2,nope")
        with self.assertRaises(SystemExit) as e:
            tm.parent(args)
        self.assertIn("unknown workload 'nope'", str(e.exception))
        self.assertIn("kv_serve", str(e.exception))


class Table(unittest.TestCase):
    def test_a_job_without_results_compares_as_dash(self):
        ref = ok_run("kv_serve", "torch")
        run = ok_run("kv_serve", "cudalloc:default", driver_calls={"total": 164})
        self.assertEqual(tm.compare(run, ref), "-")
        self.assertEqual(tm.compare(ok_run("gpt2", "cudalloc:default", losses=[1.0]),
                                    ok_run("gpt2", "torch", losses=[1.0])), "yes (0.0e+00)")

    def test_driver_calls_per_allocator(self):
        self.assertEqual(tm.driver_calls(ok_run("w", "torch")), "5")
        self.assertEqual(tm.driver_calls(ok_run("w", "cudalloc:default",
                                                driver_calls={"total": 1234})), "1,234")
        self.assertEqual(tm.driver_calls(ok_run("w", "torch-expandable")), "-")

    def test_the_table_has_a_row_per_run_and_names_failures(self):
        results = [ok_run("kv_serve", "torch"),
                   ok_run("kv_serve", "cudalloc:default", driver_calls={"total": 7}),
                   {"workload": "kv_serve", "mode": "torch-expandable", "ok": False,
                    "error": "exit 1: boom"}]
        text = tm.table(results, ["torch", "cudalloc:default", "torch-expandable"], ["kv_serve"])
        lines = text.splitlines()
        self.assertIn("driver calls", lines[0])
        self.assertIn("1.500", lines[2])
        self.assertIn("FAILED", lines[4])
        self.assertIn("kv_serve on torch-expandable: exit 1: boom", text)


if __name__ == "__main__":
    unittest.main()
