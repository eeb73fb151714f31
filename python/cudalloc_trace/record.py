"""Record a program's CUDA allocations as a cudalloc trace.

Usage::

    python -m cudalloc_trace.record --out trace.csv.gz [--device N] [--max-entries N] \\
        -- script.py args...            # or: -- -m package.module args...

or, from Python::

    from cudalloc_trace.record import recording
    with recording("trace.csv.gz"):
        train()

The program runs under ``torch.cuda.memory._record_memory_history(enabled="all", context=None)``
(every allocator event, no stack traces, so recording stays cheap). When the program ends,
normally, through ``sys.exit`` or with an exception, ``torch.cuda.memory._snapshot()`` is taken,
recording is switched off and one device's ``device_traces`` is written in cudalloc's CSV format
(gzip'd when the name ends in ``.gz``), through the same conversion as
:mod:`cudalloc_trace.convert`.

PyTorch keeps at most ``max_entries`` events (a ring buffer): a longer run loses its oldest
events, and its trace then starts with frees of blocks it never saw allocated (readers count
those as anomalies). The default keeps everything.
"""

import argparse
import contextlib
import os
import runpy
import sys

from .convert import device_events, write_csv

DEFAULT_MAX_ENTRIES = sys.maxsize


@contextlib.contextmanager
def recording(out, device=0, max_entries=DEFAULT_MAX_ENTRIES):
    """Records every CUDA allocator event inside the block and writes the trace to ``out``."""
    import torch  # only needed here, so that the rest of the package works without torch

    out = os.path.abspath(out)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=max_entries)
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        n = write_csv(device_events(snapshot, device), out)
        print(f"cudalloc_trace: wrote {n} events to {out}", file=sys.stderr)


def run_target(target):
    """Runs ``target`` (``[script, args...]`` or ``["-m", module, args...]``) as ``__main__``."""
    if target[0] == "-m":
        if len(target) < 2:
            raise SystemExit("cudalloc_trace.record: -m needs a module name")
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = list(target)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def parse_args(argv):
    """Splits ``argv`` into the recorder's options and the program to run (after ``--``)."""
    if "--" in argv:
        split = argv.index("--")
        own, target = argv[:split], argv[split + 1 :]
    else:
        own, target = argv, []
    p = argparse.ArgumentParser(
        prog="python -m cudalloc_trace.record",
        usage="%(prog)s --out OUT [--device DEVICE] [--max-entries N] -- PROGRAM.py|-m MODULE [ARGS...]",
        description="Run a Python program and record its CUDA allocations as a cudalloc trace.",
        epilog="The program and its arguments follow `--`.",
    )
    p.add_argument("--out", required=True, help="output trace (.csv or .csv.gz)")
    p.add_argument("--device", type=int, default=0, help="device whose trace to write (default 0)")
    p.add_argument(
        "--max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="events PyTorch keeps (oldest dropped beyond this; default: all)",
    )
    args = p.parse_args(own)
    if not target:
        p.error("no program given: put it after `--`")
    args.target = target
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"cudalloc_trace.record needs PyTorch: {e}", file=sys.stderr)
        return 2
    with recording(args.out, args.device, args.max_entries):
        run_target(args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
