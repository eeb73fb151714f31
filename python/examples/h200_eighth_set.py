"""An eighth set of workloads for ``h200_workloads.py``: kinds of job no other trace is,
recorded after every rule of the ``default`` policy was set, so that their figures are out of
sample (the seventh set is two acceptance programs, ``traces/programs/``). Models are built
from configs with random weights; shapes come from fixed seeds.

- ``distill_train_varlen``: knowledge distillation, two models in one job: a frozen teacher
  (GPT-2 medium's shapes, bf16, no gradients) and a smaller student trained under bf16
  autocast on the teacher's softened logits, batches of 2-12 sequences of 64-512 tokens;
- ``video_infer_dynamic``: video classification (an R3D-18 of 3D convolutions) in fp16 on
  clips of random count, frame count and side;
- ``train_eval_cycle``: image classification (ViT-B/16) trained at one batch size and evaluated
  without gradients at a larger one, alternating, gradients set to None between phases.
"""
import random

import torch


def distill_train_varlen():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(80); random.seed(80)
    teacher = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16))
    teacher = teacher.cuda().to(torch.bfloat16).eval().requires_grad_(False)
    student = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12)).cuda().train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    for _ in range(20):
        b = random.randint(2, 12); length = random.randint(64, 512)
        ids = torch.randint(0, 50257, (b, length), device="cuda")
        with torch.no_grad():
            soft = torch.softmax(teacher(ids).logits.float() / 2.0, dim=-1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = student(ids).logits
        loss = torch.nn.functional.kl_div(torch.log_softmax(logits.float() / 2.0, dim=-1), soft,
                                          reduction="batchmean")
        del soft
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def video_infer_dynamic():
    import torchvision
    torch.manual_seed(81); random.seed(81)
    m = torchvision.models.video.r3d_18(num_classes=400).cuda().half().eval()
    with torch.no_grad():
        for _ in range(24):
            b = random.randint(1, 8); frames = 8 * random.randint(1, 4)
            side = 16 * random.randint(7, 14)
            x = torch.randn(b, 3, frames, side, side, device="cuda", dtype=torch.float16)
            m(x).softmax(-1)
    torch.cuda.synchronize()


def train_eval_cycle():
    import torchvision
    torch.manual_seed(82); random.seed(82)
    m = torchvision.models.vit_b_16(num_classes=1000).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(4):
        m.train()
        for _ in range(6):
            x = torch.randn(48, 3, 224, 224, device="cuda")
            y = torch.randint(0, 1000, (48,), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        m.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                b = random.randint(96, 256)
                m(torch.randn(b, 3, 224, 224, device="cuda")).argmax(-1)
    torch.cuda.synchronize()


EIGHTH_SET = {f.__name__: f for f in (distill_train_varlen, video_infer_dynamic,
                                      train_eval_cycle)}
