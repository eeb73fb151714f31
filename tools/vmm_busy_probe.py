#!/usr/bin/env python3
"""Whether the driver calls of a growth and a give-back (`cuMemCreate`, `cuMemMap`,
`cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`) wait for work the GPU is running
(docs/expandable.md, "What the driver allows"): each call of one chunk timed on an idle GPU,
then while a sleep kernel of about 300 ms runs on the legacy default stream and on a side
stream. A call that waited for the kernel would take about its 300 ms and find it done. Needs
`libcuda` and PyTorch (for the sleep kernel); uses GPU 0's primary context, as PyTorch does.

    python3 tools/vmm_busy_probe.py [--sleep-ms 300] [--runs 3]
"""
import argparse
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
        row["kernel_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep-ms", type=float, default=300.0, help="the sleep kernel's length")
    ap.add_argument("--runs", type=int, default=3, help="runs of each (size, stream)")
    args = ap.parse_args()
    import torch

    torch.zeros(1, device="cuda")  # makes the primary context current on this thread
    torch.cuda.synchronize()
    page = vmm.init()
    # `clock_rate` is in kHz: cycles per millisecond.
    props = torch.cuda.get_device_properties(0)
    cycles_per_ms = getattr(props, "clock_rate", 0) or 1_980_000
    at = vmm.reserve(1 << 30)
    out = {"gpu": torch.cuda.get_device_name(0), "granularity_mib": page // MIB, "runs": []}
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
    print(f"{len(waited)} of {sum(1 for r in out['runs'] if r['stream'] != 'idle')} busy runs "
          "found the kernel done when their calls returned")


if __name__ == "__main__":
    main()
