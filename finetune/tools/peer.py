"""The peer `finetune bench` measures beside finetune: Hugging Face transformers + PEFT, as a TRL user trains.

Recipe `hf` of the bench: the same architecture (GemmaForCausalLM from the same
sizes, random weights), the same tokenized examples, the same LoRA (rank r on
q_proj and v_proj, alpha r) and AdamW, trained the way the strongest common
Hugging Face setup does it:

- the base built directly in the compute dtype (as `from_pretrained(dtype=...)`
  loads it): the one finetune's --precision auto picks on the device, so both
  sides train in the same dtype (on a CPU, `backend.cpu_precision`); the LoRA factors
  in float32 (PEFT's default), the forward under torch.autocast in that dtype,
  as TRL's `bf16=True`/`fp16=True`;
- examples packed best-fit decreasing into rows of seq_len, each row padded
  to seq_len as finetune's are (one shape every step: a compiled kernel is
  built once); position ids restart at 0 for each example and no attention
  mask is passed (TRL's padding-free packing), so no example attends to
  another;
- the loss over every token but each example's first, as TRL trains
  completion data by default.

How attention keeps the examples apart, and how the loss is computed, is the
setup (`setups`): the strongest installed first, as a TRL user on a GPU trains
it, each a row of the bench.

- `flash`: FlashAttention-2 (`flash_attn`, CUDA), transformers' varlen path,
  which reads the examples' bounds from the position ids;
- `flex`: torch's flex attention (CUDA) on the document mask transformers
  derives from the position ids (masking_utils.find_packed_sequence_indices): a
  block mask, so the fused kernel skips the blocks between examples. torch 2.13
  runs flex attention on a CPU forward only, so a CPU never trains with it;
- `sdpa`: torch's scaled_dot_product_attention on the 4-D block-diagonal mask
  transformers builds from the same position ids: the floor, on every device,
  and off the fused kernels on a GPU (an explicit mask).

On CUDA, where `liger_kernel` is installed, the strongest setup also computes
the loss with Liger's fused linear cross-entropy (the vocabulary projection and
the loss in chunks, no logits kept): Liger's Gemma patch on the model instance,
its loss path alone (LIGER), so the RMSNorm, GeGLU and rope stay transformers'.
The same attention without Liger is a row of its own, so what Liger buys is
measured, not assumed (on one H200 the flex+liger row trained 929 tokens/s
where a flex run without it had trained 31k). The sdpa floor keeps
transformers' loss, today's peer as it was.

It runs on the torch backend's process and needs transformers and peft
(`pip install 'finetune[hf]'`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from finetune.data import packing
from finetune.platform.errors import UserError

# Liger's Gemma patch, on the loss path alone: the fused linear cross-entropy, which gives the same loss as
# transformers' up to rounding; its RMSNorm, GeGLU and rope kernels, which round otherwise, stay off.
LIGER = dict(fused_linear_cross_entropy=True, cross_entropy=False, rope=False, rms_norm=False, geglu=False)
CHOICES = ("auto", "flash", "flex", "sdpa")  # --peer


@dataclass(frozen=True)
class Setup:
    """How the peer keeps packed examples apart and computes its loss: one hf row of the bench."""

    attention: str  # flash, flex or sdpa (CHOICES)
    liger: bool = False

    @classmethod
    def named(cls, name: str) -> Setup:
        """The setup `name` names: "flex+liger" is Setup("flex", True)."""
        attention, _, liger = name.partition("+")
        return cls(attention, liger == "liger")

    @property
    def name(self) -> str:
        return self.attention + ("+liger" if self.liger else "")

    @property
    def implementation(self) -> str:
        """transformers' attn_implementation."""
        return {"flash": "flash_attention_2", "flex": "flex_attention", "sdpa": "sdpa"}[self.attention]

    def settings(self, dtype: str) -> str:
        """The bench row's settings: its attention, its loss, its base's dtype."""
        attention = {
            "flash": "padding-free on FlashAttention-2 (varlen)",
            "flex": "padding-free on flex attention (document mask)",
            "sdpa": "packed, block-diagonal mask on sdpa",
        }[self.attention]
        loss = "Liger fused linear CE" if self.liger else "transformers' CE"
        return f"transformers + PEFT, {attention}, {loss}, {dtype} base, loss on every token"


