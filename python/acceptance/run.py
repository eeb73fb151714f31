#!/usr/bin/env python3
"""Runs the acceptance programs (``programs.py``) on PyTorch's allocator and on cudalloc, one
process per program and allocator, and prints a table: whether each ran to the end, its results
beside PyTorch's, peak reserved bytes (``torch.cuda.max_memory_reserved``) and wall time.

Modes: ``torch`` (PyTorch's caching allocator), ``torch-expandable``
(``expandable_segments:True``), ``cudalloc:POLICY`` (cudalloc through ``cudalloc_torch.enable``,
its backend chosen by ``--backend``: ``extension``, ``pluggable`` or ``auto``), or
``cudalloc:POLICY+KEY:VALUE+...`` (that policy with more ``CUDALLOC_CONF`` keys, such as
``cudalloc:default+thread_cache:False``).

Usage, from the repository root on a machine with a GPU (``libcudalloc_capi.so`` built by
``cargo build --release -p cudalloc-capi`` or given by ``--lib``/``CUDALLOC_LIB``)::

    python3 python/acceptance/run.py --out /tmp/acceptance
    python3 python/acceptance/run.py --quick --programs side_stream --modes torch,cudalloc:default

With ``--trace DIR`` each cudalloc run records device 0's trace, with the GPU's answers to the
allocator's event queries, to ``DIR/PROGRAM.POLICY.csv.gz``, and runs without thread caches, so
that ``cudalloc replay --answers --policy POLICY`` replays it as the program ran (the table's
peak reserved bytes are then those of that run). The file appears only when the program ran to
the end (it is written as ``PROGRAM.POLICY.part.csv.gz`` until then). Programs that record the
memory history (:data:`UNTRACED`: the library keeps a trace or a history, not both) run
untraced; ``--repeat`` above 1 is refused with it (each run's answers differ).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
RESULT_MARK = "@@RESULT@@ "
MODES = ["torch", "torch-expandable", "cudalloc:default", "cudalloc:torch", "cudalloc:torch-expandable"]


# Programs that record the memory history, which a running trace excludes.
UNTRACED = ("memory_history",)


def cudalloc_conf(mode, trace):
    """The ``CUDALLOC_CONF`` of a ``cudalloc:POLICY[+KEY:VALUE...]`` mode: without thread caches
    when traced (a block a thread cache hands out again never reaches the pool a replay
    drives)."""
    conf = "policy:" + mode.split(":", 1)[1].replace("+", ",")
    return conf + ",thread_cache:False" if trace else conf


def trace_path(trace_dir, program, mode):
    """Where ``--trace`` writes the trace of ``program`` run in the cudalloc mode ``mode``."""
    return os.path.join(trace_dir, f"{program}.{mode.split(':', 1)[1]}.csv.gz")


def partial(path):
    """Where the trace at ``path`` is written until its program ran to the end."""
    return path[: -len(".csv.gz")] + ".part.csv.gz"


def child(args):
    result = {"program": args.program, "mode": args.mode, "ok": False}
    if args.cpus:
        os.sched_setaffinity(0, cpu_list(args.cpus))
    t0 = time.perf_counter()
    try:
        if args.mode.startswith("cudalloc:"):
            sys.path.insert(0, PYTHON_DIR)
            import cudalloc_torch

            trace = args.trace if args.program not in UNTRACED else None
            cudalloc_torch.enable(lib_path=args.lib, conf=cudalloc_conf(args.mode, trace),
                                  backend=args.backend)
            result["backend"] = cudalloc_torch.backend()
            if trace:
                result["trace"] = trace_path(trace, args.program, args.mode)
                cudalloc_torch.trace_start(partial(result["trace"]))
        import torch

        sys.path.insert(0, HERE)
        from programs import PROGRAMS

        result.update(PROGRAMS[args.program](args.quick))
        torch.cuda.synchronize()
        if "trace" in result:
            cudalloc_torch.trace_stop()
            os.replace(partial(result["trace"]), result["trace"])
        result["ok"] = True
        try:
            # A program may say which of its runs the column shows (`train_near_cap`).
            result.setdefault("peak_reserved", torch.cuda.max_memory_reserved())
        except RuntimeError:  # PyTorch's pluggable path has no statistics
            result["peak_reserved"] = None
        try:
            cudalloc = cudalloc_torch if args.mode.startswith("cudalloc:") else None
            result.update(device_calls(cudalloc))
        except Exception as e:  # noqa: BLE001 - the program ran: the column says "-"
            print(f"the calls could not be read: {type(e).__name__}: {e}", file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def device_calls(cudalloc_torch):
    """The run's calls to the device's allocator, private pools (CUDA graphs, ``MemPool``)
    included: on cudalloc its driver calls (mallocs, frees, maps and unmaps: ``driver_calls``)
    and device waits, and the blocks its stream shards lent each other and the lends given up
    on a busy stream (``lent_blocks``, ``lends_refused_busy``: ``lend_blocks:True``); on
    PyTorch's allocator its ``cudaMalloc`` and ``cudaFree`` counts
    (``num_device_alloc``, ``num_device_free``; with expandable segments, its mapping and
    unmapping steps)."""
    import torch

    if cudalloc_torch is not None:
        s = cudalloc_torch.stats(torch.cuda.current_device())
        own, pools = s["driver_calls"], s["capi"]["private_pools"]
        return {"driver_calls": own["total"] + pools["driver_calls"],
                "device_waits": own["device_waits"] + pools["device_waits"],
                "lent_blocks": own.get("lent_blocks"),
                "lends_refused_busy": own.get("lends_refused_busy")}
    s = torch.cuda.memory_stats()
    return {"num_device_alloc": s.get("num_device_alloc"),
            "num_device_free": s.get("num_device_free")}


def calls_cell(r, ref):
    """A run's calls to the device: cudalloc's driver calls over PyTorch's ``cudaMalloc`` count
    in the reference run (the budget of issue 32 is 3x), PyTorch's ``cudaMalloc`` and
    ``cudaFree`` counts."""
    if r.get("driver_calls") is not None:
        mallocs = (ref or {}).get("num_device_alloc")
        ratio = f" ({r['driver_calls'] / mallocs:.1f}x)" if mallocs else ""
        return f"{r['driver_calls']:,}{ratio}"
    if r.get("num_device_alloc") is not None:
        return f"{r['num_device_alloc']:,}+{r.get('num_device_free') or 0:,}"
    return "-"


def cpu_list(text):
    """The CPUs of a list like ``2,3`` or ``4-7``; a ValueError names a bad item."""
    cpus = set()
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad CPU list item {item!r} in {text!r}: N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list item {item!r} in {text!r}: N or N-M, N <= M")
        cpus.update(range(first, last + 1))
    return cpus


def run_child(args, program, mode, log):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--program", program,
           "--mode", mode, "--backend", args.backend]
    if args.lib:
        cmd += ["--lib", args.lib]
    if args.quick:
        cmd.append("--quick")
    if args.cpus:
        cmd += ["--cpus", args.cpus]
    if args.trace:
        cmd += ["--trace", args.trace]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "CUDALLOC_CONF")}
    if mode == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=args.timeout)
        output, code = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        output, code = e.stdout if isinstance(e.stdout, str) else "", "timeout"
    log.write(f"===== {program} {mode}: exit {code} after {time.perf_counter() - t0:.1f} s\n{output}\n")
    log.flush()
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = " | ".join(output.splitlines()[-3:])
    return {"program": program, "mode": mode, "ok": False, "error": f"exit {code}: {tail}"}


# Results that must equal the reference's exactly: token ids (a near id is another token) and
# the steps a loss scaler skipped (an overflow the allocator caused shows there, not in losses).
EXACT_KEYS = ("tokens", "skipped_steps")


def compare(result, ref):
    """How a run's results compare with PyTorch's allocator's run of the same program."""
    if not result.get("ok"):
        return "FAILED: " + result.get("error", "?")[:120]
    if result is ref:
        return "ref"
    if ref is None or not ref.get("ok"):
        return "no ref"
    for k in EXACT_KEYS:
        if k in result and result[k] != ref.get(k):
            return f"DIFFERENT {k} ({result[k]!r:.60} against the reference's {ref.get(k)!r:.60})"
    keys = [k for k in ("fitted", "largest_batch", "went_on", "checks", "overwritten",
                        "max_abs_diff", "max_rel_diff", "uses", "reused_in_pool", "grew_after_warmup_mib",
                        "restores", "restores_that_changed_the_pool", "differing_runs",
                        "live_peak_mib", "given_back_mib", "steps_1.10x", "steps_1.03x", "syncs_1.10x",
                        "syncs_1.03x", "step_ms_1.03x", "skipped_steps",
                        "differing_from_alone", "capped_reserved_mib", "cap_mib", "ooms")
            if k in result]
    figures = ", ".join(f"{k}={result[k]}" for k in keys)
    # Outputs that changed from run to run more often than on PyTorch's allocator could be an
    # allocator fault that the most common output hides: a difference, to be judged by repeats
    # (PyTorch's own kernels are not always deterministic there).
    extra, base = result.get("differing_runs", 0), ref.get("differing_runs", 0)
    if extra > base:
        return f"DIFFERENT runs ({extra} against the reference's {base}), {figures}"
    if "losses" not in result:
        return figures or "-"
    return ", ".join(v for v in (losses_verdict(result["losses"], ref.get("losses", [])),
                                 figures) if v)


