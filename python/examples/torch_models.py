#!/usr/bin/env python3
"""Real PyTorch models on PyTorch's allocator and on cudalloc, one process per run.

Workloads (random weights, built from configs; nothing is downloaded):

- ``gpt2``: GPT-2 small (``GPT2LMHeadModel(GPT2Config())``), 3 training steps on a batch of
  8 x 512 random tokens, AdamW, bf16 autocast; records the losses.
- ``llama``: a Llama-style model (8 layers, hidden 1024, 16 heads, 4 KV heads), bf16, batched
  greedy ``generate`` for 4 left-padded prompts of different lengths, 32 new tokens; records the
  generated token ids.
- the jobs behind ``traces/h200/`` (``vit_train``, ``kv_serve``, ... : ``h200_workloads.py``),
  run as recorded; they record no results, so the table's last column is ``-`` for them, and
  ``--quick`` does not shrink them. With ``--trace``, the replay of the trace cudalloc wrote
  can be set beside what the job reserved (``cudalloc replay --policy default TRACE``).

Modes: ``torch`` (PyTorch's caching allocator), ``torch-expandable``
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and ``cudalloc:POLICY`` (cudalloc through
``torch.cuda.memory.CUDAPluggableAllocator``, ``CUDALLOC_CONF=policy:POLICY``).

Run without ``--allocator``, the script runs every workload x mode in a separate process of
itself (``--allocator A --policy P --workload W``), collects their results and prints a table:
peak reserved and peak allocated bytes (PyTorch: ``torch.cuda.max_memory_reserved/allocated``;
cudalloc: ``reserved_bytes.all.peak`` / ``allocated_bytes.all.peak`` of its stats), driver
allocations, time, and whether the results match the ``torch`` run (losses within 1e-2
relative, since allocators can change which kernels run and nondeterministic kernels differ
slightly; generated ids equal). ``--out DIR`` receives ``results.json`` and ``log.txt`` (and,
with ``--trace``, one cudalloc trace per workload x cudalloc mode).

Usage (from the repository root, with ``libcudalloc_capi.so`` built by
``cargo build --release -p cudalloc-capi`` or pointed at by ``CUDALLOC_LIB``)::

    python3 python/examples/torch_models.py --out /tmp/models            # everything
    python3 python/examples/torch_models.py --quick --out /tmp/quick     # tiny models, seconds
    python3 python/examples/torch_models.py --workloads gpt2 --modes torch,cudalloc:default --out o
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
RESULT_MARK = "@@RESULT@@ "
WORKLOADS = ["gpt2", "llama"]


H200_FILES = ("h200_workloads.py", "h200_fourth_set.py", "h200_fifth_set.py",
              "h200_sixth_set.py", "h200_eighth_set.py", "h200_ninth_set.py")


def _h200_workloads():
    """The jobs recorded in traces/h200/: the public functions of h200_workloads.py and of the
    fourth, fifth, sixth, eighth and ninth sets it takes in, read without importing them (they import
    torch, which the parent need not have)."""
    import ast

    names = []
    for name in H200_FILES:
        with open(os.path.join(HERE, name)) as f:
            tree = ast.parse(f.read())
        names += [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                  and not node.name.startswith("_") and node.name != "main"]
    return sorted(names)


H200_WORKLOADS = _h200_workloads()
DEFAULT_MODES = [
    "torch",
    "torch-expandable",
    "cudalloc:default",
    "cudalloc:torch",
    "cudalloc:torch-expandable",
]
LOSS_RTOL = 1e-2
SEED = 0
DEVICE = "cuda"  # the workloads' device; a CPU run of the workload code only checks the code


# --------------------------------------------------------------------------------------------
# Child: one workload on one allocator.


def setup_allocator(args):
    """Switches the allocator before anything touches the GPU; returns a stats reader."""
    if args.allocator == "cudalloc":
        sys.path.insert(0, PYTHON_DIR)
        import cudalloc_torch

        cudalloc_torch.enable(lib_path=args.lib, conf=f"policy:{args.policy}")
        if args.trace:
            cudalloc_torch.trace_start(args.trace)
        return cudalloc_torch
    expected = "expandable_segments:True" if args.allocator == "torch-expandable" else None
    got = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if got != expected:
        raise SystemExit(f"PYTORCH_CUDA_ALLOC_CONF is {got!r}, expected {expected!r}")
    return None


def memory_figures(cudalloc_torch):
    import torch

    if cudalloc_torch is not None:
        s = cudalloc_torch.stats(torch.cuda.current_device())
        return {
            "peak_reserved": s["reserved_bytes.all.peak"],
            "peak_allocated": s["allocated_bytes.all.peak"],
            "end_reserved": s["reserved_bytes.all.current"],
            "allocations": s["allocation.all.allocated"],
            "num_device_alloc": s["num_device_alloc"],
            "num_device_free": s["num_device_free"],
            "num_alloc_retries": s["num_alloc_retries"],
            "num_ooms": s["num_ooms"],
            "driver_calls": s["driver_calls"],
            "fragmentation": {k: v for k, v in s["fragmentation"].items() if k != "free_histogram"},
            "policy": s["policy"],
        }
    s = torch.cuda.memory_stats()
    return {
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "end_reserved": torch.cuda.memory_reserved(),
        "allocations": s.get("allocation.all.allocated"),
        "num_device_alloc": s.get("num_device_alloc"),
        "num_device_free": s.get("num_device_free"),
        "num_alloc_retries": s.get("num_alloc_retries"),
        "num_ooms": s.get("num_ooms"),
    }


def seed_everything():
    import torch

    torch.manual_seed(SEED)
    if DEVICE == "cuda":
        torch.cuda.manual_seed_all(SEED)


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def gpt2_training(quick):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=256, vocab_size=1000,
                         bos_token_id=999, eos_token_id=999)
        batch, seq, steps = 2, 64, 2
    else:
        cfg = GPT2Config()
        batch, seq, steps = 8, 512, 3
    seed_everything()
    with torch.device(DEVICE):
        model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(steps)]
    losses, step_s = [], []
    for tokens in batches:
        sync()
        t0 = time.perf_counter()
        x = tokens.to(DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        step_s.append(time.perf_counter() - t0)
    return {"losses": losses, "step_s": step_s, "params": sum(p.numel() for p in model.parameters())}


def llama_generate(quick):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        dims = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
        lengths, new_tokens = [3, 9, 5, 12], 8
    else:
        dims = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4)
        lengths, new_tokens = [17, 64, 5, 128], 32
    pad = 0
    # No end-of-sequence token: every prompt gets exactly new_tokens tokens.
    cfg = LlamaConfig(**dims, max_position_embeddings=2048, pad_token_id=pad, bos_token_id=None,
                      eos_token_id=None, tie_word_embeddings=False)
    seed_everything()
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    sync()
    return {
        "generated": out[:, width:].tolist(),
        "step_s": [time.perf_counter() - t0],
        "params": sum(p.numel() for p in model.parameters()),
    }


def h200_job(name):
    """One job of h200_workloads.py, as recorded (it records no results to compare)."""
    sys.path.insert(0, HERE)
    import h200_workloads

    sync()
    t0 = time.perf_counter()
    h200_workloads.WORKLOADS[name]()
    sync()
    return {"step_s": [time.perf_counter() - t0]}


def child(args):
    result = {"workload": args.workload, "mode": mode_name(args.allocator, args.policy),
              "allocator": args.allocator, "policy": args.policy if args.allocator == "cudalloc" else None,
              "quick": args.quick, "ok": False}
    t0 = time.perf_counter()
    try:
        cudalloc_torch = setup_allocator(args)
        import torch
        import transformers

        if args.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      device=torch.cuda.get_device_name())
        if args.workload in H200_WORKLOADS:
            result.update(h200_job(args.workload))
        else:
            run = {"gpt2": gpt2_training, "llama": llama_generate}[args.workload]
            result.update(run(args.quick))
        result.update(memory_figures(cudalloc_torch))
        if cudalloc_torch is not None:
            if not result["allocations"]:
                raise RuntimeError("cudalloc served no allocation: the pluggable allocator is not in use")
            if args.trace:
                cudalloc_torch.trace_stop()
                result["trace"] = args.trace
        free, total = torch.cuda.mem_get_info()
        result["device_used_at_end"] = total - free
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then re-raised
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    result["wall_s"] = time.perf_counter() - t0
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------------------------
# Parent: spawn the runs, compare, print the table.


def mode_name(allocator, policy):
    return f"cudalloc:{policy}" if allocator == "cudalloc" else allocator


def parse_mode(mode):
    if mode in ("torch", "torch-expandable"):
        return mode, None
    if mode.startswith("cudalloc:") and mode.split(":", 1)[1]:
        return "cudalloc", mode.split(":", 1)[1]
    raise SystemExit(f"unknown mode {mode!r} (torch, torch-expandable or cudalloc:POLICY)")


def run_child(args, workload, mode, log):
    allocator, policy = parse_mode(mode)
    cmd = [sys.executable, os.path.abspath(__file__), "--allocator", allocator,
           "--workload", workload, "--out", args.out]
    if policy:
        cmd += ["--policy", policy]
    if args.quick:
        cmd.append("--quick")
    if args.deterministic:
        cmd.append("--deterministic")
    if allocator == "cudalloc":
        cmd += ["--lib", args.lib]
        if args.trace:
            cmd += ["--trace", os.path.join(args.out, f"{workload}-{policy}.trace.csv.gz")]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CUDALLOC_CONF", None)
    if allocator == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=args.timeout)
        output, code = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    log.write(f"===== {workload} {mode}: exit {code} after {time.perf_counter() - t0:.1f} s\n")
    log.write(" ".join(cmd) + "\n" + output + "\n")
    log.flush()
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = "\n".join(output.splitlines()[-5:])
    return {"workload": workload, "mode": mode, "ok": False, "error": f"exit {code}: {tail}"}


def compare(result, ref):
    """'ref', 'yes', 'NO (...)' or '-' against the torch run of the same workload."""
    if not result.get("ok"):
        return "-"
    if result is ref:
        return "ref"
    if ref is None or not ref.get("ok"):
        return "no ref"
    if "losses" not in result and "generated" not in result:
        return "-"
    if "losses" in result:
        a, b = result["losses"], ref["losses"]
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a else 0.0
        ok = len(a) == len(b) and worst <= LOSS_RTOL
        return f"yes ({worst:.1e})" if ok else f"NO (rel {worst:.1e})"
    a, b = result["generated"], ref["generated"]
    if a == b:
        return "yes"
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return f"NO ({same}/{sum(len(r) for r in b)} ids)"


def driver_calls(r):
    """cudalloc's driver calls (mallocs, frees, maps, unmaps); PyTorch's cudaMalloc and cudaFree
    calls under its default rules ("-" with expandable segments, whose maps it does not count)."""
    if "driver_calls" in r:
        return f"{r['driver_calls']['total']:,}"
    if r["mode"] == "torch":
        return f"{r['num_device_alloc'] + r['num_device_free']:,}"
    return "-"


def mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f}"


def table(results, modes, workloads):
    head = ["workload", "mode", "peak reserved MiB", "peak allocated MiB", "res/alloc",
            "driver calls", "time s", "matches torch"]
    rows, failures = [], []
    for w in workloads:
        ref = next((r for r in results if r["workload"] == w and r["mode"] == "torch"), None)
        for m in modes:
            r = next((r for r in results if r["workload"] == w and r["mode"] == m), None)
            if r is None:
                continue
            if not r.get("ok"):
                rows.append([w, m, "FAILED", "-", "-", "-", "-", "-"])
                failures.append(f"{w} on {m}: {r.get('error', '?')[:300]}")
                continue
            ratio = r["peak_reserved"] / r["peak_allocated"] if r["peak_allocated"] else float("nan")
            rows.append([w, m, mib(r["peak_reserved"]), mib(r["peak_allocated"]), f"{ratio:.3f}",
                         driver_calls(r), f"{sum(r['step_s']):.2f}",
                         compare(r, ref)])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(wd) if i >= 2 else str(c).ljust(wd)  # noqa: E731
                                   for i, (c, wd) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * wd for wd in widths])] + [line(r) for r in rows]
    if failures:
        out += ["", "failed runs (details in log.txt):"] + ["  " + f for f in failures]
    return "\n".join(out)


def parent(args):
    os.makedirs(args.out, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    workloads = [x for w in workloads for x in (H200_WORKLOADS if w == "h200" else [w])]
    for w in workloads:
        if w not in WORKLOADS + H200_WORKLOADS:
            raise SystemExit(f"unknown workload {w!r} ({', '.join(WORKLOADS + H200_WORKLOADS)})")
    for m in modes:
        parse_mode(m)
    if any(m.startswith("cudalloc:") for m in modes):
        sys.path.insert(0, PYTHON_DIR)
        import cudalloc_torch

        args.lib = cudalloc_torch.library_path(args.lib)
        if not os.path.exists(args.lib):
            raise SystemExit(f"{args.lib} not found: build it with "
                             "`cargo build --release -p cudalloc-capi` or set CUDALLOC_LIB")
    results = []
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        for w in workloads:
            for m in modes:
                print(f"running {w} on {m} ...", file=sys.stderr, flush=True)
                r = run_child(args, w, m, log)
                if not r.get("ok"):
                    print(f"  FAILED: {r.get('error')}", file=sys.stderr, flush=True)
                results.append(r)
    text = table(results, modes, workloads)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"quick": args.quick, "modes": modes, "workloads": workloads,
                   "loss_rtol": LOSS_RTOL, "results": results, "table": text}, f, indent=1)
    print(text)
    return 0 if all(r.get("ok") for r in results) else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["torch", "torch-expandable", "cudalloc"],
                    help="run one workload on this allocator (the parent passes it to its children)")
    ap.add_argument("--policy", default="default", help="cudalloc policy (with --allocator cudalloc)")
    ap.add_argument("--workload", choices=WORKLOADS + H200_WORKLOADS, help="with --allocator: the workload to run")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="parent: comma-separated workloads (`h200`: every job of h200_workloads.py)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="parent: comma-separated modes")
    ap.add_argument("--quick", action="store_true", help="tiny models and batches (seconds)")
    ap.add_argument("--out", default="torch_models_out", help="directory for results.json and log.txt")
    ap.add_argument("--lib", default=None, help="libcudalloc_capi.so (default: $CUDALLOC_LIB or target/release)")
    ap.add_argument("--trace", nargs="?", const=True, default=None,
                    help="parent: also record a cudalloc trace per workload x cudalloc mode into --out")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) in every run")
    ap.add_argument("--timeout", type=float, default=300, help="parent: seconds per run")
    args = ap.parse_args()
    if args.allocator:
        if not args.workload:
            ap.error("--allocator needs --workload")
        if args.trace is True:
            args.trace = os.path.join(args.out, f"{args.workload}-{args.policy}.trace.csv.gz")
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
