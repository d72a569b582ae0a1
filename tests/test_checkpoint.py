"""Never lose a run: kill and resume, torn checkpoints, a full disk (checkpoint.py).

Each test runs the tiny model on this process' backend. Runs that must die are
subprocesses (tests/fault_run.py sends the signal right after a checkpoint);
the rest run in-process through the CLI. What stops a run (signals, the time
limit, NaN, out of memory) is test_loop.py's; what guards its directory is
test_outputs.py's.
"""

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from conftest import BACKEND, SHORT, _history, invoke, make_records, run_with_fault, train, train_losses, write_jsonl

import finetune
from finetune import config
from finetune.methods import registry
from finetune.training import checkpoint, outputs, runs


def adapter_arrays(path):
    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def metrics(out):
    return json.loads((out / "metrics.json").read_text())


def test_a_killed_run_resumes_to_the_same_adapter(uninterrupted, tmp_path):
    """SIGKILL right after the step-4 checkpoint, then --resume alone: the same adapter, bit for bit."""
    out = tmp_path / "killed"
    killed = run_with_fault(out, "SIGKILL", 4)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "metrics.json").exists()
    assert [c.step for c in checkpoint.find(out)] == [2, 4]
    assert runs.describe(out)["state"] == "checkpointed"

    result = invoke("gemma", "--resume", "--output", out)  # every other setting comes from the checkpoint
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert "resuming" in result.output and "step 4/8" in result.output
    table = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for name in ("template", "precision", "batch_size"):  # the checkpoint's, as the table says
        assert table[name].endswith("resumed: as the run started"), table[name]
    whole, resumed = adapter_arrays(uninterrupted / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert whole.keys() == resumed.keys() and len(whole) > 1
    for name in whole:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)
    assert train_losses(out) == train_losses(uninterrupted)
    assert metrics(out)["eval_loss"] == metrics(uninterrupted)["eval_loss"]
    assert metrics(out)["eval_loss_before"] == metrics(uninterrupted)["eval_loss_before"]
    assert metrics(out)["resumed_from_step"] == 4 and metrics(out)["steps"] == 8
    assert runs.describe(out)["state"] == "finished"