def losses_verdict(a, b):
    """How a run's losses (or other numeric results) compare with the reference's."""
    if len(a) != len(b) or not a:
        return f"DIFFERENT ({len(a)} results against {len(b)})"
    if a == b:
        return "bit-identical"
    worst = max_rel_diff(a, b)
    return f"{'close' if worst < 1e-3 else 'DIFFERENT'} (max rel diff {worst:.2e})"


def max_rel_diff(a, b):
    """The largest relative difference between two lists of numbers of the same length."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def step_time(r, ref):
    """A run's step time (``step_ms``: a training step, or a generated token) beside PyTorch's."""
    ms, base = r.get("step_ms"), (ref or {}).get("step_ms")
    if ms is None:
        return "-"
    if r is ref or not base:
        return f"{ms:.2f}"
    return f"{ms:.2f} ({100 * (ms / base - 1):+.1f}%)"


def table(results, programs, modes):
    lines = [f"{'program':18} {'mode':26} {'peak reserved':>14} {'calls':>13} {'wall s':>7} "
             f"{'step ms':>16}  result"]
    for program in programs:
        ref = results.get((program, "torch"))
        for mode in modes:
            r = results[(program, mode)]
            peak = r.get("peak_reserved")
            peak = f"{peak / (1 << 20):,.0f} MiB" if peak is not None else "-"
            label = mode + (f" ({r['backend']})" if r.get("backend") else "")
            lines.append(f"{program:18} {label:26} {peak:>14} {calls_cell(r, ref):>13} "
                         f"{r.get('wall_s', 0):>7} {step_time(r, ref):>16}  {compare(r, ref)}")
    lines += memory_summary(results, programs, modes)
    lines += calls_summary(results, programs, modes)
    return "\n".join(lines)


def calls_summary(results, programs, modes):
    """Per cudalloc mode: on how many programs its driver calls were within 3x the ``cudaMalloc``
    count of PyTorch's run (programs where both ran and counted)."""
    out = []
    for mode in modes:
        pairs = [(results[(p, mode)].get("driver_calls"),
                  (results.get((p, "torch")) or {}).get("num_device_alloc")) for p in programs]
        pairs = [(c, m) for c, m in pairs if c is not None and m]
        if pairs:
            within = sum(c <= 3 * m for c, m in pairs)
            out.append(f"{mode}: driver calls within 3x PyTorch's cudaMallocs on {within} of "
                       f"{len(pairs)} programs")
    return out


