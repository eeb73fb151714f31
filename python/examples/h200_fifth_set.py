"""A fifth set of workloads for ``h200_workloads.py``: kinds of job none of the earlier 45 is,
recorded after every rule of the ``default`` policy was set (``small_partial_slack`` included),
so that their figures are out of sample. Models are built from configs with random weights;
shapes come from fixed seeds.

- ``lora_train_varlen``: parameter-efficient fine-tuning of a Llama-style model (frozen bf16
  weights, rank-16 adapters on the query and value projections, the only trained parameters)
  on batches of random size and length;
- ``bart_train_varlen``: sequence-to-sequence training (BART with its config's defaults, 12 + 12
  layers of 1,024) on source and target sequences whose lengths are drawn apart, under fp16
  autocast;
- ``maskrcnn_train_dynamic``: instance segmentation training (Mask R-CNN with a ResNet-50 FPN)
  on batches of random count of images of random size (the model's transform rescales each to
  a shorter side of 800), each with a random number of boxes and masks;
- ``qwen2_accum_train``: a Qwen2-style model trained with gradient accumulation, four
  micro-batches a step, each of its own size and length.
"""
import random

import torch


class _LoRA(torch.nn.Module):
    """``base(x) + B(A(x)) * scale`` with ``base`` frozen: the adapter of a linear layer."""

    def __init__(self, base, rank=16, alpha=32):
        super().__init__()
        self.base = base
        self.a = torch.nn.Linear(base.in_features, rank, bias=False, dtype=torch.float32)
        self.b = torch.nn.Linear(rank, base.out_features, bias=False, dtype=torch.float32)
        torch.nn.init.zeros_(self.b.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.b(self.a(x.float())).to(x.dtype) * self.scale


def lora_train_varlen():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(50); random.seed(50)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()
    m.requires_grad_(False)
    for layer in m.model.layers:
        attn = layer.self_attn
        attn.q_proj = _LoRA(attn.q_proj).cuda()
        attn.v_proj = _LoRA(attn.v_proj).cuda()
    trained = [p for n, p in m.named_parameters() if ".a." in n or ".b." in n]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    for _ in range(10):
        b = random.randint(1, 8); length = random.randint(128, 1536)
        ids = torch.randint(0, 32000, (b, length), device="cuda")
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def bart_train_varlen():
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(51); random.seed(51)
    m = BartForConditionalGeneration(BartConfig()).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    vocab = m.config.vocab_size
    for _ in range(12):
        b = random.randint(4, 32)
        src = torch.randint(4, vocab, (b, random.randint(32, 512)), device="cuda")
        tgt = torch.randint(4, vocab, (b, random.randint(16, 256)), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(input_ids=src, labels=tgt).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def _instances(h, w):
    """A random number of boxes inside an ``h`` x ``w`` image, a class and a filled mask each."""
    n = random.randint(1, 12)
    x0 = torch.randint(0, w - 32, (n,)); y0 = torch.randint(0, h - 32, (n,))
    x1 = torch.minimum(x0 + torch.randint(16, 256, (n,)), torch.tensor(w))
    y1 = torch.minimum(y0 + torch.randint(16, 256, (n,)), torch.tensor(h))
    masks = torch.zeros(n, h, w, dtype=torch.uint8)
    for i in range(n):
        masks[i, y0[i]:y1[i], x0[i]:x1[i]] = 1
    boxes = torch.stack([x0, y0, x1, y1], 1).float()
    return {"boxes": boxes.cuda(), "labels": torch.randint(1, 91, (n,)).cuda(),
            "masks": masks.cuda()}


def maskrcnn_train_dynamic():
    import torchvision
    torch.manual_seed(52); random.seed(52)
    m = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None).cuda().train()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(16):
        sizes = [(random.randint(320, 800), random.randint(320, 800))
                 for _ in range(random.randint(1, 4))]
        images = [torch.rand(3, h, w, device="cuda") for h, w in sizes]
        targets = [_instances(h, w) for h, w in sizes]
        loss = sum(m(images, targets).values())
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def qwen2_accum_train():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(53); random.seed(53)
    cfg = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=64000)
    m = Qwen2ForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(6):
        for _ in range(4):
            ids = torch.randint(0, 64000, (random.randint(1, 6), random.randint(64, 1024)),
                                device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=ids, labels=ids).loss / 4
            loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


FIFTH_SET = {f.__name__: f for f in (lora_train_varlen, bart_train_varlen,
                                     maskrcnn_train_dynamic, qwen2_accum_train)}
