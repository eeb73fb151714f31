"""Acceptance programs of training and serving patterns that put CUDA graphs and mixed precision
on the allocator (the registry and the other programs: ``programs.py``).

- ``graphed_callables``: a transformer block trained through ``torch.cuda.make_graphed_callables``:
  its forward and backward graphs share one private pool, captured on PyTorch's side stream, and
  are replayed each step between eager layers (the head, the loss, the optimizer) whose tensors
  live on the same stream. The losses must match PyTorch's allocator's.
- ``decode_graphs``: decoding as serving engines run it: one decode step of a small decoder with a
  static key-value cache captured at batch sizes 8, 4, 2 and 1 (largest first) into one pool from
  ``graph_pool_handle``, then rounds of eager prefill at varied prompt lengths, each followed by
  graph-replayed decoding while an eager tensor lives across the replays. The replayed tokens
  must equal eager decoding's, and the eager tensor must stay intact.
- ``checkpoint_fp16``: GPT-2 training with activation checkpointing (recomputation in the
  backward pass) under fp16 autocast with a ``GradScaler`` whose first scale overflows, so that
  the first steps are skipped and the scale backs off, as mixed-precision training starts; later
  steps must train.
- ``fsdp_train``, ``ddp_train``: GPT-2 training under FSDP2 (``fully_shard``) and under
  ``DistributedDataParallel``, each in an NCCL process group of one rank (the collectives still
  run, on their own streams), the sequence length changing every step.
"""

import statistics
import time

import torch

from capped import timed_step


