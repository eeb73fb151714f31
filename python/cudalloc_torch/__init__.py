"""cudalloc_torch: run PyTorch on cudalloc (``libcudalloc_capi.so``) instead of its caching allocator.

Three lines, before the program initialises CUDA in torch (a tensor on a GPU,
``torch.cuda.set_device`` ...)::

    import cudalloc_torch
    cudalloc_torch.enable(conf="policy:default")   # or "policy:torch-expandable", ...
    # ... the program, unchanged

:func:`enable` makes the library PyTorch's CUDA allocator
(``torch.cuda.memory.change_current_allocator``), through cudalloc's c10 allocator (a small C++
extension built against the installed torch on first use, ``_backend.py``) or, where that cannot
be built, PyTorch's ``CUDAPluggableAllocator`` with a warning naming what that path loses. On the
extension ``Tensor.record_stream`` reaches cudalloc, an out-of-memory raises
``torch.OutOfMemoryError`` and ``torch.cuda.memory_stats`` and friends are cudalloc's; on either
path :func:`memory_stats`, :func:`empty_cache` and the others here work.

The library is ``$CUDALLOC_LIB`` if set, else the one installed with this package
(``pip install .`` from the repository root), else ``target/release/libcudalloc_capi.so`` in this
repository (``cargo build --release -p cudalloc-capi``). See ``docs/pytorch.md``.

Tags, sleep and wake: tensors allocated inside ``with cudalloc_torch.tag("weights"):`` belong
to tag "weights" (the tag is the calling thread's, kept by the library: the allocation must
happen on that thread, as PyTorch's allocations do); :func:`sleep` gives a tag's device memory
back while its tensors keep their addresses, copying the bytes of the tags in ``offload`` to
pinned host memory, and :func:`wake` brings them back. :func:`tag_stats` reports each tag. See
``docs/sleep.md``.

Only :func:`enable` imports torch; the other functions talk to the library through ctypes.
"""

import atexit
import collections
import contextlib
import ctypes
import json
import os
import threading

__all__ = [
    "enable",
    "backend",
    "is_enabled",
    "library_path",
    "load",
    "device_count",
    "current_device",
    "memory_stats",
    "stats",
    "snapshot",
    "empty_cache",
    "reset_peak_memory_stats",
    "set_memory_fraction",
    "record_stream",
    "trace_start",
    "trace_stop",
    "last_error",
    "tag",
    "current_tag",
    "sleep",
    "wake",
    "tag_stats",
    "release_host_buffers",
    "CudallocError",
    "OutOfMemoryError",
    "SleepIncompleteError",
]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LIB = os.path.join(_REPO, "target", "release", "libcudalloc_capi.so")

# cudalloc_set_malloc_failure_action values (capi/include/cudalloc.h).
_ON_FAILURE = {"null": 0, "warn": 1, "abort": 2}

_lock = threading.Lock()
_lib = None
_lib_path = None
_allocator = None  # the allocator given to PyTorch, kept alive for the life of the process
_backend_name = None  # "extension" or "pluggable" once enable() has run
_atexit_registered = False
# CUDALLOC_CONF as it was when the library first read it (it reads it once per process, at the
# first call that touches a device); _UNREAD until then.
_UNREAD = object()
_conf_read = _UNREAD


class CudallocError(RuntimeError):
    """A cudalloc call failed; the message is the library's last error."""


class OutOfMemoryError(CudallocError):
    """:func:`wake` found no room for a tag: it stays asleep and intact; wake it again once
    memory was freed."""


class SleepIncompleteError(CudallocError):
    """:func:`sleep` unmapped some of a tag's pages but not all (the driver refused an unmap, or
    a wait for the copies of later pages failed): the tag sleeps all the same (a :func:`wake`
    restores it), with those pages still mapped; calling :func:`sleep` again retries them."""


# cudalloc_last_error_kind values (capi/include/cudalloc.h).
_KIND_OUT_OF_MEMORY = 2
_KIND_SLEEP_INCOMPLETE = 3


def library_path(lib_path=None):
    """The library :func:`enable` and :func:`load` use: ``lib_path``, ``$CUDALLOC_LIB``, the
    library installed with this package, or ``target/release/libcudalloc_capi.so`` in this
    repository, as an absolute path."""
    return os.path.abspath(lib_path or os.environ.get("CUDALLOC_LIB") or installed_library() or DEFAULT_LIB)


