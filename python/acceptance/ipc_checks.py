"""Review check of torch.multiprocessing's CUDA tensor sharing on cudalloc's extension backend
(``csrc/sharing.h``, ``csrc/ipc.h``), run by ``review_checks.py`` (``--only ipc_share_tensor``)
like its own checks: it returns its findings (PASS), raises ``AssertionError`` (FAIL) or
``Skip``, and passes on PyTorch's own allocator too (``--baseline``).

The check starts a sending process on cudalloc with ``shareable_segments:True`` added to the
run's config (or on PyTorch's allocator with ``--baseline``), which sends a 256 MiB CUDA tensor
and a view of it through a ``torch.multiprocessing`` queue to a receiving process it starts the
same way; the receiver checks the values and adds one in place, and the sender must then see
the write (the two map the same pages). Each process is killed if it outlives its wait.
"""

import multiprocessing
import os
import sys

from check_base import RUN, line

ELEMENTS = 64 << 20  # int32: 256 MiB, several of the default policy's 40 MiB chunks


def _enable(run):
    if run["baseline"]:
        return
    sys.path.insert(0, run["python_dir"])
    import cudalloc_torch

    conf = ",".join(c for c in (run["conf"], "shareable_segments:True") if c)
    cudalloc_torch.enable(lib_path=run["lib"], conf=conf, backend=run["backend"])


def _receiver(run, inbox, outbox):
    try:
        _enable(run)
        import torch

        t, view = inbox.get(timeout=60)
        same = t.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        saw = bool((t == torch.arange(ELEMENTS, device="cuda", dtype=torch.int32)).all())
        t.add_(1)
        busy = t.float().mul_(2)  # queued work that reads the mapping: still running at the del
        del t, view
        torch.cuda.synchronize()
        outbox.put({"saw_values": saw, "one_storage": same, "busy": float(busy[-1].item())})
    except Exception as e:
        outbox.put({"error": f"receiver: {type(e).__name__}: {line(e)}"})


def _sender(run, result):
    p = None
    try:
        _enable(run)
        import torch
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_receiver, args=(run, inbox, outbox), daemon=True)
        p.start()
        t = torch.arange(ELEMENTS, device="cuda", dtype=torch.int32)
        torch.cuda.synchronize()
        inbox.put((t, t[1:]))  # the tensor and a view of it: one storage, shared once
        got = outbox.get(timeout=80)
        p.join(20)
        if "error" in got:
            result.put(got)
            return
        wrote = bool((t == torch.arange(ELEMENTS, device="cuda", dtype=torch.int32) + 1).all())
        result.put({"receiver_saw_values": got["saw_values"], "one_storage": got["one_storage"],
                    "sender_saw_write": wrote, "receiver_busy": got["busy"],
                    "receiver_exit": p.exitcode})
    except Exception as e:
        result.put({"error": f"sender: {type(e).__name__}: {line(e)}"})
    finally:
        if p is not None and p.is_alive():
            p.kill()


def check_ipc_share_tensor():
    """A CUDA tensor and a view of it sent to another process through a torch.multiprocessing
    queue (sender and receiver on cudalloc, shareable_segments:True): the receiver opens one
    storage for both, sees the values, and its in-place write is seen by the sender; the
    receiver drops the tensor while work reading it is still queued (the mapping must outlive
    that work)."""
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    p = ctx.Process(target=_sender, args=(dict(RUN), result))
    p.start()
    try:
        r = result.get(timeout=150)  # beyond the sender's own waits, so that it says why
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert "error" not in r, r["error"]
    assert r["receiver_saw_values"], f"the receiver saw other values: {r}"
    assert r["one_storage"], f"the tensor and its view opened two storages: {r}"
    assert r["sender_saw_write"], f"the sender did not see the receiver's write: {r}"
    assert r["receiver_busy"] == 2.0 * ELEMENTS, f"the work queued before the del: {r}"
    assert r["receiver_exit"] == 0, f"the receiver exited with {r['receiver_exit']}"
    return r


CHECKS = {
    "ipc_share_tensor": check_ipc_share_tensor,
}

if __name__ == "__main__":
    sys.exit("run through review_checks.py: " + os.path.basename(__file__) + " has no runner")
