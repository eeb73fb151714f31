"""A fourth set of workloads for ``h200_workloads.py``: models none of the earlier 37 uses,
recorded (on an H100) after every rule of the ``default`` policy was set, so that their figures
are out of sample. Models are built from configs with random weights; shapes come from fixed seeds.

- ``swin_infer_dynamic``: fp16 inference of Swin-T (shifted windows, patch merging) on images
  of random batch and side;
- ``wav2vec2_infer_dynamic``: fp16 inference of a wav2vec 2.0 base encoder (a convolutional
  feature extractor, then a transformer) on audio of random batch and length;
- ``dlrm_train_dynamic``: a recommendation model (DLRM-style: eight embedding-bag tables of
  1,000 to 1,000,000 rows with sparse gradients, dot-product interactions, two MLPs) trained
  with ``SparseAdam`` and ``AdamW`` on batches of random size and bags of random length;
- ``mamba_train_varlen``: a Mamba (selective state space) language model trained on batches of
  random length, its scan run step by step in PyTorch: transformers takes its fused kernels
  when ``mamba_ssm`` and ``causal_conv1d`` are installed, so the workload refuses to run then.
"""
import random
import sys

import torch


def _infer(m, batches, make_input):
    """Inference of ``m`` (fp16, eval) on ``batches`` inputs, each from ``make_input()``."""
    m = m.cuda().half().eval()
    with torch.no_grad():
        for _ in range(batches):
            m(make_input())
    torch.cuda.synchronize()


def swin_infer_dynamic():
    import torchvision
    torch.manual_seed(40); random.seed(40)

    def images():
        b = random.randint(1, 32); r = 32 * random.randint(5, 12)
        return torch.randn(b, 3, r, r, device="cuda", dtype=torch.half)
    _infer(torchvision.models.swin_t(weights=None), 30, images)


def wav2vec2_infer_dynamic():
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    torch.manual_seed(41); random.seed(41)

    def audio():
        b = random.randint(1, 8); n = 16000 * random.randint(1, 12) + random.randint(0, 15999)
        return torch.randn(b, n, device="cuda", dtype=torch.half)
    _infer(Wav2Vec2Model(Wav2Vec2Config()), 30, audio)


class _DLRM(torch.nn.Module):
    """Embedding bags (sum) and a bottom MLP over dense features; pairwise dot products of their
    vectors, then a top MLP to one logit."""

    def __init__(self, rows, dim=64, dense=13):
        super().__init__()
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in rows)
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(dense, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
            torch.nn.ReLU(), torch.nn.Linear(256, dim), torch.nn.ReLU())
        f = len(rows) + 1
        self.top = torch.nn.Sequential(
            torch.nn.Linear(dim + f * (f - 1) // 2, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))

    def forward(self, x, bags):
        z = [self.bottom(x)] + [t(idx, off) for t, (idx, off) in zip(self.tables, bags)]
        z = torch.stack(z, 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], 1, device=z.device)
        return self.top(torch.cat([z[:, 0], inter[:, i, j]], 1)).squeeze(1)


def dlrm_train_dynamic():
    torch.manual_seed(42); random.seed(42)
    rows = [1_000_000, 500_000, 200_000, 100_000, 50_000, 20_000, 10_000, 1_000]
    m = _DLRM(rows).cuda()
    sparse = [p for t in m.tables for p in t.parameters()]
    dense = list(m.bottom.parameters()) + list(m.top.parameters())
    opts = [torch.optim.SparseAdam(sparse, lr=1e-3), torch.optim.AdamW(dense, lr=1e-3)]
    for _ in range(30):
        b = random.randint(1024, 16384)
        bags = []
        for n in rows:
            lens = torch.randint(1, 2 * random.randint(1, 20), (b,), device="cuda")
            off = torch.zeros(b, dtype=torch.long, device="cuda")
            off[1:] = lens.cumsum(0)[:-1]
            bags.append((torch.randint(0, n, (int(lens.sum()),), device="cuda"), off))
        x = torch.randn(b, 13, device="cuda")
        y = torch.randint(0, 2, (b,), device="cuda").float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(m(x, bags), y)
        loss.backward()
        for o in opts:
            o.step(); o.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def mamba_train_varlen():
    import importlib.util

    from transformers import MambaConfig, MambaForCausalLM
    fused = [m for m in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m)]
    if fused:
        sys.exit(f"mamba_train_varlen records the scan run step by step: uninstall {fused}")
    torch.manual_seed(43); random.seed(43)
    m = MambaForCausalLM(MambaConfig(hidden_size=768, num_hidden_layers=8, vocab_size=32000)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(6):
        shape = (random.randint(2, 8), random.randint(64, 384))
        ids = torch.randint(0, 32000, shape, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


FOURTH_SET = {f.__name__: f for f in (swin_infer_dynamic, wav2vec2_infer_dynamic,
                                      dlrm_train_dynamic, mamba_train_varlen)}