def installed_library():
    """The library ``pip install`` put beside this module (``libcudalloc_capi.<suffix>.so``), or
    None when the package runs from the repository."""
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "libcudalloc_capi*.so")))
    return found[0] if found else None


def _declare(lib):
    c_int, c_size_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    buf = ctypes.POINTER(ctypes.c_char)
    signatures = {
        "cudalloc_check": ([], c_int),
        "cudalloc_malloc": ([c_size_t, c_int, c_void_p], c_void_p),
        "cudalloc_free": ([c_void_p, c_size_t, c_int, c_void_p], None),
        "cudalloc_empty_cache": ([c_int], c_int),
        "cudalloc_record_stream": ([c_void_p, c_int, c_void_p], c_int),
        "cudalloc_set_memory_fraction": ([ctypes.c_double, c_int], c_int),
        "cudalloc_reset_peak_stats": ([c_int], c_int),
        "cudalloc_set_malloc_failure_action": ([c_int], c_int),
        "cudalloc_stats_json": ([c_int, buf, c_size_t], c_size_t),
        "cudalloc_device_stats": ([c_int, buf, c_size_t], c_size_t),
        "cudalloc_last_error_kind": ([], c_int),
        "cudalloc_snapshot_json": ([c_int, buf, c_size_t], c_size_t),
        "cudalloc_trace_start": ([c_char_p], c_int),
        "cudalloc_trace_stop": ([], c_int),
        "cudalloc_last_error": ([], c_char_p),
        "cudalloc_tag_push": ([c_char_p], c_int),
        "cudalloc_tag_pop": ([], c_int),
        "cudalloc_tag_depth": ([], c_int),
        "cudalloc_tag_current": ([buf, c_size_t], c_size_t),
        "cudalloc_sleep": ([c_int, c_char_p, c_char_p], c_int),
        "cudalloc_wake": ([c_int, c_char_p, c_void_p], c_int),
        "cudalloc_release_host_buffers": ([c_int], c_int),
        "cudalloc_tag_stats_json": ([c_int, buf, c_size_t], c_size_t),
    }
    for name, (args, res) in signatures.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = res


def load(lib_path=None):
    """Loads the library through ctypes (once; later calls return the same handle). PyTorch's
    ``CUDAPluggableAllocator`` opens the same file, and the dynamic loader gives both the same
    copy, so these functions see the allocators PyTorch uses."""
    global _lib, _lib_path
    with _lock:
        path = library_path(lib_path)
        if _lib is not None:
            if lib_path is not None and path != _lib_path:
                raise CudallocError(f"cudalloc is already loaded from {_lib_path}, not {path}")
            return _lib
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} does not exist: build it with `cargo build --release -p cudalloc-capi` "
                "or point CUDALLOC_LIB at it"
            )
        lib = ctypes.CDLL(path)
        _declare(lib)
        _lib, _lib_path = lib, path
        return lib


def _device_lib():
    """The library, for a call that makes it read ``CUDALLOC_CONF`` if it has not yet."""
    global _conf_read
    lib = load()
    with _lock:
        if _conf_read is _UNREAD:
            _conf_read = os.environ.get("CUDALLOC_CONF")
    return lib


def last_error():
    """The calling thread's last cudalloc error message ("" if none)."""
    return load().cudalloc_last_error().decode("utf-8", "replace")


def _check(result):
    if result < 0:
        raise CudallocError(last_error())
    return result


def device_count():
    """Reads CUDALLOC_CONF and counts the devices the way the allocator will (no device is
    opened); raises :class:`CudallocError` for a bad config or no driver/GPU."""
    return _check(_device_lib().cudalloc_check())


def is_enabled():
    """True once :func:`enable` has made cudalloc PyTorch's allocator in this process."""
    return _allocator is not None


