"""--add-tokens and --embedding-lr (model/tokens.py): new tokens are one id each, only their embedding rows train
(beside LoRA), every other row stays bit for bit, and eval, generate, load and the exports carry them.

Runs are made as typed, in a fresh process (the tiny preset, float32, 3 steps of seq 48); the appended path (tiny's
tokenizer has no <unusedN> piece) on every backend, the renamed <unusedN> path on a saved preset whose tokenizer
has some, in the PyTorch suite.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND, REPO, SHORT, adapter_arrays, invoke, run_with_fault, write_jsonl

import finetune
from finetune.model import presets

neutral = pytest.mark.backend_neutral
in_torch_suite = pytest.mark.skipif(BACKEND != "torch", reason="transformers is checked in the PyTorch suite")
NEW = ["<tool>", "<sym>"]
TINY_VOCABULARY = 811


def records(count: int = 24) -> list[dict]:
    return [{"instruction": f"Call tool {i}", "context": "", "response": f"<tool> {i} <sym>",
             "category": "open_qa"} for i in range(count)]  # fmt: skip


def train(out, data, *flags, preset="tiny"):
    """`finetune gemma` in a fresh process, as typed."""
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", str(preset), "--backend", BACKEND,
            "--precision", "float32", "--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--data", str(data),
            "--set", "train.samples=0", "--checkpoint-every", "6", "--output", str(out), *flags]  # fmt: skip
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": str(REPO)}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def start_rows(tokenizer, embeddings, tokens) -> np.ndarray:
    """The rows a new token starts from: the mean of the base's rows of the pieces its text encoded to."""
    return np.stack([embeddings[np.asarray(tokenizer.tokenize(t)).reshape(-1)].mean(axis=0) for t in tokens])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs on records that use the new tokens (6 steps at 2e-2: enough for the tiny model to answer with a
    new token): from the command line at the run's learning rate, and through the Python API at an embedding
    learning rate 100 times lower."""
    root = tmp_path_factory.mktemp("tokens")
    data = write_jsonl(root / "tools.jsonl", records())
    plain = train(root / "plain", data, "--add-tokens", ",".join(NEW), "--lr", "2e-2")
    if BACKEND != "torch":  # CI time: the rate ratio's backend part is LoRA+'s (test_builder.py, every backend)
        return plain, None
    settings = {
        "backend": BACKEND, "output.dir": str(root / "slow"), "data.path": str(data), "model.precision": "float32",
        "model.seq_len": 32, "train.batch_size": 4, "train.max_steps": 6, "train.samples": 0,
        "train.checkpoint_every": 6, "train.learning_rate": 2e-2, "model.add_tokens": NEW, "train.embedding_lr": 2e-4,
    }  # fmt: skip
    finetune.run(finetune.load_config("tiny", settings))
    return plain, root / "slow"


@pytest.fixture(scope="module")
def base():
    """The tiny base's tokenizer and embedding matrix, float32."""
    from finetune.model import builder

    lm, preprocessor = builder.load_base(presets.Source("tiny", "tiny", "gemma"), 48, "float32")
    return preprocessor.tokenizer, np.asarray(lm.backbone.token_embedding.embeddings.numpy())


def test_only_the_new_rows_train(runs, base, tmp_path):
    run, _ = runs
    tokenizer, embeddings = base
    described = json.loads((run / "adapter.json").read_text())
    assert described["added_tokens"] == {"tokens": NEW, "ids": [811, 812], "vocabulary": 813}  # appended
    rows = np.load(run / "adapter.tokens.npy")
    start = start_rows(tokenizer, embeddings, NEW)
    assert rows.shape == (2, embeddings.shape[1]) and np.abs(rows - start).max() > 1e-3  # they trained
    # What trained: LoRA's factors and the new rows, never the base's embedding matrix.
    (state,) = run.glob("checkpoints/*/state.json")
    paths = json.loads(state.read_text())["trainable_paths"]
    assert any(p.endswith("added_token_rows") for p in paths) and not any(p.endswith("/embeddings") for p in paths)
    # The merged export's embedding: every base row bit for bit, the new rows as trained.
    lm = finetune.load(run)
    out = finetune.export(run, "merged", tmp_path / "merged")
    import keras
    import keras_hub

    merged = keras_hub.models.CausalLM.from_preset(str(out))
    matrix = np.asarray(merged.backbone.token_embedding.embeddings.numpy())
    assert matrix.shape == (813, embeddings.shape[1])
    assert np.array_equal(matrix[:TINY_VOCABULARY], embeddings)
    np.testing.assert_array_equal(matrix[TINY_VOCABULARY:], rows)
    # The merged model is the run's model: the same logits, the new ids' columns included.
    ids = np.asarray(lm.preprocessor.tokenizer.tokenize("Call tool 3 <tool> 3 <sym>"))[None]
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    logits = keras.ops.convert_to_numpy(lm(inputs))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(merged(inputs)), logits, atol=1e-5)
    assert logits.shape[-1] == 813


