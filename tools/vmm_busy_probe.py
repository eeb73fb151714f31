#!/usr/bin/env python3
"""Whether the VMM driver calls wait for a kernel the GPU is running.

The calls of a growth and a give-back (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
`cuMemUnmap`, `cuMemRelease`; docs/expandable.md, "What the driver allows") of one chunk, of one
granularity page and of 40 MiB, each timed on an idle GPU, then right after a sleep kernel of at
least `--sleep-ms` was queued on the legacy default stream, and on a side stream. A call that
waited for the kernel would take about that long and find it done. The sleep kernel touches no
memory: whether the calls slow a kernel that does is not measured here. Needs `libcuda` and
PyTorch (for the sleep kernel); uses GPU 0's primary context, as PyTorch does.

Prints one JSON object: the GPU, the driver version and one row per run, each call's
microseconds, `all_ms` (the five calls together) and, on a busy GPU, `kernel_still_running`
(when the last call returned) and `until_kernel_done_ms` (from the first call to the kernel's
end); then, on stderr, how many busy runs found the kernel done.

    python3 tools/vmm_busy_probe.py [--sleep-ms 300] [--runs 3]
"""
import argparse
import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vmm_probe as vmm  # noqa: E402

MIB = vmm.MIB


def busy_stream(torch, where):
    """The stream the sleep kernel runs on: the legacy default stream or a new side stream."""
    return torch.cuda.default_stream() if where == "default" else torch.cuda.Stream()


def one(torch, at, size, where, sleep_ms, cycles_per_ms):
    """The calls of one chunk of `size` bytes at `at`, in microseconds: on an idle GPU
    (`where` None), or while a sleep kernel runs on stream `where`; with, for the latter,
    whether the kernel was still running when the last call returned."""
    stream = busy_stream(torch, where) if where else None
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    start = time.perf_counter()
    calls = vmm.whole_costs(at, size)
    row = {k: round(v, 1) for k, v in calls.items()}
    row["all_ms"] = round((time.perf_counter() - start) * 1e3, 2)
    if stream is not None:
        done = torch.cuda.Event()
        done.record(stream)
        row["kernel_still_running"] = not done.query()
        stream.synchronize()
        row["until_kernel_done_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    return row


def main():
    ap = argparse.ArgumentParser(description="Whether VMM driver calls wait for a running kernel.")
    ap.add_argument("--sleep-ms", type=float, default=300.0, help="the sleep kernel's length")
    ap.add_argument("--runs", type=int, default=3, help="runs of each (size, stream)")
    args = ap.parse_args()
    import torch

    torch.zeros(1, device="cuda")  # makes the primary context current on this thread
    torch.cuda.synchronize()
    with contextlib.redirect_stdout(io.StringIO()) as said:  # the driver version line
        page = vmm.init()
    # `clock_rate` is in kHz: cycles per millisecond; the fallback is the H100's and H200's
    # highest clock, so that a slower clock only makes the kernel longer.
    props = torch.cuda.get_device_properties(0)
    cycles_per_ms = getattr(props, "clock_rate", 0) or 1_980_000
    at = vmm.reserve(1 << 30)
    out = {"gpu": torch.cuda.get_device_name(0), "driver": said.getvalue().strip(),
           "granularity_mib": page // MIB, "runs": []}
    for size in (page, 40 * MIB):
        one(torch, at, size, None, args.sleep_ms, cycles_per_ms)  # warm-up
        for _ in range(args.runs):
            for where in (None, "default", "side"):
                row = one(torch, at, size, where, args.sleep_ms, cycles_per_ms)
                row.update(size_mib=size // MIB, stream=where or "idle")
                out["runs"].append(row)
    vmm.free_ranges()
    print(json.dumps(out, indent=1))
    waited = [r for r in out["runs"] if r.get("kernel_still_running") is False]
    busy = sum(1 for r in out["runs"] if r["stream"] != "idle")
    print(f"{len(waited)} of {busy} busy runs found the kernel done when their calls returned",
          file=sys.stderr)


if __name__ == "__main__":
    main()
