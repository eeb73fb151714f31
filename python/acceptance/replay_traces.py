#!/usr/bin/env python3
"""Replays the traces ``run.py --trace DIR`` recorded, with the GPU's answers
(``cudalloc replay --answers``), and prints each beside what the program reserved: the check
that a real run replays as it ran.

Usage, from the repository root, after ``run.py --out OUT --trace DIR`` (on any machine; the
replay needs no GPU)::

    python3 python/acceptance/replay_traces.py OUT/results.json --cudalloc target/release/cudalloc

The traces are read where ``run.py`` wrote them; when they were copied from the GPU machine
since, ``--traces DIR`` names the folder they are in now (the file names are kept).

A run whose allocator asked no event query recorded no answer, and is listed as not replayed.
A program whose column cannot equal its replay (it sets a memory fraction, calls
``empty_cache`` or ``reset_peak_memory_stats``, or allocates in private pools: ``NOT_WHOLE``) is
shown, marked, and not judged. The exit status is 1 when a judged program's replay reserved
other than the program did, or failed.
"""

import argparse
import gzip
import json
import os
import subprocess
import zlib
import sys

# Programs whose peak reserved column is not the whole run on device 0's allocator, or that do
# what a trace does not hold (docs/pytorch.md, "Acceptance programs").
NOT_WHOLE = ("train_near_cap", "oom_recover", "oom_batch_search", "pool_under_cap", "memory_api",
             "failed_capture", "graph_capture", "compile_reduce_overhead", "mem_pool",
             "compile_train_eval", "compile_tree_paths", "memory_snapshot", "memory_history",
             "threaded_serve", "cudnn_near_cap")

MiB = 1 << 20


def traced(results, moved_to=None):
    """The runs of ``results`` (run.py's results.json) that left a trace: (program, policy,
    trace path, the program's peak reserved bytes or None); each trace in folder ``moved_to``
    under its own file name when given."""
    for r in results:
        if r.get("ok") and r.get("trace"):
            policy = r["mode"].split(":", 1)[1]
            path = r["trace"]
            if moved_to is not None:
                path = os.path.join(moved_to, os.path.basename(path))
            yield r["program"], policy, path, r.get("peak_reserved")


def row(program, policy, reserved, replay):
    """One line of the table and whether it fails: ``replay`` is the JSON row of
    ``cudalloc replay --answers --json`` (or None when the replay failed to run)."""
    judged = program not in NOT_WHOLE
    if replay is None or not replay.get("completed"):
        return f"{program:24} {policy:16} replay FAILED", judged
    got = replay["peak_reserved_bytes"]
    a = replay["answers"] or {}
    answers = f"{a.get('used', 0)}/{a.get('recorded', 0)} answers"
    if reserved is None:
        return f"{program:24} {policy:16} {'-':>10} {got // MiB:>10,} MiB  {answers}", False
    same = got == reserved
    mark = ("same" if same else f"{got / reserved:.4f}") if judged else "(not judged)"
    line = (f"{program:24} {policy:16} {reserved // MiB:>10,} {got // MiB:>10,} MiB  "
            f"{answers}  {mark}")
    return line, judged and not same


def has_answers(trace):
    """Whether ``trace`` (gzip or plain CSV) records an answer to an event query: a run whose
    allocator asked none has nothing for ``--answers`` to give (the command refuses it)."""
    opener = gzip.open if trace.endswith(".gz") else open
    try:
        with opener(trace, "rt") as f:
            return any(line.startswith(("event_done,", "event_pending,")) for line in f)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error):
        return True  # unreadable: the replay says why


def replay_json(cudalloc, policy, trace):
    """The JSON row of ``cudalloc replay --answers`` of ``trace`` under ``policy``, None when the
    command failed (its message goes to stderr)."""
    p = subprocess.run([cudalloc, "replay", "--answers", "--json", "--policy", policy, trace],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode not in (0, 1):
        sys.stderr.write(p.stderr)
        return None
    return json.loads(p.stdout.splitlines()[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="run.py's results.json")
    ap.add_argument("--cudalloc", default="cudalloc", help="the cudalloc command")
    ap.add_argument("--traces", metavar="DIR", default=None,
                    help="the folder the traces are in now, if moved since run.py wrote them")
    args = ap.parse_args(argv)
    if args.traces is not None and not os.path.isdir(args.traces):
        ap.error(f"--traces {args.traces}: not a folder")
    with open(args.results) as f:
        runs = list(traced(json.load(f), args.traces))
    if not runs:
        ap.error(f"{args.results} has no traced run: run run.py with --trace DIR")
    print(f"{'program':24} {'policy':16} {'program':>10} {'replay':>10}")
    failed = False
    for program, policy, trace, reserved in runs:
        if os.path.exists(trace) and not has_answers(trace):
            print(f"{program:24} {policy:16} no event query recorded: not replayed")
            continue
        line, bad = row(program, policy, reserved, replay_json(args.cudalloc, policy, trace))
        print(line)
        failed |= bad
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