def test_a_full_run_trains_its_new_rows_and_exports_them_merged(tmp_path):
    """--full with --add-tokens: every weight trains, the new rows too (kept beside the model, as a LoRA run keeps
    them beside its adapter); eval, generate and the merged export carry them, the export with the run's logits."""
    import keras
    import keras_hub

    data = write_jsonl(tmp_path / "tools.jsonl", records())
    run = train(tmp_path / "full", data, "--full", "--add-tokens", ",".join(NEW), "--lr", "2e-2")
    described = json.loads((run / "model.json").read_text())
    assert described["added_tokens"] == {"tokens": NEW, "ids": [811, 812], "vocabulary": 813}
    (state,) = run.glob("checkpoints/*/state.json")
    paths = json.loads(state.read_text())["trainable_paths"]
    assert any(p.endswith("added_token_rows") for p in paths)
    assert "token_embedding/embeddings" in paths, paths  # the base's matrix trains too (it did not on TensorFlow)
    metrics = json.loads((run / "metrics.json").read_text())
    assert finetune.evaluate(run)["loss"] == pytest.approx(metrics["eval_loss"], abs=1e-5)
    lm = finetune.load(run)
    rows = np.load(run / "adapter.tokens.npy")
    out = finetune.export(run, "merged", tmp_path / "merged")
    merged = keras_hub.models.CausalLM.from_preset(str(out))
    matrix = np.asarray(merged.backbone.token_embedding.embeddings.numpy())
    assert matrix.shape == (813, rows.shape[1])
    np.testing.assert_array_equal(matrix[TINY_VOCABULARY:], rows)
    ids = np.asarray(lm.preprocessor.tokenizer.tokenize("Call tool 3 <tool> 3 <sym>"))[None]
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    np.testing.assert_allclose(keras.ops.convert_to_numpy(merged(inputs)), keras.ops.convert_to_numpy(lm(inputs)),
                               atol=1e-5)  # fmt: skip
    assert "<tool>" in finetune.generate(run, ["Call tool 3"], max_new_tokens=6)[0]


def test_a_new_token_is_one_id_in_training_eval_and_generate(runs):
    run, _ = runs
    lm = finetune.load(run)
    tokenizer = lm.preprocessor.tokenizer
    ids = np.asarray(tokenizer.tokenize("x<tool>y <sym>")).tolist()
    assert ids.count(811) == 1 and ids.count(812) == 1
    assert tokenizer.detokenize([811, 812]) == "<tool><sym>"
    metrics = finetune.evaluate(run)
    assert np.isfinite(metrics["loss"]) and metrics["examples"] > 0
    # Greedy generation from a prompt of the training records writes the new tokens it learned.
    answer = finetune.generate(run, ["Call tool 3"], max_new_tokens=6)
    assert "<tool>" in answer[0], answer


@neutral
def test_embedding_lr_sets_how_far_the_new_rows_move(runs, base):
    plain, slow = runs
    start = start_rows(*base, NEW)
    moved = {
        name: np.abs(np.load(run / "adapter.tokens.npy") - start).max()
        for name, run in (("plain", plain), ("slow", slow))
    }
    # Adam's steps are about the learning rate each: 6 steps at 2e-2 against 6 at 2e-4.
    assert moved["plain"] > 10 * moved["slow"] > 0, moved