def enable(lib_path=None, conf=None, on_malloc_failure="abort", backend=None):
    """Makes cudalloc PyTorch's CUDA allocator; call it before anything initialises CUDA in torch
    (a tensor on a GPU, ``torch.cuda.set_device``, ``torch.cuda.current_device`` ...): PyTorch
    refuses to swap an allocator once CUDA is initialised.

    ``conf`` (optional) becomes ``CUDALLOC_CONF``, e.g. ``"policy:torch-expandable"``; it is read
    once, here.

    ``backend`` (default: ``$CUDALLOC_TORCH_BACKEND``, else ``"auto"``) is how cudalloc plugs in:

    - ``"extension"``: cudalloc's c10 allocator, a small C++ extension built against the
      installed torch on first use (``_backend.py``). ``Tensor.record_stream`` reaches cudalloc,
      an out-of-memory raises ``torch.OutOfMemoryError`` (nothing aborts), and
      ``torch.cuda.memory_stats``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
      ``empty_cache`` and ``set_per_process_memory_fraction`` are cudalloc's. A failed build
      raises :class:`CudallocError` with the compiler's message.
    - ``"pluggable"``: PyTorch's ``CUDAPluggableAllocator`` over the library's
      ``cudalloc_malloc``/``cudalloc_free`` only (no compiler needed). It loses what the
      extension adds (see ``_backend.LOST_ON_FALLBACK``); ``on_malloc_failure`` says what a failed
      allocation does there: ``"abort"`` (print the reason and abort: the pluggable allocator
      does not check for NULL, so the alternative is a tensor at address 0 and an "illegal
      memory access" later), ``"warn"`` (print it, return NULL) or ``"null"``.
    - ``"auto"``: the extension on a torch version it was tested with
      (``_backend.SUPPORTED_TORCH``), else, or if it cannot be built, the pluggable fallback
      with a warning that names what is lost.

    Returns the allocator given to ``torch.cuda.memory.change_current_allocator``. Calling it
    again with the same library and config returns it (and sets ``on_malloc_failure`` on the
    pluggable backend).

    The library reads its config once per process, at the first call that touches a device
    (this one, or an earlier :func:`device_count`, :func:`stats` ...): a ``conf`` other than the
    one read then raises :class:`CudallocError`, since it could not take effect.
    """
    global _allocator, _backend_name
    if on_malloc_failure not in _ON_FAILURE:
        raise ValueError(f"on_malloc_failure must be one of {sorted(_ON_FAILURE)}")
    backend = backend or os.environ.get("CUDALLOC_TORCH_BACKEND") or "auto"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)}, not {backend!r}")
    if conf is not None:
        if _conf_read is not _UNREAD and _conf_read != conf:
            raise CudallocError(
                f"cudalloc already read its config in this process (CUDALLOC_CONF={_conf_read!r}); "
                f"{conf!r} would not take effect: pass conf to the first cudalloc_torch call, "
                "enable(), in a new process"
            )
        os.environ["CUDALLOC_CONF"] = conf
    lib = load(lib_path)
    if _allocator is not None:
        if _backend_name == "pluggable":
            _check(lib.cudalloc_set_malloc_failure_action(_ON_FAILURE[on_malloc_failure]))
        return _allocator
    device_count()  # a bad config or a missing GPU fails here, not at the first tensor
    try:
        import torch
    except ImportError as e:
        raise CudallocError(f"cudalloc_torch.enable needs PyTorch ({e})") from e
    if torch.cuda.is_initialized():
        raise CudallocError(_ALREADY_INITIALISED)

    chosen, allocator = _make_allocator(torch, lib, backend)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise CudallocError(f"{_ALREADY_INITIALISED} ({e})") from e
    if chosen == "extension":
        _register_device_allocator()
    # The extension raises on failure itself, so the library only returns NULL there.
    action = _ON_FAILURE[on_malloc_failure] if chosen == "pluggable" else _ON_FAILURE["null"]
    _check(lib.cudalloc_set_malloc_failure_action(action))
    _allocator, _backend_name = allocator, chosen
    return allocator


def backend():
    """``"extension"`` or ``"pluggable"``: how :func:`enable` plugged cudalloc in (None before)."""
    return _backend_name


_BACKENDS = ("auto", "extension", "pluggable")

_ALREADY_INITIALISED = (
    "PyTorch's CUDA allocator is already initialised: call cudalloc_torch.enable() before "
    "anything initialises CUDA in torch (a tensor on a GPU, torch.cuda.set_device, "
    "torch.cuda.current_device, ...)"
)


