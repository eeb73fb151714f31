"""tools/kind_table.py's grouping and its kinds file, without the cudalloc binary: the rows are
stand-ins for its replays."""

import contextlib
import io
import json
import os
import pathlib
import sys
import tempfile
import unittest

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import kind_table  # noqa: E402


def capped(completed, calls):
    return {"completed": completed, "calls": calls}


def row(name, ratios, calls, segment_alloc=10, capped_calls=(20, 20), done=(True, True),
        te_done=(True, True)):
    r = {"trace": name, "segment_alloc": segment_alloc, "uncapped_calls": calls}
    for p, x in zip(kind_table.POLICIES, ratios):
        r[f"{p} reserved/live"] = x
    for f, c, d, t in zip(kind_table.capped_table.FACTORS, capped_calls, done, te_done):
        r[f"default@{f}"] = capped(d, c)
        r[f"torch-expandable@{f}"] = capped(t, 0)
    return r


class Table(unittest.TestCase):
    def test_a_kind_row_takes_geometric_means_and_counts_the_budget(self):
        rows = [row("a", (1.21, 1.1, 1.01), calls=30),
                row("b", (1.0, 1.1, 1.04), calls=40, capped_calls=(31, 10),
                    done=(True, True), te_done=(False, True))]
        kinds = {"training": ["a", "b"], "serving": ["missing"]}
        lines = kind_table.table(kinds, rows).splitlines()
        self.assertEqual(len(lines), 4, lines)  # head, rule, training, all (serving has none)
        cells = [c.strip() for c in lines[2].strip("|").split("|")]
        self.assertEqual(cells[:2], ["training", "2"])
        self.assertEqual(cells[2], "1.1000")  # sqrt(1.21 x 1.0)
        self.assertEqual(cells[4], f"{(1.01 * 1.04) ** 0.5:.4f}")
        self.assertEqual(cells[5], f"{(3.0 * 4.0) ** 0.5:.2f}")
        self.assertEqual(cells[6], "1 of 2")  # 30 calls within 3 x 10, 40 not
        self.assertEqual(cells[7], "2 (1) / 1")  # 31 calls at 1.03x pass the budget
        self.assertEqual(cells[8], "2 (2) / 2")
        self.assertTrue(lines[3].startswith(f"| {kind_table.ALL} | 2 |"))

    def test_a_trace_without_segment_allocs_or_calls_or_live_bytes_counts_where_it_can(self):
        rows = [row("a", (1.2, 1.1, 1.0), calls=0),  # no call at all: within, left out of geo
                row("b", (1.2, 1.1, 1.0), calls=30, segment_alloc=0),  # no budget
                row("c", (1.2, 1.1, 1.0), calls=40)]
        rows[1]["torch reserved/live"] = None  # nothing live
        cells = [c.strip() for c in kind_table.table({"k": ["a", "b", "c"]}, rows)
                 .splitlines()[2].strip("|").split("|")]
        self.assertEqual(cells[1], "3")
        self.assertEqual(cells[2], "1.2000")
        self.assertEqual(cells[5], "4.00")  # c's 40 / 10; a's 0 left out of the mean
        self.assertEqual(cells[6], "1 of 2")  # a within, c not, b without a budget
        self.assertEqual(cells[7], "3 (2) / 3")  # a and c within at 1.03x; b has no budget

    def test_a_failed_capped_replay_is_not_counted_within_the_budget(self):
        rows = [row("a", (1.0, 1.0, 1.0), calls=1, capped_calls=(1, 1), done=(False, True))]
        cells = kind_table.table({"k": ["a"]}, rows).splitlines()[2].split("|")
        self.assertEqual(cells[8].strip(), "0 (0) / 1")


class KindsFile(unittest.TestCase):
    def load(self, content):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            fh.write(content)
        self.addCleanup(os.unlink, fh.name)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
            kind_table.load_kinds(fh.name)
        return str(e.exception.code)

    def test_a_trace_in_two_kinds_is_refused_by_name(self):
        msg = self.load(json.dumps({"kinds": {"a": ["x", "y"], "b": ["y"]}}))
        self.assertIn("y is in two kinds", msg)

    def test_a_malformed_file_is_refused(self):
        self.assertIn("cannot read", self.load("{not json"))
        self.assertIn("list of trace names", self.load(json.dumps({"kinds": {"a": "x"}})))

    def test_the_bundled_kinds_name_every_bundled_trace_once(self):
        root = TOOLS.parent
        kinds = kind_table.load_kinds(str(root / "traces" / "kinds.json"))
        named = {n for names in kinds.values() for n in names}
        # The traces the tables replay (capped_table.default_traces): not traces/programs/,
        # whose traces tests replay on their programs' threads.
        found = list((root / "traces").glob("*.gz")) + list((root / "traces" / "h200").glob("*.gz"))
        bundled = {p.name.split(".")[0] for p in found}
        self.assertEqual(bundled - named, set())
        self.assertEqual(named - bundled, {"llama_generate"})  # the shared set's


if __name__ == "__main__":
    unittest.main()
