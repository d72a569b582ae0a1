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
  only to the longest row of its batch; position ids restart at 0 for each
  example and no attention mask is passed, so transformers builds a
  block-diagonal causal mask (TRL's packing without padding);
- the loss over every token but each example's first, as TRL trains
  completion data by default.

It runs on the torch backend's process and needs transformers and peft
(`pip install 'finetune[hf]'`).
"""

from __future__ import annotations

import time

from finetune.data import packing


def available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "peft"))


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build(config: dict, vocabulary: int, rank: int, dtype: str = "bfloat16"):
    """GemmaForCausalLM with the GemmaBackbone `config`'s sizes, random weights in `dtype`, LoRA on q and v."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base(config, vocabulary, dtype), lora).train()  # PEFT keeps the factors float32


def base(config: dict, vocabulary: int, dtype: str = "bfloat16"):
    """GemmaForCausalLM with the GemmaBackbone `config`'s sizes, random weights in `dtype`, on the device."""
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
        attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # no float32 copy of a bf16 base is ever made
    try:
        model = GemmaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device())


def batches(examples, seq_len: int, batch_size: int) -> list[tuple[dict, int]]:
    """(inputs, trained tokens) per step: packed rows, batch_size at a time, each padded to its batch's longest."""
    import torch

    sequences = [example.token_ids[:seq_len] for example in examples]
    rows = [[sequences[i] for i in row] for row in packing.best_fit_decreasing([len(s) for s in sequences], seq_len)]
    out = []
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        group = rows[start : start + batch_size]
        width = max(sum(len(s) for s in row) for row in group)
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
        inputs = {"input_ids": ids, "position_ids": positions, "labels": labels}
        out.append(({name: tensor.to(device()) for name, tensor in inputs.items()}, trained))
    return out


def train(model, steps: list[tuple[dict, int]], warmup: int, timed: int, dtype: str = "bfloat16") -> dict:
    """Warm-up steps, then `timed` timed steps; the tokens counted are each example's trained targets."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    losses, seconds, tokens, kind = [], 0.0, 0, device()
    for step in range(warmup + timed):
        inputs, trained = steps[step % len(steps)]
        started = time.perf_counter()
        with torch.autocast(kind, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            loss = model(**inputs, use_cache=False).loss  # use_cache=False: the packed mask needs no cache
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # float() waits for the device
        if step >= warmup:
            seconds += time.perf_counter() - started
            tokens += trained
    return {"losses": losses, "seconds": seconds, "tokens": tokens}