def memory_summary(results, programs, modes):
    """Per mode: the geometric mean of its peak reserved bytes over PyTorch's (programs where
    both ran), and on how many programs it reserved at most PyTorch's expandable segments."""
    out = []
    for mode in modes:
        ratios, within = [], []
        for program in programs:
            r, ref = results[(program, mode)], results.get((program, "torch"))
            exp = results.get((program, "torch-expandable"))
            peak = r.get("peak_reserved") if r.get("ok") else None
            if peak and ref and ref.get("ok") and ref.get("peak_reserved"):
                ratios.append(peak / ref["peak_reserved"])
            if peak and exp and exp.get("ok") and exp.get("peak_reserved"):
                within.append(peak <= exp["peak_reserved"])
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            out.append(f"{mode}: peak reserved / PyTorch's, geometric mean {geo:.3f} over "
                       f"{len(ratios)} programs; at most PyTorch's expandable on "
                       f"{sum(within)} of {len(within)}")
    return out


def prebuild(args):
    """Builds cudalloc's extension once, before the runs, so that no run's time includes it."""
    if args.backend == "pluggable" or not any(m.startswith("cudalloc:") for m in args.modes):
        return None
    code = ("import sys, time, torch; sys.path.insert(0, %r); from cudalloc_torch import _backend; "
            "t = time.perf_counter(); _backend.build(torch, verbose=True); "
            "print('extension built or loaded in %%.1f s' %% (time.perf_counter() - t))" % PYTHON_DIR)
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(p.stdout.splitlines()[-1] if p.returncode == 0 else p.stdout[-3000:], flush=True)
    return p.returncode


