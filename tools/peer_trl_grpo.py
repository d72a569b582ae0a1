"""The GRPO peer: TRL's GRPOTrainer with a PEFT LoRA adapter, on the bench workload.

The model is the bench's Gemma architecture (../shared/bench/workload.py: cpu-small or gemma-2b dims, random
weights) built directly in --dtype, LoRA r=--rank (alpha the same) on q_proj and v_proj, kept in float32 as PEFT
and TRL keep it. The prompts are the Dolly records' template up to "Response:\\n", as the preference peer cuts
them. Each step samples --num-generations completions of --max-completion-length tokens for each of
--prompts prompts with transformers' generate (TRL's path without vLLM, temperature 1, top-p 1), scores them with
a length reward (the share of the completion budget used), and trains one step of TRL's default loss (dapo,
beta 0, one iteration), gradient checkpointing off as the other peers run.

It prints one JSON line: generation tokens/s (completion tokens sampled, over the time of TRL's
_generate_and_score_completions), training tokens/s (prompt and completion tokens of the step, over the step's
time less the generation's), the step time, and the peak resident memory.

usage: python tools/peer_trl_grpo.py --data D.jsonl --spm T.spm [--config cpu-small|gemma-2b] [--prompts 2]
         [--num-generations 4] [--max-completion-length 64] [--steps 4] [--warmup 1] [--dtype float32|bfloat16]
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--spm", required=True)
p.add_argument("--workload", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench"),
               help="the folder of the bench's workload.py")  # fmt: skip
p.add_argument("--config", default="cpu-small")
p.add_argument("--prompts", type=int, default=2, help="prompts a step")
p.add_argument("--num-generations", type=int, default=4)
p.add_argument("--max-completion-length", type=int, default=64)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--warmup", type=int, default=1)
p.add_argument("--rank", type=int, default=4)
p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
a = p.parse_args()

sys.path.insert(0, os.path.abspath(a.workload))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GemmaConfig, GemmaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

cfg = workload.CONFIGS[a.config]
dtype = getattr(torch, a.dtype)

# The bench tokenizer's pieces and scores as a fast tokenizer (pad 0, eos 1, bos 2, as make_spm.py made them).
sp = spm.SentencePieceProcessor(model_file=a.spm)
unigram = Tokenizer(models.Unigram([(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())],
                                   unk_id=sp.unk_id(), byte_fallback=True))  # fmt: skip
unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
unigram.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, pad_token=sp.id_to_piece(0),
                                    eos_token=sp.id_to_piece(1), bos_token=sp.id_to_piece(2),
                                    unk_token=sp.id_to_piece(sp.unk_id()), padding_side="left")  # fmt: skip
vocab = workload.VOCAB[a.config] or sp.get_piece_size()

prompts = []
with open(a.data, encoding="utf-8") as f:
    for line in f:
        if line.strip():
            record = json.loads(line)
            text = workload.template(record)
            prompts.append(text[: len(text) - len(record["response"])])
dataset = Dataset.from_dict({"prompt": prompts})


def used_budget(completions, completion_ids, **_):
    """The share of the completion budget each completion used: a reward both sides compute the same way."""
    return [len(ids) / a.max_completion_length for ids in completion_ids]


torch.manual_seed(0)
torch.set_default_dtype(dtype)  # built in its dtype, as from_pretrained(dtype=...) loads it
base = GemmaForCausalLM(GemmaConfig(
    vocab_size=vocab, hidden_size=cfg["hidden_dim"], intermediate_size=cfg["intermediate_dim"] // 2,
    num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_query_heads"],
    num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], max_position_embeddings=8192,
    pad_token_id=0, bos_token_id=2, eos_token_id=1))  # fmt: skip
torch.set_default_dtype(torch.float32)

total = a.warmup + a.steps
timed = {"generate": 0.0, "step": 0.0, "sampled": 0, "trained": 0, "rewards": []}


class TimedGRPOTrainer(GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        if self.state.global_step >= a.warmup:
            timed["generate"] += time.perf_counter() - started
            timed["sampled"] += int(out["completion_mask"].sum())
            timed["trained"] += int(out["completion_mask"].sum() + out["prompt_mask"].sum())
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step >= a.warmup:
            timed["step"] += time.perf_counter() - started
        return loss


with tempfile.TemporaryDirectory() as out_dir:
    batch = a.prompts * a.num_generations
    args = GRPOConfig(
        output_dir=out_dir, max_steps=total, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length, temperature=1.0,
        top_p=1.0, learning_rate=1e-4, weight_decay=0.01, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", bf16=a.dtype == "bfloat16", fp16=False, gradient_checkpointing=False,
        logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        seed=0, disable_tqdm=True, shuffle_dataset=False,
    )  # fmt: skip
    lora = LoraConfig(r=a.rank, lora_alpha=a.rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = TimedGRPOTrainer(model=base, reward_funcs=used_budget, args=args, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=lora)  # fmt: skip
    wall_started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - wall_started

train_seconds = timed["step"] - timed["generate"]
print(json.dumps({
    "trainer": "trl-grpo", "config": a.config, "dtype": a.dtype, "prompts": a.prompts,
    "num_generations": a.num_generations, "max_completion_length": a.max_completion_length, "steps": a.steps,
    "step_s": round(timed["step"] / a.steps, 3), "generate_s": round(timed["generate"] / a.steps, 3),
    "generation_tokens_per_s": round(timed["sampled"] / timed["generate"], 1),
    "training_tokens_per_s": round(timed["trained"] / train_seconds, 1) if train_seconds > 0 else None,
    "train_wall_s": round(wall, 1), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
}))  # fmt: skip
