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
:mod:`cudalloc_trace.convert`; without ``--device``, the device is chosen as that module chooses
it (device 0 when it has events, else the only device that has). The output's folder is checked
before the program starts, so a wrong path fails at once rather than after the job; a trace that
cannot be written after the job (a full disk, a ``--device`` the snapshot has no trace of) is
reported in one line and the command exits with 1; if the program itself raised, its error goes
on as it would have, after that line.

PyTorch keeps at most ``max_entries`` events (a ring buffer): a longer run loses its oldest
events. The conversion then puts an allocation first for each block freed before the kept
history allocates it and for each block the snapshot holds that the history never mentions, so
the trace starts with the memory live at its first kept event (as ``cudalloc replay`` does for
a snapshot read directly); what happened in the lost stretch, its peak included, is not in it.
The default keeps everything.
"""

import argparse
import contextlib
import os
import runpy
import sys

from .convert import SnapshotError, device_events, skipped_note, write_csv

DEFAULT_MAX_ENTRIES = sys.maxsize


class RecordError(Exception):
    """The trace could not be written (the message says why and where)."""


def check_out(out):
    """Raises :class:`RecordError` unless ``out`` can be written: its folder exists and is
    writable (checked before the program runs, so a wrong path does not cost a whole job)."""
    if os.path.isdir(out):
        raise RecordError(f"{out}: is a folder; name the trace file to write")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise RecordError(f"{out}: there is no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise RecordError(f"{out}: the folder {folder} is not writable")


@contextlib.contextmanager
def recording(out, device=None, max_entries=DEFAULT_MAX_ENTRIES):
    """Records every CUDA allocator event inside the block and writes the trace to ``out``
    (``device``: the device whose events to write; ``None`` chooses as
    :func:`cudalloc_trace.convert.choose_device` does). Raises :class:`RecordError` before the
    block runs when ``out`` cannot be written, and after it when the trace could not be."""
    import torch  # only needed here, so that the rest of the package works without torch

    check_out(out)
    out = os.path.abspath(out)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=max_entries)
    failure = None
    try:
        yield
    except BaseException as e:
        failure = e
        raise
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        skipped = {}
        try:
            n = write_csv(device_events(snapshot, device, skipped), out)
        except (SnapshotError, OSError) as e:
            error = RecordError(f"{out}: the trace was not written: {e}")
            if failure is None or isinstance(failure, SystemExit):
                raise error from e
            # The program failed too: say why the trace is missing, and let its own error
            # (a traceback, KeyboardInterrupt) go on as it would have.
            print(f"cudalloc_trace: {error}", file=sys.stderr)
        else:
            print(f"cudalloc_trace: wrote {n} events to {out}{skipped_note(skipped)}", file=sys.stderr)


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
    p.add_argument(
        "--device",
        type=int,
        default=None,
        help="device whose trace to write (default: device 0 if it has events, else the only one that has)",
    )
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
    try:
        with recording(args.out, args.device, args.max_entries):
            run_target(args.target)
    except RecordError as e:
        print(f"cudalloc_trace.record: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