def parent(args):
    os.makedirs(args.out, exist_ok=True)
    prebuild(args)
    results = {}
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        for rep in range(args.repeat):
            for program in args.programs:
                # Each repeat starts the modes from another one, so that no mode is always
                # first (the first process of a row runs slower on some machines).
                shift = rep % len(args.modes)
                for mode in args.modes[shift:] + args.modes[:shift]:
                    r = run_child(args, program, mode, log)
                    results[(program, mode)] = merge(results.get((program, mode)), r)
                    print(f"{program} {mode}: {'ok' if r.get('ok') else r.get('error')}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump([r for r in results.values()], f, indent=1)
    print(table(results, args.programs, args.modes))
    return 0 if passed(results, args.programs, args.modes) else 1


# The results a repeat must give again (timings and memory figures may differ). `max_abs_diff`
# is not among them: the programs that report it fail a run whose difference exceeds their own
# bound, and the merged result keeps the largest over the repeats.
RESULT_KEYS = ("losses", "checks", "overwritten", "fitted", "largest_batch", "went_on", "uses",
               "reused_in_pool", "restores", "restores_that_changed_the_pool", "skipped_steps",
               "tokens")


def merge(kept, new):
    """A (program, mode)'s result over repeats: the first run's results (a failed run replaces
    them, and so does a run whose results differ from the first's: the pair failed), every
    run's ``step_ms`` in ``step_ms_runs`` and their median as ``step_ms``, and the runs that
    gave another output than their own most common one (``differing_runs``) added up over the
    repeats, for the mode and for PyTorch's allocator alike. A repeat whose losses are close to
    the first's (``same_result``) keeps the first's, and the largest relative difference seen is
    ``repeat_rel_diff`` (absent while every repeat gave the same losses); ``max_abs_diff`` is the
    largest over the repeats."""
    differs = [k for k in RESULT_KEYS if kept and kept.get("ok") and new.get("ok")
               and not same_result(k, new.get(k), kept.get(k))]
    if kept is None:
        merged = dict(new)
    elif differs:
        merged = dict(new, ok=False, error=f"a repeat gave other results: {', '.join(differs)}",
                      step_ms_runs=kept.get("step_ms_runs", []))
    elif not new.get("ok"):
        merged = dict(new, step_ms_runs=kept.get("step_ms_runs", []))
    else:
        merged = kept
    if kept is not None and merged is kept and kept.get("ok") and new.get("ok"):
        if "differing_runs" in new:
            merged["differing_runs"] = kept.get("differing_runs", 0) + new["differing_runs"]
        if "max_abs_diff" in new:
            merged["max_abs_diff"] = max(kept.get("max_abs_diff", 0.0), new["max_abs_diff"])
        if new.get("losses") and new["losses"] != kept.get("losses"):
            drift = max_rel_diff(new["losses"], kept["losses"])
            merged["repeat_rel_diff"] = max(kept.get("repeat_rel_diff", 0.0), drift)
    runs = (kept or {}).get("step_ms_runs", []) + ([new["step_ms"]] if "step_ms" in new else [])
    if runs:
        merged["step_ms_runs"] = runs
        merged["step_ms"] = statistics.median(runs)
    return merged


def same_result(key, a, b):
    """Whether a repeat gave result ``key`` again: losses within the tolerance a run is held to
    against PyTorch's allocator (``losses_verdict``: PyTorch's own kernels are not always
    deterministic, so two runs under one allocator may differ in the last digits), every other
    result exactly."""
    if a == b:
        return True
    if key == "losses" and isinstance(a, list) and isinstance(b, list):
        return not losses_verdict(a, b).startswith("DIFFERENT")
    return False


def passed(results, programs, modes):
    """True when every run finished and none differs from PyTorch's allocator's run."""
    for program in programs:
        ref = results.get((program, "torch"))
        for mode in modes:
            verdict = compare(results[(program, mode)], ref)
            if verdict.startswith(("FAILED", "DIFFERENT")):
                return False
    return True


def main():
    from programs import PROGRAMS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/cudalloc-acceptance")
    ap.add_argument("--programs", type=lambda s: s.split(","), default=list(PROGRAMS))
    ap.add_argument("--modes", type=lambda s: s.split(","), default=MODES)
    ap.add_argument("--backend", default="extension", choices=["auto", "extension", "pluggable"])
    ap.add_argument("--lib", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every program and mode this many times, the modes' order rotated; "
                         "step times are the median over the runs")
    ap.add_argument("--cpus", default=None,
                    help="pin every program to these CPUs (e.g. 2,3 or 4-7), so that step times "
                         "move less from one process to the next")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="record each cudalloc run's trace, with the GPU's answers to event "
                         "queries, into DIR (runs without thread caches; see the module doc)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--program", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, not {args.repeat}")
    if args.trace:
        if args.repeat > 1:
            ap.error("--trace records one run of each program: --repeat must be 1")
        if not any(m.startswith("cudalloc:") for m in args.modes):
            ap.error("--trace records cudalloc runs: no cudalloc:POLICY mode is asked for")
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            ap.error(f"--trace {args.trace}: {e}")
        args.trace = os.path.abspath(args.trace)
    if args.cpus:
        try:
            cpu_list(args.cpus)
        except ValueError as e:
            ap.error(str(e))
    for p in args.programs:
        if p not in PROGRAMS:
            ap.error(f"unknown program {p!r}: one of {', '.join(PROGRAMS)}")
    for m in args.modes:
        if m not in ("torch", "torch-expandable") and not (m.startswith("cudalloc:") and m[9:]):
            ap.error(f"unknown mode {m!r}: torch, torch-expandable or cudalloc:POLICY[+KEY:VALUE]")
    return parent(args)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
