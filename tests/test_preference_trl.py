"""finetune's preference losses against TRL's own, on the same pairs and token ids, in float32.

A tiny DPO run is exported as transformers (`--format hf --base`) and PEFT (`--format peft`). On the PEFT model,
TRL's DPOTrainer._compute_loss (its concatenated chosen-then-rejected forward, the reference with the adapter
disabled), ORPOTrainer.odds_ratio_loss and CPOTrainer.cpo_loss (loss_type "simpo", cpo_alpha 0) give each pair's
log-probabilities and loss; finetune's PreferenceView on the run's adapter must give the same within 1e-4.
"""

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import BACKEND, float32_policy, invoke
from test_preference_runs import learnable_pairs

import finetune
from finetune.config import TrainConfig
from finetune.data import batching, formats, pair_batches, pairs, templates
from finetune.methods import preference, registry
from finetune.model import builder, presets

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="TRL is checked in the PyTorch suite")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(run, hf --base directory, peft directory, the pairs as finetune tokenized them)."""
    pytest.importorskip("trl", reason="the losses are checked against TRL: pip install 'finetune[dev]'")
    root = tmp_path_factory.mktemp("trl")
    data = root / "pairs.jsonl"
    data.write_text("".join(__import__("json").dumps(r) + "\n" for r in learnable_pairs(24)), encoding="utf-8")
    out = root / "run"
    flags = [
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--precision",
        "float32",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--lr",
        "1e-2",
        "--max-steps",
        "4",
        "--method",
        "dpo",
        "--data",
        data,
        "--set",
        "train.samples=0",
    ]
    for args in (["gemma", *flags, "--output", out], ["export", "--run", out, "--format", "hf", "--base", "--output",
                 root / "base"], ["export", "--run", out, "--format", "peft", "--output", root / "peft"]):  # fmt: skip
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    records, _ = formats.read(str(data))
    made, _ = pairs.pairs(records[:6], templates.get("none"), presets.tiny_tokenizer(), 64)
    return out, root / "base", root / "peft", made


def objective_of(method: str):
    """The method's objective with its default constants (dpo, ipo, orpo 0.1; simpo 2.0 and gamma 0.5)."""
    return registry.get(method).objective(TrainConfig(method=method))


def finetune_outputs(run, made, objective):
    """Each pair's (pair_batches.COLUMNS) from the run's adapter, DPO's reference scored with LoRA off."""
    with float32_policy():
        lm = finetune.load(run)
        arrays = pair_batches.pad(made, 64, objective.whole_chosen)
        batches = pair_batches.Batches(arrays, 3, batching.Feed(inputs=builder.input_names(lm)))
        if objective.needs_reference:
            with builder.lora_off(lm):
                preference.reference_logps(builder.objective_view(lm, objective), batches)
        return np.concatenate([v for _, v in preference.pair_outputs(builder.objective_view(lm, objective), batches)])