def _register_device_allocator():
    """Makes the extension's allocator c10's CUDA allocator too (``torch.accelerator``); a
    failure is a warning, since the allocator is in use already."""
    import warnings

    from . import _backend

    try:
        _backend.register_device_allocator()
    except Exception as e:  # an extension built before the function existed, say
        warnings.warn(
            f"cudalloc: torch.accelerator's memory functions will read PyTorch's unused "
            f"allocator, not cudalloc ({e}); torch.cuda's read cudalloc",
            stacklevel=3,
        )


def _make_allocator(torch, lib, backend):
    """``(backend chosen, allocator)`` for ``backend`` (see :func:`enable`)."""
    from . import _backend

    if backend == "auto" and not _backend.supported(torch):
        _warn_fallback(
            f"torch {torch.__version__} is not a version cudalloc's extension was tested with "
            f"({', '.join(_backend.SUPPORTED_TORCH)}; CUDALLOC_TORCH_BACKEND=extension tries it "
            "anyway)"
        )
        backend = "pluggable"
    if backend != "pluggable":
        try:
            return "extension", _backend.make_allocator(torch, lib)
        except _backend.BuildError as e:
            if backend == "extension":
                raise CudallocError(str(e)) from e
            _warn_fallback(str(e))
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "cudalloc_malloc", "cudalloc_free")
    return "pluggable", allocator


def _warn_fallback(why):
    import warnings

    from . import _backend

    warnings.warn(
        f"cudalloc_torch: using PyTorch's pluggable allocator path: {why}. On it, "
        f"{_backend.LOST_ON_FALLBACK}.",
        RuntimeWarning,
        stacklevel=3,
    )


def _json(fn, device):
    lib = load()
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        need = fn(device, buf, size)
        if need == 0:
            raise CudallocError(last_error())
        if need < size:
            return json.loads(buf.raw[:need].decode("utf-8"))
        size = need + 1 + need // 4  # it may grow before the retry


def current_device(device=None):
    """The device index ``torch.cuda``'s memory functions would use for ``device``: an int as
    it is; ``"cuda:N"`` or ``torch.device("cuda", N)`` as N; ``None``, ``"cuda"`` or
    ``torch.device("cuda")`` as PyTorch's current device: ``torch.cuda.current_device()`` once
    torch has initialised CUDA (after ``torch.cuda.set_device(local_rank)``, each rank of a
    distributed job its own), else 0. Never initialises CUDA itself, so it may be called before
    :func:`enable`. Anything else raises ``ValueError``."""
    if isinstance(device, bool):
        raise ValueError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        return device
    if device is not None:
        kind, index = _cuda_device(device)
        if kind != "cuda":
            raise ValueError(f"not a CUDA device: {device!r}")
        if index is not None:
            return index
    import sys

    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return cuda.current_device()
    return 0


def _cuda_device(device):
    """``(type, index or None)`` of a ``torch.device`` or of a string such as ``"cuda:1"``."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if not index:
            return kind, None
        if not index.isdigit():
            raise ValueError(f"not a CUDA device: {device!r}")
        return kind, int(index)
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if not isinstance(kind, str) or not (index is None or isinstance(index, int)):
        raise ValueError(f"not a CUDA device: {device!r}")
    return kind, index


def stats(device=None):
    """Everything ``cudalloc_stats_json`` reports for ``device`` (default: the current device,
    :func:`current_device`): the ``torch.cuda.memory_stats()`` keys plus ``policy``,
    ``fragmentation``, ``driver_calls``, ``excess`` (where the reserved bytes are now),
    ``thread_cache`` and ``capi``."""
    return _json(_device_lib().cudalloc_stats_json, current_device(device))


def memory_stats(device=None):
    """``torch.cuda.memory_stats()`` for cudalloc: the same keys, sorted, as an OrderedDict
    (default: the current device)."""
    s = stats(device)
    torch_keys = {k: v for k, v in s.items() if isinstance(v, int) and not isinstance(v, bool)}
    return collections.OrderedDict(sorted(torch_keys.items()))


def snapshot(device=None):
    """Segments and blocks of ``device`` (default: the current device; ``cudalloc_snapshot_json``)."""
    return _json(_device_lib().cudalloc_snapshot_json, current_device(device))


def empty_cache(device=None):
    """Releases cached, unused memory of ``device`` to the driver; ``None`` (the default):
    every device, as ``torch.cuda.empty_cache()`` does. A device is read as the other functions
    read it (:func:`current_device`: an int, ``"cuda:N"``, ``torch.device``)."""
    lib = _device_lib()
    devices = range(device_count()) if device is None else [current_device(device)]
    for d in devices:
        _check(lib.cudalloc_empty_cache(d))


def reset_peak_memory_stats(device=None):
    """Resets the peak statistics of ``device`` (default: the current device) to their current
    values."""
    _check(_device_lib().cudalloc_reset_peak_stats(current_device(device)))


def set_memory_fraction(fraction, device=None):
    """Caps ``device``'s allocator (default: the current device's) at ``fraction`` of the
    device's memory."""
    _check(_device_lib().cudalloc_set_memory_fraction(float(fraction), current_device(device)))


