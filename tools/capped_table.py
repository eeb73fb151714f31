#!/usr/bin/env python3
"""Replays every trace under caps of 1.03x and 1.10x its peak live bytes and tabulates the
`default` policy's driver calls against PyTorch's `segment_alloc` count (docs/policies.md,
"Under a memory cap").

For each trace: an uncapped replay gives `peak_live_bytes` (and, with --min-capacity, the
smallest cap `default` completes under); then `default` and `torch-expandable` are replayed
capped at each factor (rounded up to bytes). Driver calls are `device_maps + device_unmaps +
device_mallocs + device_frees`.

    python3 tools/capped_table.py [--bin PATH] [--min-capacity] [--cuda [--repeat N]]
        [--json OUT.json] [--compare BEFORE.json] [--shared DIR] [TRACE ...]

With --cuda the capped replays run through the CUDA driver on GPU 0 (`replay --cuda`, one
trace at a time) and the table is allocator time instead: the seconds of every allocation and
free with their driver calls (`ns_per_event` x `events`; in brackets the part spent inside the
driver, from `driver_time`), `default` against `torch-expandable` at each cap, with the ratio
where both complete (the target: at most 1.5). --repeat N replays
each (trace, cap) N times and keeps the median seconds of each policy (the runs are in the
JSON as `seconds_runs`; calls, completion and device waits are the first run's, the driver's
part (`driver_seconds`, `driver_time`) that of the run with the median time, and a warning,
with `repeats_differ` in the JSON, says when the runs disagree on them): one
run's milliseconds to tens of milliseconds of host work move by up to half from one run to the
next. The uncapped replay that gives the peak live bytes stays on the simulated
device.

Without traces: traces/*.gz, traces/h200/*.gz and DIR/*.gz (the shared trace set, by default
/work/shared/traces, when present; by file name, first found wins). --compare prints a before/after table (markdown) against an earlier --json.
"""

import argparse
import glob
import json
import math
import os
import statistics
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


def seconds(row):
    return (row["ns_per_event"] or 0) * row["events"] / 1e9  # ns_per_event is null without events


def driver_seconds(row):
    """Seconds spent inside driver calls (`driver_time`, with --cuda), or None."""
    kinds = row.get("driver_time")
    return None if kinds is None else sum(k["ns"] for k in kinds.values()) / 1e9


def capped(binary, trace, cap, cuda, repeat):
    """Each policy's row under `cap`, with the median seconds of `repeat` replays (`seconds`)
    and every run's (`seconds_runs`)."""
    args = ["--policy", "default", "--policy", "torch-expandable", "--capacity", str(cap)]
    runs = [replay(binary, trace, args + (["--cuda"] if cuda else [])) for _ in range(repeat)]
    out = {}
    for pol, row in runs[0].items():
        figures = [(calls(run[pol]), run[pol]["completed"], run[pol]["device_waits"])
                   for run in runs]
        if len(set(figures)) > 1:
            # On the real driver a release's timing may in principle change what a replay does.
            print(f"warning: {os.path.basename(trace)} under {pol} capped at {cap} bytes: the "
                  f"repeats differ in (calls, completed, device waits): {figures}; the first "
                  f"run's are kept", file=sys.stderr)
        times = [seconds(run[pol]) for run in runs]
        # The driver's part of the run whose time is the median (the lower middle one for an
        # even count), so that it is a part of a time the row shows.
        middle = runs[times.index(statistics.median_low(times))][pol]
        out[pol] = {"calls": calls(row), "completed": row["completed"],
                    "seconds": statistics.median(times), "seconds_runs": times,
                    "driver_seconds": driver_seconds(middle),
                    "driver_time": middle.get("driver_time"),
                    "device_waits": row["device_waits"],
                    "repeats_differ": len(set(figures)) > 1}
    return out


def measure(binary, trace, min_cap, cuda=False, repeat=1):
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
        for pol, row in capped(binary, trace, math.ceil(live * f), cuda, repeat).items():
            out[f"{pol}@{f}"] = row
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


def time_cell(r, f):
    d, t = r[f"default@{f}"], r[f"torch-expandable@{f}"]
    def cell(c):
        if not c["completed"]:
            return "fails"
        driver = c.get("driver_seconds")
        inside = "" if driver is None else f" ({driver:.3f} s in the driver)"
        return f"{c['calls']:,}, {c['seconds']:.3f} s{inside}, {c['device_waits']}"
    ratio = d["seconds"] / t["seconds"] if d["completed"] and t["completed"] else None
    return f" {cell(d)} | {cell(t)} | {'-' if ratio is None else f'{ratio:.2f}'} |", ratio


def time_table(results):
    head = ("| trace | cap | `default`: calls, seconds (in the driver), device waits "
            "| `torch-expandable` | time ratio |")
    lines = [head, "|---|---|---|---|---|"]
    ratios, done = [], 0
    for r in results:
        for f in FACTORS:
            text, ratio = time_cell(r, f)
            lines.append(f"| {r['trace']} | {f:.2f}x |{text}")
            done += r[f"default@{f}"]["completed"]
            if ratio is not None:
                ratios.append((ratio, r["trace"], f))
    within = sum(x <= 1.5 for x, _, _ in ratios)
    worst = max(ratios, default=None)
    tail = f", the highest {worst[0]:.2f} ({worst[1]} at {worst[2]:.2f}x)" if worst else ""
    lines.append("")
    lines.append(f"`default` completed {done} of {2 * len(results)}; time within 1.5x "
                 f"`torch-expandable`'s on {within} of the {len(ratios)} where both complete{tail}")
    return "\n".join(lines)


def add_common_args(ap):
    """The options this tool shares with tools/kind_table.py: the binary, the shared trace set,
    the JSON output and the parallel jobs."""
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"),
                                                  "release", "cudalloc"))
    ap.add_argument("--shared", default="/work/shared/traces")
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=2)


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    ap.add_argument("--min-capacity", action="store_true")
    ap.add_argument("--compare")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("traces", nargs="*")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error(f"--repeat must be at least 1, not {a.repeat}")
    if a.repeat > 1 and not a.cuda:
        ap.error("--repeat is for --cuda: a replay on the simulated device gives the same figures")
    traces = a.traces or default_traces(a.shared)
    jobs = 1 if a.cuda else a.jobs  # timed replays share no device
    with ThreadPoolExecutor(jobs) as ex:
        results = list(ex.map(lambda t: measure(a.bin, t, a.min_capacity, a.cuda, a.repeat),
                              traces))
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
    if a.cuda:
        print()
        print(time_table(results))


if __name__ == "__main__":
    main()