def graphed_callables(quick):
    """Losses of a training whose transformer block runs as CUDA graphs
    (``make_graphed_callables``), and eager tensors on the replay stream checked after it."""
    torch.manual_seed(0)
    dim, tokens, batch, steps = (128, 64, 4, 6) if quick else (1024, 512, 8, 20)
    block = torch.nn.TransformerEncoderLayer(dim, 16, 4 * dim, dropout=0.0,
                                             batch_first=True).cuda()
    head = torch.nn.Linear(dim, dim).cuda()
    opt = torch.optim.AdamW([*block.parameters(), *head.parameters()], lr=1e-4)
    sample = torch.randn(batch, tokens, dim, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(block, (sample,))
    del sample
    losses, overwritten = [], 0
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(batch, tokens, dim, device="cuda", requires_grad=True)
        marker = torch.full((batch * tokens * dim,), float(step + 3), device="cuda")
        loss = head(graphed(x)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        overwritten += int((marker != float(step + 3)).sum())
        del x, marker, loss
    if overwritten:
        raise RuntimeError(f"graph replays overwrote {overwritten} elements of eager tensors")
    return {"losses": losses, "overwritten": overwritten}


class _Decoder(torch.nn.Module):
    """A pre-norm decoder whose keys and values go to a static cache at the positions
    ``pos`` (a device scalar, so that one captured step serves every position) onwards."""

    def __init__(self, layers, dim, heads, vocab, batch, length):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        lin = torch.nn.Linear
        self.qkv = torch.nn.ModuleList(lin(dim, 3 * dim, bias=False) for _ in range(layers))
        self.out = torch.nn.ModuleList(lin(dim, dim, bias=False) for _ in range(layers))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(lin(dim, 4 * dim), torch.nn.GELU(), lin(4 * dim, dim))
            for _ in range(layers))
        self.lm = lin(dim, vocab, bias=False)
        self.register_buffer("keys", torch.zeros(layers, batch, length, dim))
        self.register_buffer("values", torch.zeros(layers, batch, length, dim))

    def forward(self, tokens, pos):
        b, t = tokens.shape
        length, dim = self.keys.shape[2], self.keys.shape[3]
        at = pos + torch.arange(t, device=tokens.device)
        mask = torch.arange(length, device=tokens.device)[None, :] <= at[:, None]
        x = self.embed(tokens)
        split = (b, -1, self.heads, dim // self.heads)
        for i, qkv in enumerate(self.qkv):
            q, k, v = qkv(self.norm(x)).chunk(3, dim=-1)
            self.keys[i, :b].index_copy_(1, at, k)
            self.values[i, :b].index_copy_(1, at, v)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(split).transpose(1, 2), self.keys[i, :b].reshape(split).transpose(1, 2),
                self.values[i, :b].reshape(split).transpose(1, 2), attn_mask=mask)
            x = x + self.out[i](a.transpose(1, 2).reshape(b, t, dim))
            x = x + self.mlp[i](self.norm(x))
        return self.lm(self.norm(x[:, -1]))


def decode_graphs(quick):
    """Tokens decoded by CUDA graphs captured per batch size into one shared pool, checked
    against eager decoding, with an eager tensor kept across the replays."""
    torch.manual_seed(0)
    layers, dim, heads, vocab, length = (2, 128, 4, 1000, 128) if quick else (
        6, 1024, 16, 32000, 1024)
    sizes, rounds, new_tokens = (8, 4, 2, 1), 2 if quick else 4, 8 if quick else 32
    model = _Decoder(layers, dim, heads, vocab, max(sizes), length).cuda().eval()
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    inputs = {b: torch.zeros(b, 1, dtype=torch.long, device="cuda") for b in sizes}
    graphs, outputs = _capture_decode(model, pos, inputs)
    tokens, overwritten = [], 0
    with torch.no_grad():
        for r in range(rounds):
            for b in sizes:
                gen = torch.Generator().manual_seed(1000 * r + b)
                prompt_len = int(torch.randint(8, length // 2, (), generator=gen))
                prompt = torch.randint(0, vocab, (b, prompt_len), generator=gen).cuda()
                runs = []
                for graphed in (True, False):
                    keep = torch.full((b * prompt_len * 256,), float(r + 1), device="cuda")
                    nxt = model(prompt, torch.zeros_like(pos)).argmax(-1)
                    seq = [nxt]
                    for j in range(new_tokens):
                        if graphed:
                            inputs[b].copy_(nxt[:, None])
                            pos.fill_(prompt_len + j)
                            graphs[b].replay()
                            logits = outputs[b]
                        else:
                            at = torch.full((), prompt_len + j, dtype=torch.long, device="cuda")
                            logits = model(nxt[:, None], at)
                        nxt = logits.argmax(-1)
                        seq.append(nxt)
                    overwritten += int((keep != float(r + 1)).sum())
                    runs.append(torch.stack(seq, 1).tolist())
                if runs[0] != runs[1]:
                    raise RuntimeError(f"round {r}, batch {b}: replayed tokens differ from eager")
                tokens.extend(t for row in runs[0] for t in row)
    del graphs, outputs
    if overwritten:
        raise RuntimeError(f"decode replays overwrote {overwritten} elements of an eager tensor")
    return {"tokens": tokens, "overwritten": overwritten}


def _capture_decode(model, pos, inputs):
    """One decode step captured per batch size, largest first, into one shared pool, after a
    warm-up on a side stream (as PyTorch's docs ask)."""
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in inputs:
                model(inputs[b], pos)
        torch.cuda.current_stream().wait_stream(side)
        for b in sorted(inputs, reverse=True):
            graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[b], pool=pool):
                outputs[b] = model(inputs[b], pos)
    return graphs, outputs


def checkpoint_fp16(quick):
    """Losses, skipped steps and the final loss scale of GPT-2 training with activation
    checkpointing under fp16 autocast and a ``GradScaler`` that starts too high."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4) if quick else GPT2Config(n_layer=8)
    model = GPT2LMHeadModel(cfg).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24, growth_interval=4)
    losses, times, skipped = [], [], 0
    for step in range(8 if quick else 20):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, cfg.vocab_size, (8, 256 + 128 * (step % 3)), device="cuda")
        scale = scaler.get_scale()  # a host sync: before the timed part
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        skipped += scaler.get_scale() < scale
        losses.append(float(loss))
    # Checked at full size only: whether 2**24 overflows the small model of --quick is unknown.
    if not quick and not 0 < skipped < len(losses):
        raise RuntimeError(f"{skipped} of {len(losses)} steps skipped: a loss scale of 2**24 "
                           "should overflow fp16 in the first steps, and some steps should train")
    return {"losses": losses, "skipped_steps": skipped, "final_scale": scaler.get_scale(),
            "step_ms": 1000 * statistics.median(times[3:])}


def fsdp_train(quick):
    """Losses of GPT-2 training under FSDP2 (``fully_shard`` per block and at the root) in a
    process group of one rank: parameters all-gathered and gradients reduce-scattered on
    FSDP's own streams, their buffers freed across streams."""
    from torch.distributed.fsdp import fully_shard

    return _distributed_training(quick, lambda model: _fully_shard(model, fully_shard))


def ddp_train(quick):
    """Losses of GPT-2 training under ``DistributedDataParallel`` in a process group of one
    rank: gradients all-reduced in buckets on NCCL's stream as the backward pass runs."""
    return _distributed_training(
        quick, lambda model: torch.nn.parallel.DistributedDataParallel(model))


def _fully_shard(model, fully_shard):
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _distributed_training(quick, wrap):
    """GPT-2 training steps whose sequence length changes every step, the model wrapped by
    ``wrap`` inside a one-rank NCCL process group that is torn down at the end."""
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    # One rank needs no rendezvous over the network: an in-process store, and no port.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4) if quick else GPT2Config(n_layer=6)
        model = wrap(GPT2LMHeadModel(cfg).cuda())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses, times = [], []
        for step in range(6 if quick else 16):
            torch.manual_seed(100 + step)
            ids = torch.randint(0, cfg.vocab_size, (8, 256 + 128 * (step % 3)), device="cuda")
            loss, seconds = timed_step(model, opt, ids, dtype=None)
            times.append(seconds)
            losses.append(float(loss))
    finally:
        dist.destroy_process_group()
    return {"losses": losses, "step_ms": 1000 * statistics.median(times[3:])}