def trl_batch(pair):
    """TRL's concatenated batch of one pair: chosen then rejected, right-padded, completion_mask on the answer."""
    import torch

    sides = [pair.chosen, pair.rejected]
    length = max(len(s.token_ids) for s in sides)
    ids = torch.zeros((2, length), dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, side in enumerate(sides):
        n = len(side.token_ids)
        ids[row, :n] = torch.tensor(side.token_ids)
        attention[row, :n] = 1
        completion[row, :n] = torch.tensor(side.weights, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


@pytest.fixture(scope="module")
def peft_model(exported):
    import peft
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    _, base_dir, peft_dir, _ = exported
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype="float32")
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # as DPOTrainer does
    model = peft.PeftModel.from_pretrained(base, peft_dir)
    model.eval()
    return model


@pytest.mark.parametrize("method, loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_match_trl_s_dpo_trainer(method, loss_type, exported, peft_model):
    import accelerate
    import torch
    from trl import DPOTrainer

    run, _, _, made = exported
    ours = finetune_outputs(run, made, objective_of(method))
    # The smallest DPOTrainer _compute_loss runs on: sigmoid loss, the reference from the adapter disabled.
    shell = object.__new__(DPOTrainer)
    shell.__dict__.update(
        model=peft_model,
        accelerator=accelerate.Accelerator(cpu=True),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=False,
        ref_model=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=0.1,
        use_weighting=False,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    for index, pair in enumerate(made):
        with torch.no_grad():
            loss = float(DPOTrainer._compute_loss(shell, peft_model, trl_batch(pair), False))
        logged = shell._metrics["eval"]
        assert ours[index, 0] == pytest.approx(loss, abs=TOLERANCE)
        assert ours[index, 5] == pytest.approx(logged["logps/chosen"][-1], abs=TOLERANCE)
        assert ours[index, 6] == pytest.approx(logged["logps/rejected"][-1], abs=TOLERANCE)
        assert ours[index, 1] == pytest.approx(logged["rewards/chosen"][-1], abs=TOLERANCE)
    assert np.abs(ours[:, 1]).max() > 1e-3  # four steps moved the policy off the reference: a real comparison


def average_logps(model, pair, get_batch_logps):
    import torch

    batch = trl_batch(pair)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return get_batch_logps(logits, labels, average_log_prob=True)


def orpo_batch(pairs):
    """ORPOTrainer's batch of `pairs`: chosen_ and rejected_ input_ids, attention_mask and labels (-100 on the prompt
    and the padding), right-padded."""
    import torch

    out = {}
    length = max(len(getattr(p, side).token_ids) for p in pairs for side in ("chosen", "rejected"))
    for side in ("chosen", "rejected"):
        ids = torch.zeros((len(pairs), length), dtype=torch.long)
        attention, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
        for row, pair in enumerate(pairs):
            example = getattr(pair, side)
            n = len(example.token_ids)
            ids[row, :n] = torch.tensor(example.token_ids)
            attention[row, :n] = 1
            answer = torch.tensor(example.weights) > 0
            labels[row, :n] = torch.where(answer, ids[row, :n], -100)
        out.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_labels": labels})
    return out


def test_orpo_and_simpo_match_trl_s(exported, peft_model):
    """Each pair's log-probabilities, ORPO's odds-ratio term and SimPO's loss; and ORPO's loss of a batch, its NLL
    over the chosen sequences' every token (prompt and answer, a token mean over the batch) included, as
    ORPOTrainer.get_batch_loss_metrics computes it."""
    import accelerate
    import torch
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    run, _, _, made = exported
    device = SimpleNamespace(device="cpu")
    orpo = finetune_outputs(run, made, objective_of("orpo"))
    simpo = finetune_outputs(run, made, objective_of("simpo"))
    cpo_shell = SimpleNamespace(beta=2.0, simpo_gamma=0.5, label_smoothing=0.0, loss_type="simpo", alpha=0.0,
                                accelerator=device)  # fmt: skip
    for index, pair in enumerate(made):
        chosen, rejected = average_logps(peft_model, pair, ORPOTrainer.get_batch_logps)
        assert orpo[index, 5] == pytest.approx(float(chosen), abs=TOLERANCE)
        assert orpo[index, 6] == pytest.approx(float(rejected), abs=TOLERANCE)
        losses = CPOTrainer.cpo_loss(cpo_shell, chosen[None], rejected[None])[0]  # cpo_alpha 0: SimPO alone
        assert simpo[index, 0] == pytest.approx(float(losses[0]), abs=TOLERANCE)
    # The whole loss, on the batches finetune_outputs scored (3 pairs each): ORPOTrainer's own forward and loss.
    trainer = object.__new__(ORPOTrainer)
    trainer.__dict__.update(is_encoder_decoder=False, aux_loss_enabled=False, padding_value=0,
                            label_pad_token_id=-100, beta=0.1, accelerator=accelerate.Accelerator(cpu=True))  # fmt: skip
    for start in (0, 3):
        with torch.no_grad():
            loss, logged = ORPOTrainer.get_batch_loss_metrics(trainer, peft_model, orpo_batch(made[start : start + 3]))
        assert orpo[start : start + 3, 0].mean() == pytest.approx(float(loss), abs=TOLERANCE)
        assert logged["nll_loss"] > 0.5  # the prompt's tokens are in it: a real part of the loss