@in_torch_suite
def test_hf_and_gguf_exports_carry_the_new_tokens(runs, base, tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install 'finetune[hf]'")
    run, _ = runs
    rows = np.load(run / "adapter.tokens.npy")
    out = finetune.export(run, "hf", tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("a <tool> b<sym>")["input_ids"].count(811) == 1
    assert tokenizer.convert_ids_to_tokens([811, 812]) == NEW
    # Text, not special tokens: a decoder that skips special tokens (pipelines', vLLM's) keeps them in the answer
    assert tokenizer.decode([811, 300, 812], skip_special_tokens=True).count("<") == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    embedding = model.get_input_embeddings().weight.detach().numpy()
    assert embedding.shape == (813, rows.shape[1]) and model.config.vocab_size == 813
    np.testing.assert_array_equal(embedding[811:], rows)
    if __import__("importlib").util.find_spec("gguf") is None:
        return
    from test_export import read_gguf

    tensors, fields = read_gguf(finetune.export(run, "gguf", tmp_path / "gguf", dtype="f32") / "model.gguf")
    assert len(fields["tokenizer.ggml.tokens"]) == 813 and fields["tokenizer.ggml.tokens"][811:] == NEW
    np.testing.assert_array_equal(tensors["token_embd.weight"][2][811:], rows)


@pytest.fixture(scope="module")
def unused_preset(tmp_path_factory):
    """The tiny preset saved with a tokenizer that reserves <unused0> to <unused3> (4 rare pieces renamed), as a
    Gemma tokenizer does: the vocabulary keeps its 811 ids."""
    import keras_hub
    from sentencepiece import sentencepiece_model_pb2

    from finetune.model import builder

    lm, preprocessor = builder.load_base(presets.Source("tiny", "tiny", "gemma"), 48, "float32")
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(preprocessor.tokenizer.proto)
    for n, piece in enumerate(model.pieces[-4:]):
        piece.piece, piece.type = f"<unused{n}>", sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    preprocessor.tokenizer.set_proto(model.SerializeToString())
    lm.preprocessor = preprocessor
    out = tmp_path_factory.mktemp("unused") / "preset"
    lm.save_to_preset(str(out))
    assert isinstance(keras_hub.models.CausalLM.from_preset(str(out)), keras_hub.models.GemmaCausalLM)
    return out, np.asarray(lm.backbone.token_embedding.embeddings.numpy())


@in_torch_suite
def test_unused_pieces_are_renamed_and_the_vocabulary_keeps_its_size(unused_preset, tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install 'finetune[hf]'")
    preset, embeddings = unused_preset
    data = write_jsonl(tmp_path / "tools.jsonl", records())
    run = train(tmp_path / "run", data, "--add-tokens", "<tool>", "--lr", "2e-2", preset=preset)
    described = json.loads((run / "adapter.json").read_text())
    assert described["added_tokens"] == {"tokens": ["<tool>"], "ids": [807], "vocabulary": 811}  # <unused0>'s id
    rows = np.load(run / "adapter.tokens.npy")
    lm = finetune.load(run)
    assert np.asarray(lm.preprocessor.tokenizer.tokenize("a<tool>b")).tolist().count(807) == 1
    assert lm.preprocessor.tokenizer.id_to_token(808) == "<unused1>"
    out = finetune.export(run, "hf", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    matrix = model.get_input_embeddings().weight.detach().numpy()
    assert matrix.shape == embeddings.shape  # every export keeps its shapes
    assert np.array_equal(np.delete(matrix, 807, axis=0), np.delete(embeddings, 807, axis=0))
    np.testing.assert_array_equal(matrix[807], rows[0])
    assert transformers.AutoTokenizer.from_pretrained(out)("a <tool> b")["input_ids"].count(807) == 1


@neutral
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--add-tokens", "<eos>"], "already one piece"),
        (["--set", 'model.add_tokens=["<tool>", " "]'], "empty token"),  # the flag drops empty items itself
        (["--add-tokens", "<tool>,<tool>"], "twice"),
        (["--add-tokens", "a b"], "whitespace"),
        (["--embedding-lr", "1e-3"], "--add-tokens"),
    ],
)
def test_refusals_exit_2_and_write_nothing(flags, words, tmp_path):
    data = write_jsonl(tmp_path / "tools.jsonl", records(8))
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--seq-len", "48", "--max-steps", "1",
                    "--data", data, "--output", out, *flags)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert words in result.output and not out.exists()


@neutral  # the swap is keras' assign; the reference pass itself: test_preference.py on every backend
def test_a_dpo_reference_scores_the_new_rows_as_they_started_in_training_and_in_eval(tmp_path):
    """DPO's reference is the base model: its new rows as they started (the mean of their pieces'), not as they
    trained. The run's held-out scores, taken against the reference of its first step, are `finetune eval`'s
    again, where the trained rows are loaded before the reference is scored."""
    pairs = [{"prompt": f"Call tool {i}.", "chosen": f"<tool> {i} <sym>", "rejected": f"no {i}"} for i in range(24)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = train(tmp_path / "dpo", data, "--method", "dpo", "--add-tokens", ",".join(NEW), "--embedding-lr", "0.5")
    metrics = json.loads((out / "metrics.json").read_text())
    moved = np.load(out / "adapter.tokens.npy")
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    said = float(evaluated.output.split("eval_loss ")[1].split()[0])
    assert said == pytest.approx(metrics["eval_loss"], abs=1e-4), (said, metrics["eval_loss"])
    assert np.abs(moved - np.load(out / "adapter.tokens.npy")).max() == 0  # eval wrote nothing over the run's


def test_lora_off_puts_the_new_rows_as_they_started_and_back(base):
    """builder.lora_off (a DPO reference, GRPO's KL base): the new rows at their start inside, the trained ones
    after, on every backend."""
    from finetune.config import LoraConfig
    from finetune.model import builder, tokens

    tokenizer, embeddings = base
    lm, preprocessor = builder.load_base(presets.Source("tiny", "tiny", "gemma"), 48, "float32")
    builder.enable_lora(lm, LoraConfig(rank=2))
    tokens.add(lm, preprocessor, NEW)
    start = start_rows(tokenizer, embeddings, NEW)
    variable = tokens.rows(lm.backbone)
    trained = start + 1.0
    variable.assign(trained)
    with builder.lora_off(lm):
        np.testing.assert_allclose(np.asarray(variable.numpy()), start, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(variable.numpy()), trained)


@neutral
def test_peft_export_is_refused_with_its_reason(runs, tmp_path):
    result = invoke("export", "--run", runs[0], "--format", "peft", "--output", tmp_path / "peft")
    assert result.exit_code == 2 and "added tokens" in result.output and not (tmp_path / "peft").exists()


def test_the_rows_gradient_is_the_tied_kernel_s(base):
    """token_losses' custom gradient with new rows equals autodiff of the same loss through the whole kernel."""
    import keras
    from keras import ops

    from finetune.model import objective, tokens

    if keras.config.backend() != "jax":
        pytest.skip("one backend's autodiff is the reference; the runs above train on every backend")
    import jax
    import jax.numpy as jnp

    _, embeddings = base
    added = tokens.Added(("<a>", "<b>"), (5, TINY_VOCABULARY), TINY_VOCABULARY)  # one renamed, one appended
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(6, embeddings.shape[1])).astype("float32")
    rows = rng.normal(size=(2, embeddings.shape[1])).astype("float32")
    labels = np.array([5, TINY_VOCABULARY, 3, 7, 5, 2], "int32")
    weights = np.array([1.0, 1.0, 0.5, 1.0, 0.0, 1.0], "float32")

    def ours(h, r):
        projection = tokens.Projection(ops.convert_to_tensor(embeddings), r, added)
        return jnp.sum(objective.token_losses(objective.Targets(h, labels, weights, projection, None), 4) * weights)

    def reference(h, r):
        kernel = jnp.asarray(tokens.merged_embedding(embeddings, added, np.zeros_like(rows)))
        kernel = kernel.at[jnp.asarray(added.ids)].set(r)
        logits = h @ kernel.T
        losses = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.sum(losses * weights)

    for got, want in zip(jax.grad(ours, (0, 1))(hidden, rows), jax.grad(reference, (0, 1))(hidden, rows)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert float(ours(hidden, rows)) == pytest.approx(float(reference(hidden, rows)), rel=1e-5)


@neutral
def test_a_killed_run_resumes_to_the_same_rows(tmp_path):
    """SIGKILL right after the step-4 checkpoint of an 8-step run, then --resume: the new rows and the adapter are
    the uninterrupted run's, bit for bit (the checkpoint keeps them with LoRA's factors and their optimizer state)."""
    data = write_jsonl(tmp_path / "tools.jsonl", records(40))
    flags = ["--data", data, "--add-tokens", ",".join(NEW), "--precision", "float32", "--seq-len", "32"]
    whole = tmp_path / "whole"
    assert invoke("gemma", *SHORT, *flags, "--output", whole).exit_code == 0
    out = tmp_path / "killed"
    assert run_with_fault(out, "SIGKILL", 4, *flags).returncode == -9
    result = invoke("gemma", "--resume", "--output", out)
    assert result.exit_code == 0 and "resuming" in result.output, result.output
    np.testing.assert_array_equal(np.load(out / "adapter.tokens.npy"), np.load(whole / "adapter.tokens.npy"))
    before, after = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