def record_stream(tensor, stream):
    """``tensor.record_stream(stream)`` for cudalloc. PyTorch's pluggable allocator ignores
    ``Tensor.record_stream``; call this instead when a tensor is used on a side stream."""
    if stream.device != tensor.device:
        # The event marking the stream's use is recorded on the tensor's device; a stream of
        # another device could not take it, and every free of the tensor would then fail.
        raise CudallocError(
            f"record_stream: the stream is on {stream.device}, the tensor on {tensor.device}")
    ptr = tensor.untyped_storage().data_ptr()
    _check(_device_lib().cudalloc_record_stream(ptr, tensor.device.index, stream.cuda_stream))


def trace_start(path):
    """Starts recording device 0's allocations to ``path`` (cudalloc's trace format, gzip'd if
    it ends in ``.gz``) for ``cudalloc replay``, with the GPU's answers to the allocator's event
    queries (``cudalloc replay --answers`` gives them again; run with ``thread_cache:False`` for
    a replay of the same operations). The trace is closed by :func:`trace_stop`, or at
    interpreter exit."""
    global _atexit_registered
    lib = load()
    _check(lib.cudalloc_trace_start(os.fsencode(os.path.abspath(path))))
    with _lock:
        if not _atexit_registered:
            atexit.register(_stop_at_exit)
            _atexit_registered = True


def trace_stop():
    """Stops the trace and closes its file."""
    _check(load().cudalloc_trace_stop())


def _stop_at_exit():
    lib = load()
    if lib.cudalloc_trace_stop() < 0:
        msg = last_error()
        if "no trace is being recorded" not in msg:
            import sys

            print(f"cudalloc_torch: {msg}", file=sys.stderr)


_MAX_TAG_BYTES = 255


def _tag_name(name):
    """``name`` as the library takes it (UTF-8 bytes); a tag that is not a non-empty ``str`` of
    at most 255 bytes of UTF-8 without a comma or a control character raises ``ValueError`` (a
    comma would split it in a list; a NUL would cut it short on its way to the library)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tag is a non-empty str, not {name!r}")
    if "," in name:
        raise ValueError(f"tag {name!r}: a tag has no comma (commas separate the tags of a list)")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name):
        raise ValueError(f"tag {name!r}: a tag has no control character")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"tag {name!r} is not valid UTF-8 (a lone surrogate)") from None
    if len(encoded) > _MAX_TAG_BYTES:
        raise ValueError(f"tag {name[:20]!r}...: a tag is at most 255 bytes of UTF-8, not {len(encoded)}")
    return encoded


def _tag_list(tags, what):
    """The comma-separated list the library takes for ``tags``: one tag (a str) or an iterable
    of them."""
    if isinstance(tags, str):
        tags = [tags]
    try:
        names = [_tag_name(t) for t in tags]
    except TypeError:
        raise ValueError(f"{what} must be a tag or an iterable of tags, not {tags!r}") from None
    return b",".join(names)


@contextlib.contextmanager
def tag(name):
    """Allocations this thread makes inside the block belong to tag ``name`` (``with
    cudalloc_torch.tag("weights"): model = build().cuda()``); blocks nest, and the outer tag
    applies again after an inner one. The tag is kept by the library for the calling thread, so
    it reaches every allocation PyTorch makes on this thread. A bad name (empty, with a comma or a
    control character, over 255 bytes) raises ``ValueError``."""
    lib = load()
    if lib.cudalloc_tag_push(_tag_name(name)) < 0:
        raise ValueError(last_error())
    try:
        yield name
    finally:
        _check(lib.cudalloc_tag_pop())


def current_tag():
    """The calling thread's innermost tag (inside :func:`tag` blocks), or None."""
    lib = load()
    buf = ctypes.create_string_buffer(256 + 1)
    n = lib.cudalloc_tag_current(buf, len(buf))
    return buf.raw[:n].decode("utf-8") if n else None


