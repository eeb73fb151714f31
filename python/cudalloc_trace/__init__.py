"""cudalloc_trace: get PyTorch allocation traces into cudalloc's trace format.

cudalloc's format is a (usually gzip'd) CSV with the header ``action,addr,size,stream,time_us``,
one trace event a line (``allocator/trace/src/csv.rs``; ``docs/cli.md``, *Trace formats*).

- :mod:`cudalloc_trace.record` runs a program under PyTorch's memory history recording and writes
  its trace at exit (``python -m cudalloc_trace.record --out t.csv.gz -- script.py args...``).
- :mod:`cudalloc_trace.convert` converts a snapshot pickle written by
  ``torch.cuda.memory._dump_snapshot()`` (``python -m cudalloc_trace.convert snap.pickle t.csv.gz``).

Both share the conversion in :mod:`cudalloc_trace.convert`, which needs no torch; importing
the package imports neither module (``record`` imports torch only when it starts recording).
"""

__all__ = ["convert", "record"]
