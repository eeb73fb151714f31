"""Builds and loads cudalloc's c10 allocator (``csrc/backend.cpp``), a small C++ extension that
makes cudalloc PyTorch's CUDA allocator in full: ``Tensor.record_stream`` reaches cudalloc, an
out-of-memory raises ``torch.OutOfMemoryError``, and ``torch.cuda.memory_stats``,
``max_memory_reserved``, ``reset_peak_memory_stats``, ``empty_cache``,
``set_per_process_memory_fraction`` and ``memory_snapshot`` are cudalloc's.

The extension is compiled against the installed torch with ``torch.utils.cpp_extension.load``
on first use (about 16 s with g++ and the CUDA headers) and cached by torch in
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under a name that carries the
torch version and a hash of the source (``csrc/backend.cpp`` and its headers), so later
processes load it at once.
"""

import ctypes
import hashlib
import os
import re

# torch versions (major.minor) the extension was built and tested against.
SUPPORTED_TORCH = ("2.11",)

# Library functions the extension calls (capi/include/cudalloc.h).
FUNCTIONS = (
    "cudalloc_malloc",
    "cudalloc_free",
    "cudalloc_record_stream",
    "cudalloc_empty_cache",
    "cudalloc_set_memory_fraction",
    "cudalloc_reset_peak_stats",
    "cudalloc_reset_accumulated_stats",
    "cudalloc_memory_fraction",
    "cudalloc_enable_peer_access",
    "cudalloc_device_stats",
    "cudalloc_stats_json",
    "cudalloc_last_error",
    "cudalloc_last_error_kind",
    "cudalloc_pool_acquire",
    "cudalloc_pool_release",
    "cudalloc_pool_use_count",
    "cudalloc_pool_malloc",
    "cudalloc_pool_blocks",
    "cudalloc_pool_allocate_at",
    "cudalloc_pool_empty_cache",
    "cudalloc_pool_set_use_on_oom",
    "cudalloc_memory_snapshot",
    "cudalloc_capture_begin",
    "cudalloc_capture_end",
    "cudalloc_history_start",
    "cudalloc_history_stop",
    "cudalloc_history_clear",
    "cudalloc_history_enabled",
    "cudalloc_memory_history",
    "cudalloc_share",
    "cudalloc_open_shared",
    "cudalloc_close_shared",
)

# What a program loses on the pluggable fallback, for the warning that announces it.
LOST_ON_FALLBACK = (
    "Tensor.record_stream does not reach cudalloc (memory used on a side stream may be reused "
    "too early), an out-of-memory aborts the process instead of raising "
    "torch.OutOfMemoryError, torch.cuda.memory_stats/max_memory_reserved/empty_cache/"
    "set_per_process_memory_fraction raise or do nothing (use cudalloc_torch's own functions), "
    "and CUDA tensors cannot be shared with other processes (torch.multiprocessing)"
)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "backend.cpp")
# The headers backend.cpp includes; with it, they make the extension's source.
HEADERS = ("library.h", "snapshot.h", "checkpoint.h", "routes.h", "observers.h", "ipc.h",
           "sharing.h")


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def torch_minor(version):
    """``"2.11"`` for ``"2.11.0+cu130"``; None if the version does not look like one."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def supported(torch):
    """True if this torch's major.minor is one the extension was tested against."""
    return torch_minor(torch.__version__) in SUPPORTED_TORCH


def source_hash():
    """A short hash of the extension's source files (backend.cpp and its headers)."""
    digest = hashlib.sha256()
    for path in [SOURCE] + [os.path.join(CSRC, h) for h in HEADERS]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def extension_name(torch):
    """The module name: it carries the torch version and the source's hash, so that each torch
    version and each version of the source (a header changed included) gets its own build."""
    tag = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    return f"cudalloc_backend_{tag}_{source_hash()}"


def build(torch, verbose=False):
    """Compiles (or loads the cached build of) the extension; raises :class:`BuildError` with
    the compiler's message on failure."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=extension_name(torch),
            sources=[SOURCE],
            extra_cflags=["-O2"],
            with_cuda=True,
            verbose=verbose,
        )
    except Exception as e:  # the compiler's output is in the message
        raise BuildError(f"building cudalloc's PyTorch extension failed: {e}") from e


def addresses(lib):
    """The address of each library function the extension calls, by name."""
    return {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in FUNCTIONS}


# The extension module whose allocator make_allocator made (None before).
_made = None


def make_allocator(torch, lib, verbose=False):
    """The allocator for ``torch.cuda.memory.change_current_allocator``: the extension's
    allocator over ``lib`` (the ctypes handle of the C library), wrapped as PyTorch wraps its
    own (``torch.cuda.memory._CUDAAllocator``)."""
    global _made
    module = build(torch, verbose)
    try:
        allocator = torch.cuda.memory._CUDAAllocator(module.make_allocator(addresses(lib)))
    except Exception as e:  # an older library without a function, an allocator torch refused
        raise BuildError(f"loading cudalloc's PyTorch extension failed: {e}") from e
    _made = module
    return allocator


def forget_shared():
    """Before ``cudalloc_sleep``: the extension closes the page descriptors it keeps for CUDA
    tensors shared with other processes, so that their pages can go (nothing without the
    extension)."""
    if _made is not None:
        _made.forget_shared()


def register_device_allocator():
    """Once ``change_current_allocator`` took :func:`make_allocator`'s allocator: makes it c10's
    CUDA allocator too, which ``torch.accelerator``'s memory functions (and code allocating
    through c10's table) read; PyTorch's ``change_current_allocator`` does not."""
    if _made is None:
        raise BuildError("register_device_allocator before make_allocator")
    _made.register_device_allocator()
