"""A ninth set of workloads for ``h200_workloads.py``, not recorded yet: kinds of job no trace of
``traces/h200/`` is, to be recorded after the rules of the ``default`` policy were last changed
and held out in ``traces/split.json``. Until their traces are in ``traces/h200/``, they stay out of
``torch_models.H200_FILES`` (whose test pairs every workload there with its trace). Models are
built from configs with random weights; shapes come from fixed seeds.

- ``speech_ctc_train_varlen``: speech recognition trained with a CTC loss (wav2vec 2.0 base's
  shapes, without time masking) under bf16 autocast, batches of 2-8 clips of 1-12 s at 16 kHz,
  transcripts in proportion;
- ``segmentation_train_multiscale``: semantic segmentation (DeepLabV3 with a ResNet-50) trained
  on multi-scale crops, batches of 2-8 images of 256-640 pixels a side;
- ``chunked_prefill_generate``: a Llama-style model (grouped-query attention) that reads prompts
  of 512-6,144 tokens in chunks of 256-1,024 (the last one the rest; a growing key-value cache),
  then decodes 16-64 tokens greedily, batches of 1-4.
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


def chunked_prefill_generate():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(92); random.seed(92)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=8192)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for _ in range(10):
            b = random.randint(1, 4); prompt = random.randint(512, 6144)
            ids = torch.randint(0, cfg.vocab_size, (b, prompt), device="cuda")
            cache, at = None, 0
            while at < prompt:
                n = min(random.choice((256, 512, 1024)), prompt - at)
                out = m(ids[:, at:at + n], past_key_values=cache, use_cache=True)
                cache, at = out.past_key_values, at + n
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(random.randint(16, 64)):
                out = m(token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token = out.logits[:, -1:].argmax(-1)
            del cache, out, token
    torch.cuda.synchronize()


NINTH_SET = {f.__name__: f for f in (speech_ctc_train_varlen, segmentation_train_multiscale,
                                     chunked_prefill_generate)}
