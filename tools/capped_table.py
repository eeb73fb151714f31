#!/usr/bin/env python3
"""Replays every trace under caps of 1.03x and 1.10x its peak live bytes and tabulates the
`default` policy's driver calls against PyTorch's `segment_alloc` count (docs/policies.md,
"Under a memory cap").

For each trace: an uncapped replay gives `peak_live_bytes` (and, with --min-capacity, the
smallest cap `default` completes under); then `default` and `torch-expandable` are replayed
capped at each factor (rounded up to bytes). Driver calls are `device_maps + device_unmaps +
device_mallocs + device_frees`.

    python3 tools/capped_table.py [--bin PATH] [--min-capacity] [--json OUT.json]
        [--compare BEFORE.json] [--shared DIR] [TRACE ...]

Without traces: traces/*.gz, traces/h200/*.gz and DIR/*.gz (the shared trace set, by default
/work/shared/traces, when present; by file name, first found wins). --compare prints a before/after table (markdown) against an earlier --json.
"""

import argparse
import glob
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

FACTORS = (1.03, 1.10)
BUDGET = 3.0


def default_traces(shared):
    seen, out = set(), []
    for pat in ("traces/*.gz", "traces/h200/*.gz", os.path.join(shared, "*.gz")):
        for p in sorted(glob.glob(pat)):
            name = os.path.basename(p)
            if name not in seen:
                seen.add(name)
                out.append(p)
    return out


def replay(binary, trace, args):
    cmd = [binary, "replay", "--json", *args, trace]
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    if not rows:
        sys.exit(f"no JSON from {' '.join(cmd)}:\n{r.stderr}")
    return {row["policy"]: row for row in rows}


def calls(row):
    return sum(row[k] for k in ("device_maps", "device_unmaps", "device_mallocs", "device_frees"))


def measure(binary, trace, min_cap):
    extra = ["--min-capacity"] if min_cap else []
    base = replay(binary, trace, ["--policy", "default", *extra])["default"]
    live = base["peak_live_bytes"]
    out = {
        "trace": os.path.basename(trace).split(".")[0],
        "peak_live": live,
        "segment_alloc": base["segment_alloc_events"],
        "uncapped_calls": calls(base),
        "min_capacity": (base["min_capacity_bytes"] or 0) / live if min_cap else None,
    }
    for f in FACTORS:
        cap = math.ceil(live * f)
        rows = replay(binary, trace, ["--policy", "default", "--policy", "torch-expandable",
                                      "--capacity", str(cap)])
        for pol, row in rows.items():
            out[f"{pol}@{f}"] = {"calls": calls(row), "completed": row["completed"]}
    return out


def ratio(r, key):
    c = r[key]
    return c["calls"] / max(r["segment_alloc"], 1), c["completed"]


def cell(r, key):
    x, done = ratio(r, key)
    return f"{x:.1f}" + ("" if done else " (failed)")


def summary(results, label):
    lines = [f"{label}:"]
    for f in FACTORS:
        key = f"default@{f}"
        done = [r for r in results if r[key]["completed"]]
        within = [r for r in done if ratio(r, key)[0] <= BUDGET]
        te = sum(r[f"torch-expandable@{f}"]["completed"] for r in results)
        lines.append(f"  {f:.2f}x: completed {len(done)}/{len(results)}, within {BUDGET:g}x "
                     f"{len(within)}/{len(done)} (torch-expandable completed {te})")
    mc = [r["min_capacity"] for r in results if r["min_capacity"]]
    if mc:
        g = math.exp(sum(math.log(x) for x in mc) / len(mc))
        lines.append(f"  min capacity / peak live: geo mean {g:.4f}, max {max(mc):.4f}")
    return "\n".join(lines)


def min_cap(r):
    return f"{r['min_capacity']:.4f}" if r and r["min_capacity"] else "-"


def table(results, before):
    old = {r["trace"]: r for r in before or []}
    head = "| trace | segment_alloc |"
    for f in FACTORS:
        head += f" {f:.2f}x before | {f:.2f}x after |" if before else f" {f:.2f}x |"
    head += " min cap before | min cap after |" if before else " min cap |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        row = f"| {r['trace']} | {r['segment_alloc']} |"
        o = old.get(r["trace"])
        for f in FACTORS:
            key = f"default@{f}"
            if before:
                row += f" {cell(o, key) if o else '-'} |"
            row += f" {cell(r, key)} |"
        if before:
            row += f" {min_cap(o)} |"
        row += f" {min_cap(r)} |"
        lines.append(row)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"),
                                                  "release", "cudalloc"))
    ap.add_argument("--min-capacity", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--compare")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--shared", default="/work/shared/traces")
    ap.add_argument("traces", nargs="*")
    a = ap.parse_args()
    traces = a.traces or default_traces(a.shared)
    with ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda t: measure(a.bin, t, a.min_capacity), traces))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    before = None
    if a.compare:
        with open(a.compare) as fh:
            before = json.load(fh)
        print(summary([r for r in before if r["trace"] in {x["trace"] for x in results}],
                      "before"))
    print(summary(results, "after" if before else "now"))
    print()
    print(table(results, before))


if __name__ == "__main__":
    main()
