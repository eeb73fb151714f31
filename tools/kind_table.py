#!/usr/bin/env python3
"""The trace set by kind of job (docs/policies.md, "By kind of job"): for each kind of
`traces/kinds.json`, reserved / live bytes under `torch`, `torch-expandable` and `default`
(geometric means), `default`'s driver calls over PyTorch's `segment_alloc` count (geometric
mean, and how many traces are within 3x), and under caps of 1.03x and 1.10x the peak live
bytes how many traces complete on `default` (how many of those within 3x in calls) and on
`torch-expandable`; a last row over every trace replayed.

    python3 tools/kind_table.py [--bin PATH] [--kinds FILE] [--shared DIR] [--json OUT.json]
        [--jobs N]

Traces are found as tools/capped_table.py finds them (traces/*.gz, traces/h200/*.gz and the
shared set in DIR); a trace of the kinds file that is not found is named on stderr and left
out (the table's `traces` column counts those replayed); a trace found in no kind is named
on stderr too and counts only in the last row. A trace without `segment_alloc` events (one
cudalloc's own C library wrote) has no call budget and is left out of the calls columns.
Replays are on the simulated device.
"""

import argparse
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import capped_table  # noqa: E402

POLICIES = ("torch", "torch-expandable", "default")
ALL = "all traces"


def load_kinds(path):
    """Kind -> trace names, from a JSON object whose `kinds` maps each kind to a list of names;
    a name in two kinds is refused."""
    try:
        with open(path) as fh:
            kinds = json.load(fh).get("kinds")
    except (OSError, ValueError) as e:
        sys.exit(f"kind_table: cannot read {path}: {e}")
    if not isinstance(kinds, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in kinds.values()):
        sys.exit(f"kind_table: {path}: 'kinds' must map each kind to a list of trace names")
    seen = {}
    for kind, names in kinds.items():
        for n in names:
            if n in seen:
                sys.exit(f"kind_table: {path}: {n} is in two kinds ({seen[n]!r} and {kind!r})")
            seen[n] = kind
    return kinds


def trace_name(path):
    return os.path.basename(path).split(".")[0]


def measure(binary, trace):
    """One trace's row: reserved / live under each policy uncapped (`None` for a trace with
    nothing live), and `default` and `torch-expandable` at each cap of `capped_table.FACTORS`
    (its `measure`)."""
    args = [a for p in POLICIES for a in ("--policy", p)]
    rows = capped_table.replay(binary, trace, args)
    out = capped_table.measure(binary, trace, False)
    for p in POLICIES:
        r = rows[p]
        live = r["peak_live_bytes"]
        out[f"{p} reserved/live"] = r["peak_reserved_bytes"] / live if live else None
    return out


def geo(xs):
    """The geometric mean of the positive figures of `xs` (`None`s and zeros left out)."""
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def has_budget(r):
    """Whether the trace says how many `cudaMalloc`s PyTorch made (`segment_alloc` events):
    traces that cudalloc's own C library wrote have none, and no call budget."""
    return r["segment_alloc"] > 0


def within(r, key):
    calls = r[key]["calls"] if key else r["uncapped_calls"]
    return calls <= capped_table.BUDGET * r["segment_alloc"]


def capped_cell(rows, f):
    d = [r for r in rows if r[f"default@{f}"]["completed"]]
    inside = sum(within(r, f"default@{f}") for r in d if has_budget(r))
    te = sum(r[f"torch-expandable@{f}"]["completed"] for r in rows)
    return f"{len(d)} ({inside}) / {te}"


def kind_row(kind, rows):
    budgeted = [r for r in rows if has_budget(r)]
    cells = [kind, str(len(rows))]
    cells += [f"{geo([r[f'{p} reserved/live'] for r in rows]):.4f}" for p in POLICIES]
    cells.append(f"{geo([r['uncapped_calls'] / r['segment_alloc'] for r in budgeted]):.2f}")
    cells.append(f"{sum(within(r, None) for r in budgeted)} of {len(budgeted)}")
    cells += [capped_cell(rows, f) for f in capped_table.FACTORS]
    return "| " + " | ".join(cells) + " |"


def table(kinds, results):
    """The markdown table: a row per kind with traces replayed, then one over all of them."""
    by_name = {r["trace"]: r for r in results}
    head = ("| kind of job | traces | reserved/live: torch | torch-expandable | default "
            "| default calls / segment_alloc (geo mean) | within 3x uncapped |")
    head += "".join(f" completed at {f:.2f}x: default (within 3x) / torch-expandable |"
                    for f in capped_table.FACTORS)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind, names in kinds.items():
        rows = [by_name[n] for n in names if n in by_name]
        if rows:
            lines.append(kind_row(kind, rows))
    lines.append(kind_row(ALL, results))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    capped_table.add_common_args(ap)
    ap.add_argument("--kinds", default="traces/kinds.json")
    a = ap.parse_args()
    if a.jobs < 1:
        ap.error(f"--jobs must be at least 1, not {a.jobs}")
    kinds = load_kinds(a.kinds)
    traces = capped_table.default_traces(a.shared)
    found = {trace_name(t) for t in traces}
    named = {n for names in kinds.values() for n in names}
    for n in sorted(named - found):
        print(f"kind_table: {n} (in {a.kinds}) not found: left out", file=sys.stderr)
    for n in sorted(found - named):
        print(f"kind_table: {n} is in no kind of {a.kinds}: only in the last row",
              file=sys.stderr)
    if not traces:
        sys.exit("kind_table: no traces found (traces/*.gz, traces/h200/*.gz, --shared)")
    with ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda t: measure(a.bin, t), traces))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print(table(kinds, results))


if __name__ == "__main__":
    main()
