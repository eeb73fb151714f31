"""What every review check shares (``review_checks.py``, ``pool_checks.py``, ``ipc_checks.py``):
the ``Skip`` exception a check raises when the machine or the torch version cannot run it, how
the checks are run (``RUN``), and small helpers."""

import gc

MiB = 1 << 20

# How review_checks.py runs the checks (set before the first): the config string, the library,
# the backend, whether on PyTorch's own allocator, and the directory of cudalloc_torch; for a
# check that starts processes of its own.
RUN = {"conf": "policy:default", "lib": None, "backend": "extension", "baseline": False,
       "python_dir": None}


class Skip(Exception):
    """The check cannot run here; the message says why."""


def line(e):
    """The first line of an exception's message (at most 300 characters)."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def cuda_torch():
    """torch, with CUDA initialised."""
    import torch

    torch.cuda.init()
    return torch


def settle(torch):
    """Collects garbage, waits for every device and empties the cache."""
    gc.collect()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    torch.cuda.empty_cache()