def _check_sleep(result):
    """Raises the exception for a failed ``cudalloc_sleep`` or ``cudalloc_wake``."""
    if result >= 0:
        return
    lib = load()
    kind, msg = lib.cudalloc_last_error_kind(), last_error()
    if kind == _KIND_OUT_OF_MEMORY:
        raise OutOfMemoryError(msg)
    if kind == _KIND_SLEEP_INCOMPLETE:
        raise SleepIncompleteError(msg)
    raise CudallocError(msg)


def sleep(tags, offload=(), device=None):
    """Puts ``tags`` (a tag or a list of them) of ``device`` (default: the current device) to
    sleep, in order: their device memory goes back to the driver while their tensors keep their
    addresses; the tensors of the tags also in ``offload`` are first copied to pinned host memory
    (after the work queued on every stream that used them), the others come back uninitialised.
    Until :func:`wake`, allocating in the tag fails; a tensor of it freed meanwhile (``del``)
    is taken at once and its memory goes back to the tag at the wake. Raises
    :class:`SleepIncompleteError` when some pages stayed mapped (the tag sleeps anyway),
    :class:`CudallocError` otherwise (the tags before the failed one sleep, those after it do
    not). Needs the ``default`` or ``torch-expandable`` policy."""
    from . import _backend

    _backend.forget_shared()  # descriptors kept for other processes would hold the pages
    _check_sleep(
        _device_lib().cudalloc_sleep(current_device(device), _tag_list(tags, "tags"), _tag_list(offload, "offload"))
    )


def _stream_handle(stream, device):
    """The ``cudaStream_t`` of ``stream`` (a ``torch.cuda.Stream``, an int handle) or, for None,
    of torch's current stream on ``device`` once torch has initialised CUDA, else the legacy
    default stream (0)."""
    if stream is None:
        import sys

        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return 0
        stream = cuda.current_stream(device)
    handle = getattr(stream, "cuda_stream", stream)
    if not isinstance(handle, int) or isinstance(handle, bool):
        raise ValueError(f"not a CUDA stream: {stream!r}")
    return handle


def wake(tags, stream=None, device=None):
    """Wakes ``tags`` (a tag or a list of them) of ``device`` (default: the current device), in
    order: new memory at the same addresses, the offloaded bytes copied back. Work queued
    afterwards on ``stream`` (default: torch's current stream), or on a stream that used the
    tags' tensors, runs after the copies; the call itself does not wait for them. Raises
    :class:`OutOfMemoryError` when a tag finds no room (it stays asleep and intact; the tags
    before it are awake), :class:`CudallocError` for other failures."""
    d = current_device(device)
    _check_sleep(_device_lib().cudalloc_wake(d, _tag_list(tags, "tags"), _stream_handle(stream, d)))


def tag_stats(device=None):
    """Each tag of ``device`` (default: the current device), by name, in the order the tags
    were first used: a dict with ``allocations``, ``allocated_bytes``, ``requested_bytes``,
    ``reserved_bytes``, ``asleep``, ``slept_bytes``, ``offloaded_bytes``, ``host_buffer_bytes``
    and ``mapped_while_asleep``."""
    rows = _json(_device_lib().cudalloc_tag_stats_json, current_device(device))
    return collections.OrderedDict((r.pop("tag"), r) for r in rows)


def release_host_buffers(device=None):
    """Frees the pinned host buffers the awake tags of ``device`` (default: the current device)
    keep for their next offloading sleep."""
    _check(_device_lib().cudalloc_release_host_buffers(current_device(device)))
