"""A ninth set of workloads for ``h200_workloads.py``: kinds of job no other trace of
``traces/h200/`` is, recorded on an H100 on 2026-12-07 after the rules of the ``default`` policy
were last changed, and held out in ``traces/split.json``. Models are built from configs with
random weights; shapes come from fixed seeds.

- ``speech_ctc_train_varlen``: speech recognition trained with a CTC loss (wav2vec 2.0 base's
  shapes, without time masking) under bf16 autocast, batches of 2-8 clips of 1-12 s at 16 kHz,
  transcripts in proportion;
- ``segmentation_train_multiscale``: semantic segmentation (DeepLabV3 with a ResNet-50) trained
  on multi-scale crops, batches of 2-8 images of 256-640 pixels a side.
"""
import random

import torch


def _train(opt, steps, loss_of_step):
    """`steps` training steps under bf16 autocast: each takes the loss `loss_of_step()` makes
    (drawing its batch's shapes), then a backward pass, a step and gradients set to None."""
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of_step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def speech_ctc_train_varlen():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    torch.manual_seed(90); random.seed(90)
    # No time masking: it draws from NumPy's generator, and the masked indices' count would
    # change the sizes of a few allocations from one run to the next.
    cfg = Wav2Vec2Config(vocab_size=32, pad_token_id=0, ctc_loss_reduction="mean",
                         mask_time_prob=0.0)
    m = Wav2Vec2ForCTC(cfg).cuda().train()

    def step():
        b = random.randint(2, 8); seconds = random.uniform(1.0, 12.0)
        audio = torch.randn(b, int(16000 * seconds), device="cuda")
        # About 12 characters a second: well under the model's 50 frames a second.
        labels = torch.randint(1, cfg.vocab_size, (b, max(4, int(12 * seconds))), device="cuda")
        return m(audio, labels=labels).loss
    _train(torch.optim.AdamW(m.parameters(), lr=1e-4), 24, step)


def segmentation_train_multiscale():
    import torchvision
    torch.manual_seed(91); random.seed(91)
    m = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=21).cuda().train()

    def step():
        b = random.randint(2, 8); side = 32 * random.randint(8, 20)
        x = torch.randn(b, 3, side, side, device="cuda")
        y = torch.randint(0, 21, (b, side, side), device="cuda")
        return torch.nn.functional.cross_entropy(m(x)["out"], y)
    _train(torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9), 24, step)


NINTH_SET = {f.__name__: f for f in (speech_ctc_train_varlen, segmentation_train_multiscale)}
