"""The GRPO peer `finetune bench --method grpo` measures beside finetune: TRL's GRPOTrainer with a PEFT LoRA.

Recipe `hf` of the bench under --method grpo. The same architecture as the
finetune rows (transformers' GemmaForCausalLM from the same sizes, random
weights, built directly in the row's dtype as peer.py builds it), LoRA of rank
r on q_proj and v_proj with alpha r, kept in float32 as PEFT and TRL keep it.
The prompts are the records' Dolly template up to the response, in file order
(no shuffle), as finetune's bench rows take them. Each step samples
--num-generations completions of --max-completion-length tokens for each of
--batch-size prompts with transformers' generate (TRL's path without vLLM,
temperature 1, top-p 1), scores them with the share of the completion budget
each used (finetune's `length:L` reward with L the budget is the same
function), and trains one step of TRL's defaults (loss dapo, beta 0, one
iteration), gradient checkpointing off.

Timed, after the warm-up steps: the whole training step (TRL samples inside
it), and within it `_generate_and_score_completions`. Generation tokens/s is
the completion tokens sampled over the latter; training tokens/s the prompt and
completion tokens over the rest.

It runs in the torch backend's worker and needs trl, transformers, peft and
datasets (`pip install 'finetune[hf,dev]'`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass


def available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in ("torch", "transformers", "peft", "trl", "datasets"))


def hf_tokenizer(spm_file: str):
    """A transformers fast tokenizer with the SentencePiece model's pieces and scores (pad 0, eos 1, bos 2, as
    Gemma's and the bench's tokenizers number them), left-padding as TRL pads prompts."""
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sp = sentencepiece.SentencePieceProcessor(model_file=spm_file)
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=sp.unk_id(), byte_fallback=True))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    unigram.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=unigram, pad_token=sp.id_to_piece(0), eos_token=sp.id_to_piece(1),
                                   bos_token=sp.id_to_piece(2), unk_token=sp.id_to_piece(sp.unk_id()),
                                   padding_side="left")  # fmt: skip


@dataclass(frozen=True)
class Steps:
    """What the peer trains, as the bench's workload says (bench.Workload's fields of the same names)."""

    rank: int
    batch_size: int  # prompts a step
    num_generations: int
    max_completion_length: int
    warmup: int
    steps: int


def train(base, tokenizer, prompts: list[str], steps: Steps, dtype: str) -> dict:
    """TRL's GRPOTrainer on `base` (a GemmaForCausalLM without an adapter) for warmup + steps steps; the timings."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rank, generations, max_completion_length = steps.rank, steps.num_generations, steps.max_completion_length
    warmup, prompts_per_step = steps.warmup, steps.batch_size
    timed = {"generate": 0.0, "step": 0.0, "sampled": 0, "trained": 0, "positions": 0, "losses": []}

    def used_budget(completions, completion_ids, **_):
        return [len(ids) / max_completion_length for ids in completion_ids]

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            if self.state.global_step >= warmup:
                timed["generate"] += time.perf_counter() - started
                completion, prompt = out["completion_mask"], out["prompt_mask"]
                timed["sampled"] += int(completion.sum())
                timed["trained"] += int(completion.sum() + prompt.sum())
                timed["positions"] += int(completion.numel() + prompt.numel())
            return out

        def training_step(self, model, inputs, num_items_in_batch=None):
            started = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            timed["losses"].append(float(loss))
            if self.state.global_step >= warmup:
                timed["step"] += time.perf_counter() - started
            return loss

    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, max_steps=warmup + steps.steps, per_device_train_batch_size=prompts_per_step * generations,
            gradient_accumulation_steps=1, num_generations=generations, max_completion_length=max_completion_length,
            temperature=1.0, top_p=1.0, learning_rate=1e-4, weight_decay=0.01, lr_scheduler_type="constant",
            warmup_steps=0, optim="adamw_torch", bf16=dtype == "bfloat16", fp16=dtype == "float16",
            gradient_checkpointing=False, logging_steps=10**6, save_strategy="no", report_to="none",
            use_cpu=not _cuda(), dataloader_num_workers=0, seed=0, disable_tqdm=True, shuffle_dataset=False,
        )  # fmt: skip
        lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        trainer = Timed(model=base, reward_funcs=used_budget, args=args, train_dataset=Dataset.from_dict(
            {"prompt": prompts}), processing_class=tokenizer, peft_config=lora)  # fmt: skip
        trainer.train()
    return timed


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