@pytest.mark.backend_neutral
def test_resume_may_train_further_but_not_change_the_recipe(uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "extend"
    train(out, "--max-steps", "4")
    for flags, named in [
        (["--rank", "8"], "lora.rank=4"),
        (["--target", "query,key"], "lora.targets"),
        (["--template", "alpaca"], "data.template"),
        (["--seq-len", "48"], "model.seq_len"),
        (["--lr", "0.5"], "train.learning_rate"),
    ]:
        result = invoke("gemma", "--resume", *flags, "--output", out)
        assert result.exit_code == 2 and named in result.stderr, (flags, result.output)
    resumed = train(out, "--resume", "--max-steps", "8")
    assert metrics(out)["steps"] == 8 and train_losses(out) == train_losses(uninterrupted)
    assert "planned again" not in resumed.output  # a constant rate past the warmup: no step's rate changes
    # Finished: a job restarted from the top repeats its --resume, which ends as its first attempt did, exit 0.
    published = {name: (out / name).read_bytes() for name in ("metrics.json", "adapter.lora.h5", "history.csv")}
    result = invoke("gemma", "--resume", "--output", out)
    assert result.exit_code == 0, result.output
    assert "has already trained 8 of 8 steps and is finished: nothing to do; raise --epochs or" in result.output
    assert published == {name: (out / name).read_bytes() for name in published}
    other = next(b for b in config.BACKENDS if b != BACKEND)
    monkeypatch.setenv("KERAS_BACKEND", other)  # the checkpoint's backend wins, and the run says so
    result = invoke("gemma", "--resume", "--epochs", "1", "--output", out)  # the checkpoint's --max-steps 8 goes
    assert result.exit_code == 0 and "1 epochs of 14 steps" in result.output, result.output + result.stderr
    assert f"resuming on {BACKEND}, the backend the run trained on; KERAS_BACKEND={other} is not used" in result.stderr
    assert metrics(out)["steps"] == 14


@pytest.mark.backend_neutral
def test_a_resume_that_trains_further_plans_a_decaying_schedule_again_and_says_so(tmp_path):
    """A cosine decay and a --warmup-ratio are planned over the run's steps: raised from 4 to 8, they stretch over
    8 from step 5 on (as transformers' scheduler rebuilt for the new total), and the run says what step 5 gets."""
    out = tmp_path / "cosine"
    train(out, "--max-steps", "4", "--lr-schedule", "cosine", "--warmup-ratio", "0.25", "--lr", "0.01")
    result = train(out, "--resume", "--max-steps", "8")
    said = ("the cosine learning-rate schedule is planned again over 8 steps, not the 4 its checkpoint planned, its "
            "warmup over 2 steps, not 1: step 5 trains at 0.75x the peak rate, where that plan gave 0x")  # fmt: skip
    assert said in result.output, result.output
    rates = [float(row["learning_rate"]) for row in _history(out) if row["learning_rate"]]
    # step 4 ended the first plan at 0.01 x (1 + cos(pi x 2/3)) / 2; step 5 is 0.01 x (1 + cos(pi x 2/6)) / 2
    assert rates[3] == pytest.approx(0.0025) and rates[4] == pytest.approx(0.0075), rates


@pytest.mark.backend_neutral
def test_resume_to_an_earlier_end(tmp_path):
    """A stop at step 3 (mid-epoch, no evaluation yet) resumed with --max-steps 3 evaluates and publishes;
    an end before the checkpoint is refused; a recipe's `batch_size: null` keeps the run's batch."""
    out = tmp_path / "stopped"
    assert run_with_fault(out, "SIGTERM", 2).returncode == 143
    result = invoke("gemma", "--resume", "--max-steps", "2", "--output", out)
    assert result.exit_code == 2 and "trained 3 steps, more than the 2" in result.stderr
    # A sample asked for on resume (the run started with none) is generated after training, with none before.
    train(out, "--resume", "--max-steps", "3", "--set", "train.batch_size=null", "--set", "train.samples=1")
    assert metrics(out)["steps"] == 3 and metrics(out)["batch_size"] == 2
    samples = (out / "samples.md").read_text()
    assert samples.count("## Sample") == 1 and "(none: the run was resumed asking for more samples" in samples, samples
    assert samples.split("**After training**")[1].strip().startswith("````text"), samples
    rows = _history(out)
    assert rows[-1]["step"] == "3" and rows[-1]["eval_loss"]


@pytest.mark.backend_neutral
def test_an_overwrite_killed_before_publishing_is_published_by_resume(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    with monkeypatch.context() as patch:
        patch.setattr(outputs, "publish", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        result = invoke("gemma", *SHORT, "--overwrite", "--seed", "3", "--output", out)
    assert result.exit_code == 2 and "rerun with --resume" in result.stderr
    assert metrics(out)["steps"] == 2  # the old run's results are still there
    train(out, "--resume")
    assert metrics(out)["steps"] == 8 and yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 3


@pytest.mark.backend_neutral
def test_resume_of_a_finished_run_without_checkpoints_is_refused_unless_overwrite_replaces_it(tmp_path):
    """--resume --overwrite is the one command a job restarted from the top can repeat: it resumes a checkpoint
    when there is one, and otherwise replaces what is there."""
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    shutil.rmtree(out / "checkpoints")
    before = metrics(out)
    result = invoke("gemma", *SHORT, "--resume", "--max-steps", "2", "--output", out)
    assert result.exit_code == 2 and "finished run without checkpoints; pass --overwrite" in result.stderr
    assert metrics(out) == before
    result = invoke("gemma", *SHORT, "--resume", "--overwrite", "--max-steps", "2", "--output", out)
    assert result.exit_code == 0 and "replacing the finished one (--overwrite)" in result.output, result.output
    assert metrics(out)["run_id"] != before["run_id"] and [c.step for c in checkpoint.find(out)] == [2]


@pytest.mark.backend_neutral
def test_resume_refuses_data_that_changed(tmp_path):
    data = tmp_path / "data.jsonl"
    records = [{"instruction": f"Say {i}.", "response": f"{i} it is."} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    killed = run_with_fault(out, "SIGKILL", 2, "--data", data)
    assert killed.returncode == -9
    records[5]["response"] = "changed"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = invoke("gemma", "--resume", "--output", out)
    assert result.exit_code == 2 and "differ from those the checkpoint was trained on" in result.stderr


@pytest.mark.backend_neutral
def test_resume_refuses_held_out_records_that_changed(tmp_path):
    """The scores before and after training compare only on the same held-out records: a resume that would
    evaluate on another --eval-data file, or on the checkpoint's file changed since, exits 2 and leaves the run
    as it was."""
    data = write_jsonl(tmp_path / "train.jsonl", make_records(20))
    held = write_jsonl(tmp_path / "dev.jsonl", make_records(26)[20:])
    out = tmp_path / "run"
    train(out, "--data", data, "--eval-data", held, "--eval-fraction", "0", "--max-steps", "2")
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    other = write_jsonl(tmp_path / "other.jsonl", make_records(30)[24:])
    result = invoke("gemma", "--resume", "--eval-data", other, "--max-steps", "4", "--output", out)
    assert result.exit_code == 2 and f"--eval-data {other} differ from those its checkpoint" in result.stderr
    kept = held.read_bytes()
    write_jsonl(held, make_records(27)[21:])  # the checkpoint's own --eval-data file, edited
    result = invoke("gemma", "--resume", "--max-steps", "4", "--output", out)
    assert result.exit_code == 2 and f"--eval-data {held} differ from those its checkpoint" in result.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    held.write_bytes(kept)
    train(out, "--resume", "--max-steps", "4")


@pytest.mark.backend_neutral
def test_resume_refuses_another_lora_variant_or_regularizer_naming_the_key(tmp_path):
    """Dropout, NEFTune, rsLoRA, DoRA, LoRA+ and new tokens change what the steps compute (or the variables the
    checkpoint holds): a resume that asks for another of them exits 2 naming the key, and touches nothing. A
    checkpoint written before these were checked (no key) resumes as it was."""
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for flags, key in (
        (["--lora-dropout", "0.1"], "lora.dropout"),
        (["--neftune-alpha", "5"], "train.neftune_alpha"),
        (["--rslora"], "lora.rslora"),
        (["--dora"], "lora.dora"),
        (["--lora-plus-ratio", "4"], "lora.plus_ratio"),
        (["--add-tokens", "<x>"], "model.add_tokens"),
    ):
        result = invoke("gemma", "--resume", "--max-steps", "3", "--output", out, *flags)
        assert result.exit_code == 2 and f"trained with {key}=" in result.stderr, (flags, result.stderr)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    found = checkpoint.latest(out)
    state = found.state()
    cfg = config.load(None, {}, base=state["config"])
    assert state["config"]["lora"].pop("dropout") == 0.0
    (found.path / "state.json").write_text(json.dumps(state))  # as a checkpoint from before wrote it
    checkpoint.check_compatible(found, cfg, (state["data_fingerprint"], state.get("eval_data_fingerprint")), out)


@pytest.mark.backend_neutral
def test_a_checkpoint_with_a_setting_this_version_lacks_is_refused_naming_the_version_that_wrote_it(tmp_path):
    """A run checkpointed by a newer finetune, resumed by this one: exit 2 naming both versions, nothing touched."""
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    found = checkpoint.latest(out)
    state = found.state()
    assert state["finetune_version"] == finetune.__version__
    state["config"]["train"]["new_knob"] = 3
    state["finetune_version"] = "9.9.0"
    weights, optimizer, _ = checkpoint.load(found)
    shutil.rmtree(found.path)
    checkpoint.save(out, found.run_id, found.step, weights, optimizer, state)  # whole, with its checksums
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = invoke("gemma", "--resume", "--max-steps", "3", "--output", out)
    assert result.exit_code == 2, result.output
    said = f"its checkpoint was written by finetune 9.9.0, and this version ({finetune.__version__}) cannot take"
    assert said in result.stderr and "new_knob" in result.stderr, result.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


@pytest.mark.one_backend  # numpy arrays and files only
def test_a_crash_between_writing_and_renaming_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    weights, optimizer = [np.arange(6, dtype=np.float32)], [np.ones(3, np.float32)]
    checkpoint.save(tmp_path, "abc", 2, weights, optimizer, {"step": 2})

    def crash(*args):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(checkpoint.os, "rename", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, "abc", 4, [w + 1 for w in weights], optimizer, {"step": 4})
    found = checkpoint.latest(tmp_path)
    assert found.step == 2
    loaded, _, state = checkpoint.load(found)
    np.testing.assert_array_equal(loaded[0], weights[0])
    assert state == {"step": 2}


@pytest.mark.one_backend  # numpy arrays and files only
def test_a_prune_killed_part_way_leaves_nothing_the_next_prune_keeps(tmp_path, monkeypatch):
    """A checkpoint half deleted would have no manifest: find() skips it, so no later prune would remove it."""
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, "abc", step, [np.full(4, step, np.float32)], [], {"step": step})
    real = shutil.rmtree

    def killed(path, ignore_errors=False):  # the manifest goes, then the process dies
        (Path(path) / "manifest.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(tmp_path, "abc", 2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    assert [c.step for c in checkpoint.find(tmp_path)] == [4, 6] and checkpoint.problems(tmp_path) == []
    checkpoint.prune(tmp_path, "abc", 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004-abc", "step-00000006-abc"]


@pytest.mark.one_backend  # numpy arrays and files only
def test_a_torn_or_corrupt_checkpoint_is_never_loaded(tmp_path):
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, "abc", step, [np.full(4, step, np.float32)], [], {"step": step})
    newest = checkpoint.find(tmp_path)
    (newest[-1].path / "manifest.json").unlink()  # killed before the manifest: torn
    data = bytearray((newest[-2].path / "weights.npz").read_bytes())
    data[-20] ^= 0xFF  # same size, flipped bits: only the checksum sees it
    (newest[-2].path / "weights.npz").write_bytes(bytes(data))
    (tmp_path / "checkpoints" / ".tmp-step-00000008-abc-1").mkdir()  # a crash mid-write
    found = checkpoint.latest(tmp_path)
    assert found.step == 2
    assert checkpoint.load(found)[0][0][0] == 2
    skipped = checkpoint.problems(tmp_path, after=found.step)
    assert len(skipped) == 2 and "checksum" in skipped[0] and "not a whole checkpoint" in skipped[1], skipped


@pytest.mark.backend_neutral
def test_a_resume_past_a_damaged_checkpoint_says_so_and_trains_its_steps_again(uninterrupted, tmp_path):
    """The newest checkpoint damaged (a disk fault): --resume continues from the one before, saying which one it
    skipped and why, and ends where the uninterrupted run did."""
    out = tmp_path / "damaged"
    train(out, "--max-steps", "4")
    assert [c.step for c in checkpoint.find(out)] == [2, 4]
    weights = checkpoint.find(out)[-1].path / "weights.npz"
    data = bytearray(weights.read_bytes())
    data[-20] ^= 0xFF
    weights.write_bytes(bytes(data))
    resumed = train(out, "--resume", "--max-steps", "8")
    assert "a later checkpoint cannot be loaded" in resumed.output and "does not match its checksum" in resumed.output
    assert "resuming from step 2, so the steps after it train again" in resumed.output
    assert metrics(out)["resumed_from_step"] == 2 and train_losses(out) == train_losses(uninterrupted)


@pytest.mark.backend_neutral
def test_only_the_newest_checkpoints_are_kept(tmp_path):
    out = tmp_path / "kept"
    train(out, "--keep-checkpoints", "1")
    assert [c.step for c in checkpoint.find(out)] == [8]


@pytest.mark.backend_neutral
def test_a_run_that_fails_while_writing_its_results_is_published_by_resume(uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "late"

    def disk_full(path, metrics):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(outputs, "write_metrics", disk_full)
        result = invoke("gemma", *SHORT, "--output", out)
    assert result.exit_code == 2 and "could not write the results" in result.stderr and "--resume" in result.stderr
    assert not (out / "metrics.json").exists() and checkpoint.latest(out).step == 8
    train(out, "--resume")
    assert metrics(out)["steps"] == 8 and train_losses(out) == train_losses(uninterrupted)
    whole, resumed = adapter_arrays(uninterrupted / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    for name in whole:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)


@pytest.mark.backend_neutral
def test_a_full_disk_mid_run_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "full"
    save = checkpoint.save

    def disk_full_at_step_4(run_dir, run_id, step, *args, **kwargs):
        if step == 4:
            raise OSError(28, "No space left on device")
        return save(run_dir, run_id, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", disk_full_at_step_4)
    result = invoke("gemma", *SHORT, "--output", out)
    assert result.exit_code == 2, result.output
    assert "No space left on device" in result.stderr and "step 2 is intact" in result.stderr
    assert checkpoint.latest(out).step == 2 and not (out / "metrics.json").exists()


def test_a_run_with_lora_s_variants_resumes_to_the_same_adapter(tmp_path):
    """DoRA's magnitudes are checkpointed with A and B, and LoRA dropout's and NEFTune's seeds with them: stopped
    at step 4 and resumed, the run ends at the whole run's adapter and losses, bit for bit."""
    variants = ["--dora", "--lora-dropout", "0.1", "--neftune-alpha", "5", "--lora-plus-ratio", "4"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, *variants)
    train(split, *variants, "--max-steps", "4")
    train(split, "--resume", "--max-steps", "8")
    expected, resumed = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(split / "adapter.lora.h5")
    assert expected.keys() == resumed.keys() and any(name.endswith("lora_magnitude") for name in expected)
    for name in expected:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)
    assert train_losses(split) == train_losses(whole)


@pytest.mark.one_backend  # the saved config's keys only
def test_a_checkpoint_of_finetune_0_1_0_is_refused_naming_the_version(tmp_path):
    from types import SimpleNamespace

    from finetune import config as config_module
    from finetune.platform.errors import UserError

    cfg = config_module.load(None, {})
    saved = cfg.to_dict()
    for key in ("lr_schedule", "max_grad_norm", "warmup_steps", "warmup_ratio", "min_lr_ratio", "grad_accum"):
        del saved["train"][key]  # 0.1.0 had none of these
    found = SimpleNamespace(state=lambda: {"config": saved, "data_fingerprint": "x"})
    with pytest.raises(UserError, match=r"written by finetune 0\.1\.0, whose optimizer state this version"):
        checkpoint.check_compatible(found, cfg, ("x", None), tmp_path)
    found = SimpleNamespace(state=lambda: {"config": cfg.to_dict(), "data_fingerprint": "x"})
    checkpoint.check_compatible(found, cfg, ("x", None), tmp_path)  # this version's: nothing to refuse


@pytest.mark.one_backend  # the comparison alone
@pytest.mark.parametrize(
    "setting, packed, method, asked, same",
    [
        ("auto", False, "grpo", "off", True),  # GRPO's rows never pack: off is what auto did
        ("auto", True, "sft", "off", False),
        ("auto", True, "sft", "auto", True),
        ("auto", False, "sft", "on", False),
        ("off", False, "grpo", "auto", True),  # auto leaves GRPO's rows as they were
        ("off", False, "sft", "auto", False),  # auto would pack SFT's
        (None, None, "sft", "off", False),  # a checkpoint from before the decision was kept: auto read as on
    ],
)
def test_resume_compares_how_the_rows_were_laid_not_the_packing_setting(setting, packed, method, asked, same):
    saved = {"config": {"data": {"packing": setting or "auto"}}, **({} if packed is None else {"packed": packed})}
    then, now = checkpoint._packing(saved, setting or "auto", asked, registry.get(method))
    assert (then == now) is same, (then, now)