def _installed(module: str) -> bool:
    """Whether `module` imports here (the probe the tests replace)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def available() -> bool:
    return all(_installed(name) for name in ("torch", "transformers", "peft"))


def setups(device: str, half: bool = True, choice: str = "auto") -> list[Setup]:
    """The setups the bench trains on `device` (cuda or cpu), the strongest first; with `choice` auto, the same
    attention without Liger where Liger is installed, then the sdpa floor where it differs. half: the base
    computes in bf16 or float16 (FlashAttention-2 takes no float32). A `choice` not installed here is a
    UserError saying what it needs."""
    cuda = device == "cuda"
    liger = cuda and _installed("liger_kernel")
    present = {
        "flash": cuda and half and _installed("flash_attn"),
        "flex": cuda and _installed("torch.nn.attention.flex_attention"),
        "sdpa": True,
    }
    if choice == "auto":
        best = next(attention for attention in ("flash", "flex", "sdpa") if present[attention])
        found = [Setup(best, True)] if liger else []
        return found + [Setup(best)] + ([Setup("sdpa")] if best != "sdpa" else [])
    if choice not in CHOICES:
        raise UserError(f"unknown --peer {choice!r}; choose from {', '.join(CHOICES)}")
    if not present[choice]:
        needs = {
            "flash": "the flash_attn package, a CUDA device and a 16-bit base (pip install flash-attn)",
            "flex": "torch's flex attention and a CUDA device (torch trains it on no CPU)",
        }[choice]
        raise UserError(f"--peer {choice} is not installed here ({device}): it needs {needs}")
    return [Setup(choice, liger and choice != "sdpa")]


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build(config: dict, vocabulary: int, rank: int, dtype: str = "bfloat16", setup: Setup = Setup("sdpa")):
    """GemmaForCausalLM with the GemmaBackbone `config`'s sizes, random weights in `dtype`, LoRA on q and v,
    attention and loss as `setup` says."""
    from peft import LoraConfig, get_peft_model

    model = base(config, vocabulary, dtype, setup.implementation)
    if setup.liger:  # on the instance, before PEFT wraps it: its forward computes the loss fused
        from liger_kernel.transformers import apply_liger_kernel_to_gemma

        apply_liger_kernel_to_gemma(model=model, **LIGER)
    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, lora).train()  # PEFT keeps the factors float32


def base(config: dict, vocabulary: int, dtype: str = "bfloat16", attention: str = "sdpa"):
    """GemmaForCausalLM with the GemmaBackbone `config`'s sizes, random weights in `dtype`, on the device;
    `attention` is transformers' attn_implementation."""
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    hf_config = GemmaConfig(
        vocab_size=vocabulary,
        hidden_size=config["hidden_dim"],
        intermediate_size=config["intermediate_dim"] // 2,  # keras-hub's intermediate_dim counts gate and up
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        attn_implementation=attention,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # no float32 copy of a bf16 base is ever made
    try:
        with torch.device(device()):  # initialized where it trains: gemma-2b's takes 130 s on a CPU, 1 s on an H200
            model = GemmaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    return model


def batches(examples, seq_len: int, batch_size: int) -> list[tuple[dict, int]]:
    """(inputs, trained tokens) per step: packed rows, batch_size at a time, each row padded to seq_len.

    One width for every step, as finetune's rows have: a compiled attention kernel (flex attention, which
    transformers compiles with torch.compile) is built for one shape, not again for each batch's longest row. A
    row's padded tail is one more document (its position ids restart at 0) with no trained token."""
    import torch

    sequences = [example.token_ids[:seq_len] for example in examples]
    rows = [[sequences[i] for i in row] for row in packing.best_fit_decreasing([len(s) for s in sequences], seq_len)]
    out = []
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        group = rows[start : start + batch_size]
        width = seq_len
        ids = torch.zeros((len(group), width), dtype=torch.long)
        positions = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        trained = 0
        for r, row in enumerate(group):
            offset = 0
            for sequence in row:
                n = len(sequence)
                ids[r, offset : offset + n] = torch.tensor(sequence)
                positions[r, offset : offset + n] = torch.arange(n)
                labels[r, offset + 1 : offset + n] = ids[r, offset + 1 : offset + n]  # not across examples
                offset += n
                trained += n - 1
            positions[r, offset:] = torch.arange(width - offset)  # the padding: a document of its own, untrained
        inputs = {"input_ids": ids, "position_ids": positions, "labels": labels}
        out.append(({name: tensor.to(device()) for name, tensor in inputs.items()}, trained))
    return out


def train(model, steps: list[tuple[dict, int]], warmup: int, timed: int, dtype: str = "bfloat16") -> dict:
    """Warm-up steps, then `timed` timed steps; the tokens counted are each example's trained targets. Each timed
    step's seconds are kept too: a step far slower than the others (a recompile, a kernel's autotuning) shows."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    losses, step_seconds, tokens, kind = [], [], 0, device()
    for step in range(warmup + timed):
        inputs, trained = steps[step % len(steps)]
        started = time.perf_counter()
        with torch.autocast(kind, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            loss = model(**inputs, use_cache=False).loss  # no cache: the position ids alone mark the examples
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # float() waits for the device
        if step >= warmup:
            step_seconds.append(time.perf_counter() - started)
            tokens += trained
    return {"losses": losses, "seconds": sum(step_seconds), "tokens": tokens, "step_seconds": step_seconds}
