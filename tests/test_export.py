"""finetune export: each format gives the fine-tuned model's logits back in the library that loads it.

One tiny run per module (float32, LoRA on all seven kinds of dense layer, two
steps so that B is no longer zero). Tolerances, on logits of magnitude ~10:
lora 1e-6 (the same factors, the same computation), merged 1e-4 (W + s·A·B
summed once instead of per call), hf and peft 1e-4 (another framework's kernels).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import BACKEND, REPO, float32_policy
from test_images import pictures, square
from typer.testing import CliRunner

import finetune
from finetune.cli import app
from finetune.config import LoraConfig
from finetune.exports.export import MARKER
from finetune.model import presets

# transformers and PEFT compute on PyTorch: their checks run once, in the PyTorch suite, where CI's time goes
# furthest. The exports themselves (lora, merged) are checked on every backend.
in_torch_suite = pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")
TARGETS = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
RANK, ALPHA = 4, 8.0
TOKENS = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 127, 5, 6, 7, 300, 301]], dtype="int32")


def logits(lm, tokens=TOKENS):
    import keras

    return keras.ops.convert_to_numpy(lm({"token_ids": tokens, "padding_mask": np.ones_like(tokens, dtype=bool)}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, the fine-tuned Keras model's logits on TOKENS, the base model's)."""
    out = tmp_path_factory.mktemp("export") / "run"
    settings = {
        "backend": BACKEND, "output.dir": str(out), "model.seq_len": 64, "model.precision": "float32",
        "train.batch_size": 2, "train.max_steps": 2, "train.samples": 0, "data.max_records": 40,
        "lora.rank": RANK, "lora.alpha": ALPHA, "lora.targets": TARGETS,
    }  # fmt: skip
    with float32_policy():
        finetune.run(finetune.load_config("tiny", settings))
        tuned = logits(finetune.load(out))
        base = logits(base_model())
    assert np.abs(tuned - base).max() > 0.1  # two steps moved B off zero: the formats have something to carry
    return out, tuned, base


def base_model():
    import keras_hub

    backbone = presets.tiny_backbone(presets.tiny_tokenizer().vocabulary_size())
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def invoke(*args):
    return CliRunner().invoke(app, ["export", *[str(a) for a in args]])


def export(run, fmt, out, *extra):
    result = invoke("--run", run, "--format", fmt, "--output", out, *extra)
    assert result.exit_code == 0, result.output
    return out


def test_lora_loads_onto_the_base_with_plain_keras_hub(trained, tmp_path):
    run, tuned, _ = trained
    out = export(run, "lora", tmp_path / "lora")
    assert sorted(p.name for p in out.iterdir()) == ["adapter.json", "adapter.lora.h5", MARKER]
    assert (out / "adapter.lora.h5").read_bytes() == (run / "adapter.lora.h5").read_bytes()
    np.testing.assert_allclose(documented_keras_hub_load(out), tuned, atol=2e-5)


def documented_keras_hub_load(out):
    """The logits of the tiny base with the lora export at `out` loaded as export.md's plain keras-hub recipe
    does it."""
    described = json.loads((out / "adapter.json").read_text())
    with float32_policy():
        lm = base_model()
        lm.backbone.enable_lora(described["rank"], target_layer_names=described["target_layer_names"])
        for layer in lm.backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):
                layer.lora_alpha = described["alpha"]
        lm.backbone.load_lora_weights(str(out / "adapter.lora.h5"))
        # keras-hub merges the factors into the kernel, the run applied them beside it (model.beside_the_kernel):
        # the same function, float32 sums in another order.
        return logits(lm)


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "down_proj"]])
def test_the_keras_hub_recipe_takes_a_run_given_an_alias_or_transformers_names(targets, tmp_path):
    """adapter.json's `targets` keeps what the run was given; keras-hub's enable_lora matched none of all-linear
    or q_proj, and loaded nothing (the base, silently) or failed. `target_layer_names` are keras-hub's."""
    out = tmp_path / "run"
    settings = {"backend": BACKEND, "output.dir": str(out), "model.seq_len": 64, "model.precision": "float32",
                "train.batch_size": 2, "train.max_steps": 2, "train.samples": 0, "data.max_records": 20,
                "lora.rank": RANK, "lora.alpha": ALPHA, "lora.targets": targets}  # fmt: skip
    with float32_policy():
        finetune.run(finetune.load_config("tiny", settings))
        tuned = logits(finetune.load(out))
    exported = export(out, "lora", tmp_path / "lora")
    named = json.loads((exported / "adapter.json").read_text())["target_layer_names"]
    assert named == (sorted(TARGETS) if targets == ["all-linear"] else ["ffw_linear", "query"])
    np.testing.assert_allclose(documented_keras_hub_load(exported), tuned, atol=2e-5)


def test_merged_is_a_preset_keras_hub_loads_without_finetune(trained, tmp_path):
    run, tuned, _ = trained
    out = export(run, "merged", tmp_path / "exported" / "merged")  # missing folders on the way are made
    saved = tmp_path / "logits.npy"
    script = (
        "import sys; sys.modules['finetune'] = None\n"  # any import of finetune fails
        "import numpy as np, keras, keras_hub\n"
        f"lm = keras_hub.models.CausalLM.from_preset({str(out)!r})\n"
        "assert type(lm).__name__ == 'GemmaCausalLM' and lm.preprocessor.sequence_length == 1024\n"
        f"tokens = np.array({TOKENS.tolist()}, dtype='int32')\n"
        "x = {'token_ids': tokens, 'padding_mask': np.ones_like(tokens, dtype=bool)}\n"
        f"np.save({str(saved)!r}, keras.ops.convert_to_numpy(lm(x)))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(saved), tuned, atol=1e-4)


def test_a_mixed_precision_run_merges_into_a_preset_keras_hub_reads(trained, tmp_path):
    """keras-hub's from_preset cannot read a mixed_bfloat16 policy back, so the preset is saved in float32."""
    import keras_hub

    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    _edit_yaml(run / "config.yaml", "model.precision", "mixed_bfloat16")
    with float32_policy():
        finetune.export(run, "merged", tmp_path / "merged")
        lm = keras_hub.models.CausalLM.from_preset(str(tmp_path / "merged"))
    assert lm.backbone.dtype_policy.name == "float32"


def hf_logits(model, tokens=TOKENS):
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@in_torch_suite
@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma4"])
def test_a_chat_runs_hf_export_carries_its_chat_template_and_stops_at_the_turn_end(preset, tmp_path):
    """transformers' apply_chat_template renders a conversation as the run rendered its records (the model's own
    template, <bos> first), and generate stops at the model's turn end, as `finetune generate` does: the export
    of a chat run had neither, and apply_chat_template failed. The gguf's Modelfile takes Ollama's system
    message, which it dropped, and the gguf carries the chat template for llama.cpp's server."""
    transformers = pytest.importorskip("transformers", reason="pip install 'finetune[hf]'")
    from conftest import CHAT, chat, write_jsonl

    from finetune.data import chat as chats
    from finetune.data import templates

    data = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(12)])
    out = tmp_path / "run"
    settings = {"backend": BACKEND, "output.dir": str(out), "data.path": str(data), "model.seq_len": 64,
                "train.batch_size": 2, "train.max_steps": 1, "train.samples": 0, "model.preset": preset,
                "data.template": "auto"}  # fmt: skip
    finetune.run(finetune.load_config("tiny", settings))
    used = templates.TEMPLATES[yaml.safe_load((out / "config.yaml").read_text())["data"]["template"]]
    exported = export(out, "hf", tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    for messages in (CHAT["messages"], CHAT["messages"][1:4]):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == chats.BOS + used.renderer.text(messages, add_generation_prompt=True), rendered
    stops = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids(used.renderer.turn_end) in stops and tokenizer.eos_token_id in stops
    transformers.GenerationConfig.from_pretrained(exported)  # it reads
    # Ollama's Modelfile: a system message goes where the model's template puts one, as `finetune generate
    # --system` renders it; without one, the prompt alone. Ollama's Go template, filled in as Ollama fills it.
    gguf = export(out, "gguf", tmp_path / "gguf")
    template = re.search(r'TEMPLATE """(.*?)"""', (gguf / "Modelfile").read_text(), re.S).group(1)
    # llama.cpp's server (--jinja) renders conversations, system messages and tools with the file's own template
    _, fields = read_gguf(gguf / "model.gguf")
    assert fields["tokenizer.chat_template"] == chats.source(used.renderer.file)
    told, plain = re.fullmatch(r"\{\{ if \.System \}\}(.*)\{\{ else \}\}(.*)\{\{ end \}\}", template, re.S).groups()
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    fill = lambda text: text.replace("{{ .System }}", "Be brief.").replace("{{ .Prompt }}", "Hi")  # noqa: E731
    assert fill(told) == used.renderer.text(turns, add_generation_prompt=True)
    assert fill(plain) == used.renderer.text(turns[1:], add_generation_prompt=True)


@in_torch_suite
def test_hf_loads_in_transformers_with_the_fine_tuning(trained, tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="the hf format is checked in transformers: pip install 'finetune[hf]'"
    )
    run, tuned, _ = trained
    out = export(run, "hf", tmp_path / "hf")
    model = transformers.GemmaForCausalLM.from_pretrained(out)
    np.testing.assert_allclose(hf_logits(model), tuned, atol=1e-4)
    # The tokenizer gives the ids keras-hub's Gemma preprocessor gives (<bos> first), on the sample's records.
    tokenizer, ours = transformers.AutoTokenizer.from_pretrained(out), presets.tiny_tokenizer()
    sample = REPO / "finetune" / "assets" / "dolly-sample.jsonl"
    records = [json.loads(line) for line in sample.read_text(encoding="utf-8").splitlines()[:40]]
    texts = [f"Instruction:\n{r['instruction']}\n\nResponse:\n{r['response']} 2 plus 33" for r in records]
    for text in texts:
        assert tokenizer(text)["input_ids"] == [ours.start_token_id, *np.asarray(ours(text)).tolist()], text
    assert tokenizer.decode(tokenizer(texts[0])["input_ids"], skip_special_tokens=True) == texts[0]


@in_torch_suite
def test_peft_applies_to_the_base_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="the peft format is checked in PEFT: pip install 'finetune[hf]'"
    )
    peft = pytest.importorskip("peft", reason="the peft format is checked in PEFT: pip install 'finetune[hf]'")
    run, tuned, base = trained
    base_dir = export(run, "hf", tmp_path / "base", "--base")
    out = export(run, "peft", tmp_path / "peft")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter.json", "adapter_config.json", "adapter_model.safetensors", MARKER
    ]  # fmt: skip
    config = json.loads((out / "adapter_config.json").read_text())
    heads = presets.TINY_CONFIG["num_query_heads"]
    assert config["rank_pattern"] == {"q_proj": heads * RANK}  # tiny has one key/value head: k, v stay rank 4
    assert config["alpha_pattern"] == {"q_proj": heads * ALPHA}
    model = transformers.GemmaForCausalLM.from_pretrained(base_dir)
    np.testing.assert_allclose(hf_logits(model), base, atol=1e-4)  # --base is the base alone
    adapted = peft.PeftModel.from_pretrained(model, out)
    np.testing.assert_allclose(hf_logits(adapted), tuned, atol=1e-4)


def test_overwrite_replaces_an_export_and_nothing_of_the_users(trained, tmp_path):
    run, _, _ = trained
    out = export(run, "gguf", tmp_path / "again")
    export(run, "lora", out, "--overwrite")  # an earlier export, holding only its own files: replaced
    assert sorted(p.name for p in out.iterdir()) == ["adapter.json", "adapter.lora.h5", MARKER]
    assert json.loads((out / MARKER).read_text())["format"] == "lora"
    (out / "notes.txt").write_text("mine")  # a file of the user's put into the export: the swap would lose it
    result = invoke("--run", run, "--format", "lora", "--output", out, "--overwrite")
    assert result.exit_code == 2 and "notes.txt in it is not the export's own" in result.stderr, result.output
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_a_file_of_the_users_inside_an_exports_folders(trained, tmp_path):
    """A merged export holds folders (assets/tokenizer): a file or folder the user put in one is theirs, and the
    swap would lose it. The export lists every path it wrote; one of an earlier finetune, which listed its
    top-level names alone, is refused where it has folders."""
    run, _, _ = trained
    out = export(run, "merged", tmp_path / "merged")
    assert "assets/tokenizer" in json.loads((out / MARKER).read_text())["tree"]
    export(run, "merged", out, "--overwrite")  # its own files and folders alone: replaced
    for mine, named in ((out / "assets" / "tokenizer" / "extra.txt", "assets/tokenizer/extra.txt"),
                        (out / "assets" / "mydir" / "k.txt", "assets/mydir")):  # fmt: skip
        mine.parent.mkdir(exist_ok=True)
        mine.write_text("mine")
        before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        for fmt in ("merged", "lora"):
            result = invoke("--run", run, "--format", fmt, "--output", out, "--overwrite")
            assert result.exit_code == 2 and "in it is not the export's own" in result.stderr, result.output
            assert f"{named} in it is not" in result.stderr or f"{named}, " in result.stderr, result.stderr
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before and mine.read_text() == "mine"
        mine.unlink()
        if mine.parent.name == "mydir":
            mine.parent.rmdir()
    about = json.loads((out / MARKER).read_text())
    del about["tree"]  # as an earlier finetune wrote it
    (out / MARKER).write_text(json.dumps(about))
    result = invoke("--run", run, "--format", "lora", "--output", out, "--overwrite")
    assert result.exit_code == 2 and "did not list the files in its folders" in result.stderr, result.output
    assert (out / "assets").is_dir()


@pytest.mark.parametrize("where", ["folder", "current directory", "the run"])
def test_overwrite_never_replaces_a_folder_that_is_not_an_export(trained, tmp_path, monkeypatch, where):
    """`--output . --overwrite` in a user's project, or the run's own directory: refused, every file kept."""
    run, _, _ = trained
    if where == "the run":
        folder = tmp_path / "run-copy"
        shutil.copytree(run, folder)
    else:
        folder = tmp_path / "project"
        folder.mkdir()
        (folder / "train.py").write_text("mine")
        (folder / "data").mkdir()
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    monkeypatch.chdir(folder if where == "current directory" else tmp_path)
    output = "." if where == "current directory" else folder
    result = invoke("--run", run, "--format", "lora", "--output", output, "--overwrite")
    assert result.exit_code == 2 and "is not a finetune export and holds files" in result.stderr, result.output
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before


def _edit_yaml(path, key, value):
    data = yaml.safe_load(path.read_text())
    section, name = key.split(".")
    data[section][name] = value
    path.write_text(yaml.safe_dump(data))


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _other_architecture(run, where):
    """The run's preset replaced by a one-layer model: the adapter's fingerprint no longer fits."""
    import keras_hub

    tokenizer = presets.tiny_tokenizer()
    config = dict(presets.TINY_CONFIG, num_layers=1)
    with float32_policy():
        backbone = keras_hub.models.GemmaBackbone(vocabulary_size=tokenizer.vocabulary_size(), **config)
        preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer)
        keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor).save_to_preset(str(where))
    _edit_yaml(run / "config.yaml", "model.preset", str(where))
    preset = json.loads((run / "adapter.json").read_text())["preset"]
    _edit_json(run / "adapter.json", preset=dict(preset, name=str(where)))


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


REFUSALS = {
    "other-rank": (
        lambda run, tmp: _edit_yaml(run / "config.yaml", "lora.rank", 2),
        "says rank 4, but the run's config.yaml says 2",
    ),
    "other-preset": (lambda run, tmp: _other_architecture(run, tmp / "one-layer"), "base fingerprint"),
    "other-targets": (
        lambda run, tmp: _edit_yaml(run / "config.yaml", "lora.targets", ["query", "value"]),
        "says targets query,key,value,attention_output,ffw_gating,ffw_gating_2,ffw_linear",
    ),
    "truncated-lora-h5": (lambda run, tmp: _truncate(run / "adapter.lora.h5"), "not a readable adapter"),
    "no-adapter-json": (lambda run, tmp: (run / "adapter.json").unlink(), "has no adapter.json"),
    "corrupt-adapter-json": (lambda run, tmp: _truncate(run / "adapter.json"), "adapter.json is not valid JSON"),
}


# Each case with merged; those refused only once the base is built, with peft too (it builds the run's base).
REFUSED = [(case, "merged") for case in REFUSALS] + [("other-preset", "peft"), ("truncated-lora-h5", "peft")]


@pytest.mark.parametrize("case, fmt", REFUSED, ids=[f"{c}-{f}" for c, f in REFUSED])
def test_a_mismatched_adapter_is_refused_and_nothing_is_written(trained, tmp_path, case, fmt):
    if fmt == "peft":  # without it, the missing package is what the export names first
        pytest.importorskip("safetensors", reason="the peft format needs safetensors: pip install 'finetune[hf]'")
    change, expected = REFUSALS[case]
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    change(run, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke("--run", run, "--format", fmt, "--output", tmp_path / "exported" / "out")
    message = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert message.startswith("error: ") and expected in message and len(message.splitlines()) <= 2, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no staging directory


def test_an_export_that_fails_midway_leaves_nothing(trained, tmp_path, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys.modules["finetune.exports.export"], "merge", full_disk)
    with pytest.raises(finetune.UserError, match="No space left on device; nothing was written"):
        finetune.export(trained[0], "merged", tmp_path / "exported" / "merged")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--format", "onnx"], "unknown export format 'onnx'"),
        (["--format", "peft", "--base"], "--base writes the base model in transformers format"),
        (["--format", "lora", "--output", "gs://bucket/out"], "export writes to a local directory"),
    ],
)
def test_a_bad_request_is_refused_before_loading_anything(trained, tmp_path, args, expected, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("--run", trained[0], "--output", tmp_path / "out", *args)
    assert result.exit_code == 2 and expected in result.stderr, result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "gs:").exists()


@pytest.mark.parametrize("where", ["file", "read-only", "long name"])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_is_built(where, tmp_path, read_only_dir):
    (tmp_path / "file").write_text("x")
    # The staging folder beside the output is named .NAME.partial-PID: a 240-byte name fits, and that one not.
    out = {"file": tmp_path / "file", "read-only": read_only_dir / "out", "long name": tmp_path / ("m" * 240)}[where]
    result = invoke("--run", tmp_path / "no-run", "--format", "merged", "--output", out)
    expected = {"file": "is a file, not a directory", "read-only": "not a writable directory", "long name": "too long"}
    assert result.exit_code == 2 and expected[where] in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "read-only"]


def test_an_output_holding_files_is_refused_without_overwrite(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke("--run", trained[0], "--format", "lora", "--output", out)
    assert result.exit_code == 2 and "already holds files; pass --overwrite" in result.stderr, result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def small_backbone(family, vocabulary_size):
    """Gemma 1, or Gemma 3 as its presets are laid out (post norms, query/key norms, five sliding layers in six)."""
    import keras_hub

    shape = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8)
    if family == "gemma":
        return keras_hub.models.GemmaBackbone(vocabulary_size=vocabulary_size, num_layers=1, **shape)
    return keras_hub.models.Gemma3Backbone(
        vocabulary_size=vocabulary_size, image_size=None, vision_encoder=None, num_layers=6, sliding_window_size=4,
        use_sliding_window_attention=True, use_post_ffw_norm=True, use_post_attention_norm=True,
        use_query_key_norm=True, **shape,
    )  # fmt: skip


@in_torch_suite
@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_every_key_value_head_reaches_transformers_and_peft(tmp_path, family):
    """Two key/value heads, random LoRA factors: keras-hub's Gemma 1 exporter alone keeps only the first head."""
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    import keras_hub

    from finetune.exports.export import check_transformers_layout, write_peft, write_transformers
    from finetune.training import adapter

    tokenizer = presets.tiny_tokenizer()
    rng = np.random.default_rng(0)
    with float32_policy():
        backbone = small_backbone(family, tokenizer.vocabulary_size())
        for weight in backbone.weights:  # norm scales start at zero: make every weight count
            weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
        task = keras_hub.models.GemmaCausalLM if family == "gemma" else keras_hub.models.Gemma3CausalLM
        lm = task(backbone=backbone, preprocessor=None)
        base = logits(lm)
        check_transformers_layout(backbone)
        write_transformers(tmp_path, backbone, tokenizer)
        backbone.enable_lora(2, target_layer_names=TARGETS)
        layers = adapter.layers_with_weights(backbone)
        factors = {}
        for index in backbone._lora_enabled_layers:
            layer = layers[index]
            layer.lora_alpha = 3.0
            pair = [rng.normal(0, 0.3, v.shape).astype("float32") for v in (layer.lora_kernel_a, layer.lora_kernel_b)]
            layer.lora_kernel_a.assign(pair[0])
            layer.lora_kernel_b.assign(pair[1])
            factors[index] = tuple(pair)
        tuned = logits(lm)
    (tmp_path / "peft").mkdir()
    write_peft(tmp_path / "peft", backbone, factors, LoraConfig(rank=2, alpha=3.0))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model).__name__ == {"gemma": "GemmaForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    np.testing.assert_allclose(hf_logits(model), base, atol=1e-4)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    np.testing.assert_allclose(hf_logits(peft.PeftModel.from_pretrained(model, tmp_path / "peft")), tuned, atol=1e-4)


def test_gemma_2_is_refused_in_transformers_format():
    import keras_hub

    from finetune.exports.export import check_transformers_layout
    from finetune.platform.errors import UserError

    with float32_policy():
        gemma2 = keras_hub.models.GemmaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
            intermediate_dim=32, head_dim=8, use_post_ffw_norm=True, use_post_attention_norm=True,
            final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0,
        )  # fmt: skip
    with pytest.raises(UserError, match="Gemma 2 preset"):
        check_transformers_layout(gemma2)


def test_hf_and_peft_without_safetensors_name_the_extra(trained, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
    result = invoke("--run", trained[0], "--format", "peft", "--output", tmp_path / "out")
    assert result.exit_code == 2 and "pip install 'finetune[hf]'" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def trained_gemma3(tmp_path_factory):
    """A tiny Gemma 3 run (from a preset directory, laid out as Gemma 3's presets are): (run, tuned, base logits)."""
    import keras_hub

    root = tmp_path_factory.mktemp("gemma3")
    rng = np.random.default_rng(1)
    with float32_policy():
        tokenizer = keras_hub.models.Gemma3Tokenizer(proto=str(presets.TINY_TOKENIZER), has_vision_tokens=False)
        backbone = small_backbone("gemma3", tokenizer.vocabulary_size())
        for weight in backbone.weights:  # norm scales start at zero: make every weight count
            weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
        preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(tokenizer=tokenizer, image_converter=None)
        lm = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)
        base = logits(lm)
        lm.save_to_preset(str(root / "preset"))
        settings = {
            "backend": BACKEND, "output.dir": str(root / "run"), "model.preset": str(root / "preset"),
            "model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 2,
            "train.samples": 0, "train.learning_rate": 0.01, "data.max_records": 40, "lora.rank": RANK,
            "lora.alpha": ALPHA, "lora.targets": TARGETS,
        }  # fmt: skip
        finetune.run(finetune.load_config("tiny", settings))
        tuned = logits(finetune.load(root / "run"))
    assert np.abs(tuned - base).max() > 1e-3
    return root / "run", tuned, base


@pytest.mark.backend_neutral  # Gemma 3's export logits: test_families
def test_a_gemma3_run_exports_lora_and_merged_for_keras_hub(trained_gemma3, tmp_path):
    """lora (onto the preset with plain keras-hub) and merged (a preset of its own) give the run's logits."""
    import keras_hub

    run, tuned, base = trained_gemma3
    for fmt in ("lora", "merged"):
        export(run, fmt, tmp_path / fmt)
    with float32_policy():
        merged = keras_hub.models.CausalLM.from_preset(str(tmp_path / "merged"))
        assert type(merged).__name__ == "Gemma3CausalLM"
        np.testing.assert_allclose(logits(merged), tuned, atol=1e-4)
        described = json.loads((tmp_path / "lora" / "adapter.json").read_text())
        lm = keras_hub.models.CausalLM.from_preset(described["preset"]["name"], preprocessor=None)
        lm.backbone.enable_lora(described["rank"], target_layer_names=described["targets"])
        for layer in lm.backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):
                layer.lora_alpha = described["alpha"]
        lm.backbone.load_lora_weights(str(tmp_path / "lora" / "adapter.lora.h5"))
        np.testing.assert_allclose(logits(lm), tuned, atol=2e-5)  # merged by keras-hub, beside in the run


@in_torch_suite
def test_a_gemma3_run_exports_to_transformers_and_peft(trained_gemma3, tmp_path):
    """hf loads as Gemma3ForCausalLM with the run's logits; peft on the hf --base export gives them too."""
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    run, tuned, base = trained_gemma3
    hf = transformers.AutoModelForCausalLM.from_pretrained(export(run, "hf", tmp_path / "hf"))
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    np.testing.assert_allclose(hf_logits(hf), tuned, atol=1e-4)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(export(run, "hf", tmp_path / "base", "--base"))
    np.testing.assert_allclose(hf_logits(base_model), base, atol=1e-4)
    adapted = peft.PeftModel.from_pretrained(base_model, export(run, "peft", tmp_path / "peft"))
    np.testing.assert_allclose(hf_logits(adapted), tuned, atol=1e-4)


# === LoRA's variants: each exported variant checked as plain LoRA is (merged, and PEFT against keras-hub merged) ===

# rslora: through the Python API, every linear kind, dropout set (off at inference, so the exports match).
# dora: through the command users type, in a fresh process, on PEFT's module names, with LoRA+ and NEFTune too.
VARIANTS = {
    "rslora": {"lora.rslora": True, "lora.targets": ["all-linear"], "lora.dropout": 0.1},
    "dora": [
        "--dora", "--lora-dropout", "0.05", "--lora-plus-ratio", "4", "--neftune-alpha", "5",
        *[a for name in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj") for a in ("--target", name)],
    ],
}  # fmt: skip


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(variant, run directory, the fine-tuned Keras model's logits on TOKENS)."""
    out = tmp_path_factory.mktemp(request.param) / "run"
    chosen = VARIANTS[request.param]
    if isinstance(chosen, dict):
        settings = {
            "backend": BACKEND, "output.dir": str(out), "model.seq_len": 64, "model.precision": "float32",
            "train.batch_size": 2, "train.max_steps": 3, "train.samples": 0, "data.max_records": 40,
            "lora.rank": RANK, "lora.alpha": ALPHA, **chosen,
        }  # fmt: skip
        with float32_policy():
            finetune.run(finetune.load_config("tiny", settings))
    else:
        args = [
            sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND, "--seq-len", "64",
            "--precision", "float32", "--batch-size", "2", "--max-steps", "3", "--max-records", "40", "--set",
            "train.samples=0", "--rank", str(RANK), "--alpha", str(ALPHA), *chosen, "--output", str(out),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with float32_policy():
        tuned = logits(finetune.load(out))
        assert np.abs(tuned - logits(base_model())).max() > 1e-3
    return request.param, out, tuned


@pytest.mark.backend_neutral  # the merge is numpy; each variant's forward: test_builder
def test_a_variant_is_recorded_and_merges_into_the_run_s_logits(variant, tmp_path):
    import keras_hub

    name, run, tuned = variant
    described = json.loads((run / "adapter.json").read_text())
    assert (described["rslora"], described["dora"]) == (name == "rslora", name == "dora")
    if name == "rslora":
        assert len(described["adapted"]) == 7 * 2 and described["dropout"] == 0.1  # tiny has 2 blocks
    else:
        assert {entry["name"] for entry in described["adapted"]} == {"query", "key", "value", "attention_output",
                                                                    "ffw_linear"}  # fmt: skip
        assert all(entry["lora_magnitude"] for entry in described["adapted"])
    export(run, "merged", tmp_path / "merged")
    with float32_policy():
        merged = keras_hub.models.CausalLM.from_preset(str(tmp_path / "merged"))
        np.testing.assert_allclose(logits(merged), tuned, atol=1e-4)


@in_torch_suite
def test_a_variant_s_peft_export_gives_keras_hub_s_merged_logits(variant, tmp_path):
    """The issue's check: keras-hub merged logits against PEFT on the `--format hf --base` model, within 1e-3."""
    import keras_hub

    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    name, run, tuned = variant
    out = export(run, "peft", tmp_path / "peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["use_rslora"], config["use_dora"]) == (name == "rslora", name == "dora")
    base = transformers.AutoModelForCausalLM.from_pretrained(export(run, "hf", tmp_path / "base", "--base"))
    adapted = peft.PeftModel.from_pretrained(base, out)
    export(run, "merged", tmp_path / "merged")
    with float32_policy():
        merged = logits(keras_hub.models.CausalLM.from_preset(str(tmp_path / "merged")))
    np.testing.assert_allclose(hf_logits(adapted), merged, atol=1e-3)
    np.testing.assert_allclose(hf_logits(adapted), tuned, atol=1e-3)


# === GGUF (llama.cpp and Ollama) ===

gguf_marks = pytest.mark.skipif(
    __import__("importlib").util.find_spec("gguf") is None, reason="the gguf format needs pip install 'finetune[gguf]'"
)


def read_gguf(path):
    """({tensor name: (ggml shape, type name, float32 array in numpy's order)}, {metadata key: value})."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {
        t.name: (
            tuple(int(n) for n in t.shape),
            t.tensor_type.name,
            np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32),
        )
        for t in reader.tensors
    }
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return tensors, fields


def merged_weights(run):
    """The fine-tuned model's kernels with LoRA merged in (keras' LoRA kernel property), by keras-hub layer."""
    with float32_policy():
        backbone = finetune.load(run).backbone
    return backbone, lambda i: backbone.get_layer(f"decoder_block_{i}")


def expected_names(layers, per_layer):
    return {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{name}.weight" for i in range(layers) for name in per_layer
    }


GEMMA_TENSORS = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]


@gguf_marks
def test_gguf_holds_the_merged_model_in_llama_cpp_layout(trained, tmp_path):
    import keras

    run, _, _ = trained
    out = export(run, "gguf", tmp_path / "gguf")
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", MARKER, "model.gguf"]
    tensors, fields = read_gguf(out / "model.gguf")
    config, vocabulary = presets.TINY_CONFIG, presets.tiny_vocabulary_size()
    hidden, heads, head_dim = config["hidden_dim"], config["num_query_heads"], config["head_dim"]
    assert set(tensors) == expected_names(config["num_layers"], GEMMA_TENSORS)
    # ggml shapes are numpy's reversed: (in, out) for a matrix, as llama.cpp's converter writes transformers' (out, in)
    assert tensors["token_embd.weight"][0] == (hidden, vocabulary)
    assert tensors["blk.0.attn_q.weight"][0] == (hidden, heads * head_dim)
    assert tensors["blk.0.attn_k.weight"][0] == (hidden, config["num_key_value_heads"] * head_dim)
    assert tensors["blk.1.attn_output.weight"][0] == (heads * head_dim, hidden)
    assert tensors["blk.1.ffn_down.weight"][0] == (config["intermediate_dim"] // 2, hidden)
    assert tensors["blk.0.attn_q.weight"][1] == "F16" and tensors["blk.0.attn_norm.weight"][1] == "F32"
    assert fields["general.architecture"] == "gemma" and fields["general.file_type"] == 1  # MOSTLY_F16
    assert fields["gemma.block_count"] == config["num_layers"] and fields["gemma.embedding_length"] == hidden
    assert fields["gemma.attention.head_count"] == heads and fields["gemma.attention.head_count_kv"] == 1
    assert fields["gemma.attention.key_length"] == head_dim and fields["gemma.feed_forward_length"] == 256
    tokenizer = presets.tiny_tokenizer()
    assert len(fields["tokenizer.ggml.tokens"]) == vocabulary and fields["tokenizer.ggml.tokens"][2] == "<bos>"
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.token_to_id("<bos>")
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.token_to_id("<eos>")
    assert fields["tokenizer.ggml.token_type"][6] == 6  # <0x00>: a byte piece
    # Values: the merged kernels (base + alpha/rank * A @ B), in llama.cpp's layout, to f16's precision.
    backbone, block = merged_weights(run)
    query = keras.ops.convert_to_numpy(block(0).attention.query_dense.kernel)  # (heads, hidden, head_dim)
    down = keras.ops.convert_to_numpy(block(1).ffw_linear.kernel)  # (intermediate, hidden)
    scale = keras.ops.convert_to_numpy(block(0).pre_attention_norm.scale)
    expected = {
        "token_embd.weight": keras.ops.convert_to_numpy(backbone.token_embedding.embeddings),
        "blk.0.attn_q.weight": query.transpose(0, 2, 1).reshape(heads * head_dim, hidden),
        "blk.1.ffn_down.weight": down.T,
        "blk.0.attn_norm.weight": 1.0 + scale,  # Gemma's RMSNorm scales by 1 + weight; llama.cpp by the weight
    }
    for name, value in expected.items():
        np.testing.assert_allclose(tensors[name][2], value, rtol=2e-3, atol=1e-4, err_msg=name)
    assert np.abs(query - keras.ops.convert_to_numpy(block(0).attention.query_dense._kernel)).max() > 1e-3
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\n") and 'TEMPLATE """Instruction:\n{{ .Prompt }}\n\n' in modelfile
    assert "tokenizer.chat_template" not in fields  # dolly's: a text template holds no conversation


def llama_cpp_gemma_logits(tensors, fields, tokens):
    """Logits as llama.cpp's gemma graph computes them from the file, in numpy (float64).

    Embeddings scaled by sqrt(hidden); RMSNorm by the stored weight; NeoX RoPE
    (rotating the halves of each head); queries scaled by 1/sqrt(head_dim);
    grouped key/value heads; tanh-GELU gating; output through token_embd.
    A matrix W read from the file has numpy shape (out, in): ggml's
    mul_mat(W, x) is x @ W.T.
    """
    w = {name: value[2].astype(np.float64) for name, value in tensors.items()}
    heads, kv_heads = fields["gemma.attention.head_count"], fields["gemma.attention.head_count_kv"]
    head_dim, eps, base = fields["gemma.attention.key_length"], fields["gemma.attention.layer_norm_rms_epsilon"], 1e4
    hidden = fields["gemma.embedding_length"]

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def rope(x):  # (n, heads, head_dim)
        half = head_dim // 2
        angles = np.arange(len(x))[:, None] * base ** (-np.arange(half) / half)[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    n = len(tokens)
    x = w["token_embd.weight"][tokens] * np.sqrt(hidden)
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(fields["gemma.block_count"]):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, heads, head_dim)) / np.sqrt(head_dim)
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, kv_heads, head_dim))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, kv_heads, head_dim)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * head_dim) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        x = x + (gelu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


@gguf_marks
@pytest.mark.parametrize("dtype, tolerance", [("f32", 1e-4), ("bf16", 0.5), ("q8_0", 0.5)])
def test_gguf_computed_as_llama_cpp_does_gives_the_fine_tuned_logits(trained, tmp_path, dtype, tolerance):
    """No llama.cpp binding installs here: llama.cpp's gemma graph, in numpy, reads the file instead."""
    run, tuned, _ = trained
    out = export(run, "gguf", tmp_path / "gguf", "--dtype", dtype)
    tensors, fields = read_gguf(out / "model.gguf")
    assert tensors["blk.0.ffn_up.weight"][1] == dtype.upper()
    assert fields["general.file_type"] == {"f32": 0, "bf16": 32, "q8_0": 7}[dtype]
    got = llama_cpp_gemma_logits(tensors, fields, TOKENS[0])
    np.testing.assert_allclose(got, tuned[0], atol=tolerance)


@gguf_marks
@pytest.mark.backend_neutral  # the GGUF writer is numpy
def test_q8_0_holds_each_matrix_within_its_blocks_rounding(trained, tmp_path):
    """q8_0 keeps each block of 32 weights as int8 times one f16 scale, max |w| / 127: a weight is off by at
    most half a step (and the scale's own f16 rounding), and the norms stay f32."""
    run = trained[0]
    exact, _ = read_gguf(export(run, "gguf", tmp_path / "f32", "--dtype", "f32") / "model.gguf")
    quantized, fields = read_gguf(export(run, "gguf", tmp_path / "q8", "--dtype", "q8_0") / "model.gguf")
    assert fields["general.file_type"] == 7 and set(quantized) == set(exact)  # MOSTLY_Q8_0
    for name, (shape, kind, value) in quantized.items():
        assert shape == exact[name][0], name
        weights = exact[name][2]
        if weights.ndim == 1:
            assert kind == "F32" and np.array_equal(value, weights), name
            continue
        assert kind == "Q8_0", name
        blocks = np.abs(weights).reshape(-1, 32).max(axis=1, keepdims=True)  # every row is whole blocks here
        step = np.repeat(blocks / 127.0, 32, axis=1).reshape(weights.shape)
        error = np.abs(value.reshape(weights.shape) - weights)
        assert (error <= 0.5 * step + 2e-3 * np.abs(weights) + 1e-7).all(), name
        assert error.max() > 0, name  # quantized, not stored exactly


@gguf_marks
@pytest.mark.backend_neutral  # the GGUF writer is numpy
def test_a_gemma3_run_exports_gguf_with_its_norms_and_windows(trained_gemma3, tmp_path):
    import keras

    run, _, _ = trained_gemma3
    out = export(run, "gguf", tmp_path / "gguf")
    tensors, fields = read_gguf(out / "model.gguf")
    per_layer = [*GEMMA_TENSORS, "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]
    assert set(tensors) == expected_names(6, per_layer)
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.attention.sliding_window"] == 4
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.feed_forward_length"] == 64
    assert fields["gemma3.context_length"] == 32768  # no RoPE scaling: a 32k model, as Gemma 3 1b
    assert tensors["blk.2.attn_k_norm.weight"][0] == (8,)
    _, block = merged_weights(run)
    key_norm = keras.ops.convert_to_numpy(block(2).attention.key_norm.scale)
    np.testing.assert_allclose(tensors["blk.2.attn_k_norm.weight"][2], 1.0 + key_norm, atol=1e-6)
    post = keras.ops.convert_to_numpy(block(5).post_ffw_norm.scale)
    np.testing.assert_allclose(tensors["blk.5.post_ffw_norm.weight"][2], 1.0 + post, atol=1e-6)
    value = keras.ops.convert_to_numpy(block(3).attention.value_dense.kernel)  # merged: value is a LoRA target
    np.testing.assert_allclose(
        tensors["blk.3.attn_v.weight"][2], value.transpose(0, 2, 1).reshape(-1, 32), rtol=2e-3, atol=1e-4
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--format", "lora", "--dtype", "f16"], "--dtype chooses the GGUF file's weight type"),
        (["--format", "gguf", "--dtype", "q2"], "unknown GGUF dtype 'q2'; choose one of f16, bf16, q8_0, f32"),
        (
            ["--format", "gguf", "--dtype", "q4_k_m"],
            "q4_k_m is made by llama.cpp's quantizer: export with --dtype f16, then run llama-quantize "
            "DIR/model.gguf DIR/model-q4_k_m.gguf Q4_K_M",
        ),
    ],
)
def test_a_bad_gguf_request_is_refused(trained, tmp_path, args, expected):
    result = invoke("--run", trained[0], "--output", tmp_path / "out", *args)
    assert result.exit_code == 2 and expected in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_gguf_without_the_gguf_package_names_the_extra(trained, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    result = invoke("--run", trained[0], "--format", "gguf", "--output", tmp_path / "out")
    assert result.exit_code == 2 and "pip install 'finetune[gguf]'" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


# === A run on pictures (tiny-gemma3-vision): transformers' Gemma3ForConditionalGeneration gives keras-hub's logits on
# a picture and its text, PEFT's adapter on its base gives them too, the lora adapter loads onto the preset, and gguf
# writes the decoder and llama.cpp's mmproj of the encoder. transformers and PEFT compute on PyTorch, and the export reads the merged weights
# through numpy: these run in the PyTorch suite (the vision runs train on every backend in tests/test_images.py).

VISION_PROMPT = "<start_of_turn>user\n<start_of_image>What colour is this?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    """A 2-step tiny-gemma3-vision run with LoRA on every decoder kind: (run directory, picture folder)."""
    folder = tmp_path_factory.mktemp("vision-export")
    data = pictures(folder, 8)
    settings = {
        "backend": BACKEND, "output.dir": str(folder / "run"), "model.preset": "tiny-gemma3-vision",
        "model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 2,
        "train.samples": 0, "data.path": str(data), "data.template": "auto", "data.eval_fraction": 0.0,
        "lora.rank": RANK, "lora.alpha": ALPHA, "lora.targets": TARGETS,
    }  # fmt: skip
    with float32_policy():
        finetune.run(finetune.load_config("tiny", settings))
    return folder / "run", folder


@pytest.fixture(scope="module")
def tuned(vision_run):
    """The run's fine-tuned model on the prompt with each colour's square: [(keras-hub inputs, logits), ...]."""
    import keras
    from PIL import Image

    from finetune.training import runs

    run, folder = vision_run
    with float32_policy():
        lm, preprocessor = runs.load_model(runs.open_on(str(run), None))
        seen = []
        for colour in ("red", "blue"):
            picture = np.asarray(Image.open(folder / square(folder / f"{colour}.png", colour)))
            x = preprocessor.generate_preprocess(
                {"prompts": [VISION_PROMPT], "images": [[picture]]}, sequence_length=64
            )
            x = {name: keras.ops.convert_to_numpy(value) for name, value in x.items()}
            seen.append((x, keras.ops.convert_to_numpy(lm(x))))
    return seen


def picture_logits(model, x):
    """transformers' logits on keras-hub's ids and pixels: the picture NCHW, its soft tokens marked for the
    two-way attention keras-hub gives them (token_type_ids 1), up to keras-hub's padding."""
    import torch

    length = int(x["padding_mask"][0].sum())
    assert 0 < length < 64 and x["padding_mask"][0, :length].all()  # whole, and padded on the right
    ids = torch.tensor(x["token_ids"][:, :length], dtype=torch.long)
    pixels = torch.tensor(np.transpose(x["images"][0, :1], (0, 3, 1, 2)))  # the one picture, of two slots
    kinds = (ids == model.config.image_token_index).long()
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels, token_type_ids=kinds, attention_mask=torch.ones_like(ids))
    return out.logits.numpy(), length


@pytest.fixture(scope="module")
def hf_export(vision_run, tmp_path_factory):
    """`finetune export --format hf` of the run, as typed, in a fresh process."""
    from test_as_typed import finetune as typed

    run, _ = vision_run
    out = tmp_path_factory.mktemp("hf") / "hf"
    typed("export", "--run", str(run), "--format", "hf", "--output", str(out), cwd=out.parent)
    return out


@in_torch_suite
def test_hf_export_gives_keras_hub_s_logits_on_a_picture_and_its_text(hf_export, tuned):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    config = json.loads((hf_export / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and config["mm_tokens_per_image"] == 4
    model, loading = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf_export, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    got = []
    for x, expected in tuned:
        logits, length = picture_logits(model, x)
        assert (x["token_ids"][0, :length] == config["image_token_index"]).sum() == 4
        np.testing.assert_allclose(logits[0], expected[0, :length], atol=1e-3)
        got.append(logits[0, -1])
    assert np.abs(got[0] - got[1]).max() > 1e-3  # the picture reaches the text: its colour moves the last logits


@in_torch_suite
def test_transformers_processor_gives_keras_hub_s_ids_and_pixels(hf_export, tuned, vision_run):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    from PIL import Image

    _, folder = vision_run
    processor = transformers.AutoProcessor.from_pretrained(hf_export)
    x, _ = tuned[0]
    got = processor(text=VISION_PROMPT, images=[[Image.open(folder / "red.png")]], return_tensors="np")
    length = int(x["padding_mask"][0].sum())
    assert got["input_ids"][0].tolist() == x["token_ids"][0, :length].tolist()
    np.testing.assert_allclose(got["pixel_values"][0], np.transpose(x["images"][0, 0], (2, 0, 1)), atol=1e-5)


@in_torch_suite
def test_peft_on_the_hf_base_gives_the_fine_tuned_logits(vision_run, tuned, tmp_path):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    run, _ = vision_run
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        finetune.export(run, "hf", tmp_path / "base", base=True)
    )
    (x, expected), _ = tuned
    before, length = picture_logits(base, x)
    assert np.abs(before[0] - expected[0, :length]).max() > 1e-3  # the base alone is not the fine-tuned model
    adapted = peft.PeftModel.from_pretrained(base, finetune.export(run, "peft", tmp_path / "peft"))
    adapted_names = [name for name, _ in adapted.named_modules() if name.endswith("lora_A")]
    assert len(adapted_names) == 7 * 2 and not [name for name in adapted_names if "vision" in name]
    np.testing.assert_allclose(picture_logits(adapted, x)[0][0], expected[0, :length], atol=1e-3)


@in_torch_suite
def test_lora_export_loads_onto_the_vision_preset_with_plain_keras_hub(vision_run, tuned, tmp_path):
    import keras
    import keras_hub

    from finetune.model import presets

    run, _ = vision_run
    out = finetune.export(run, "lora", tmp_path / "lora")
    described = json.loads((out / "adapter.json").read_text())
    with float32_policy():
        vocabulary = presets.tiny_vocabulary_size("tiny-gemma3-vision")
        backbone = presets.tiny_backbone(vocabulary, name="tiny-gemma3-vision")
        backbone.enable_lora(described["rank"], target_layer_names=described["targets"])
        for layer in backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):
                layer.lora_alpha = described["alpha"]
        backbone.load_lora_weights(str(out / "adapter.lora.h5"))
        lm = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)
        for x, expected in tuned:
            np.testing.assert_allclose(keras.ops.convert_to_numpy(lm(x)), expected, atol=1e-5)


CLIP_BLOCK = ["attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_up", "ffn_down"]


@gguf_marks
@in_torch_suite
def test_gguf_of_a_vision_run_writes_llama_cpp_s_mmproj_beside_the_decoder(vision_run, hf_export, tmp_path):
    """mmproj.gguf holds the SigLIP tower and projector under llama.cpp's clip names, with the values of the
    transformers export (checked against transformers above); model.gguf the decoder, as for text."""
    from safetensors.numpy import load_file

    run, _ = vision_run
    out = export(run, "gguf", tmp_path / "gguf")
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", MARKER, "mmproj.gguf", "model.gguf"]
    text, text_fields = read_gguf(out / "model.gguf")
    assert text_fields["general.architecture"] == "gemma3" and not [n for n in text if n.startswith(("v.", "mm."))]
    tensors, fields = read_gguf(out / "mmproj.gguf")
    assert fields["general.architecture"] == "clip" and fields["general.type"] == "mmproj"
    assert fields["clip.projector_type"] == "gemma3" and fields["clip.has_vision_encoder"] is True
    encoder = presets.TINY_GEMMA3_VISION_ENCODER
    expected_fields = {
        "clip.vision.image_size": 32, "clip.vision.patch_size": 4, "clip.vision.embedding_length": 16,
        "clip.vision.feed_forward_length": 32, "clip.vision.block_count": 2, "clip.vision.attention.head_count": 2,
        "clip.vision.projection_dim": 32, "clip.vision.image_mean": [0.5] * 3, "clip.vision.image_std": [0.5] * 3,
        "clip.use_gelu": True, "clip.vision.projector.scale_factor": 4,
    }  # fmt: skip
    assert encoder["image_size"] == 32 and encoder["pool_size"] == 4  # the numbers above are the preset's
    # tiny's 8x8 patches pool 4x4 into 2x2 soft tokens: factor 4 is llama.cpp's default, which the file leaves out
    expected_fields.pop("clip.vision.projector.scale_factor")
    assert {key: fields.get(key) for key in expected_fields} == expected_fields
    names = {"v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight",
             "v.post_ln.bias", "mm.input_projection.weight", "mm.soft_emb_norm.weight"}  # fmt: skip
    names |= {f"v.blk.{i}.{n}.{kind}" for i in range(2) for n in CLIP_BLOCK for kind in ("weight", "bias")}
    assert set(tensors) == names
    assert tensors["v.patch_embd.weight"][:2] == ((4, 4, 3, 16), "F32")  # ggml order of (out, channels, 4, 4)
    assert tensors["mm.input_projection.weight"][:2] == ((32, 16), "F16")  # transformers' (vision, text)
    assert tensors["v.blk.1.attn_q.weight"][1] == "F16" and tensors["v.blk.1.ln1.bias"][1] == "F32"
    hf = load_file(str(hf_export / "model.safetensors"))
    tower, projector = "model.vision_tower.", "model.multi_modal_projector."
    pairs = {
        "v.patch_embd.weight": tower + "embeddings.patch_embedding.weight",
        "v.position_embd.weight": tower + "embeddings.position_embedding.weight",
        "v.blk.1.attn_q.weight": tower + "encoder.layers.1.self_attn.q_proj.weight",
        "v.blk.0.attn_out.bias": tower + "encoder.layers.0.self_attn.out_proj.bias",
        "v.blk.1.ffn_down.weight": tower + "encoder.layers.1.mlp.fc2.weight",
        "v.post_ln.weight": tower + "post_layernorm.weight",
        "mm.input_projection.weight": projector + "mm_input_projection_weight",
    }
    for name, hf_name in pairs.items():
        np.testing.assert_allclose(tensors[name][2].reshape(hf[hf_name].shape), hf[hf_name], rtol=1e-3, atol=1e-4)
    norm = hf[projector + "mm_soft_emb_norm.weight"]
    np.testing.assert_allclose(tensors["mm.soft_emb_norm.weight"][2], 1.0 + norm, atol=1e-6)  # Gemma's 1 + scale
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\nFROM ./mmproj.gguf\n"), modelfile


def llama_cpp_gemma3_projector(tensors, fields, image):
    """The soft tokens llama.cpp's clip graph makes of `image` (H, W, 3, already scaled to [-1, 1]) with a gemma3
    projector, in numpy (float64): patches by the patch embedding, positions, SigLIP blocks (LayerNorm, attention
    and a tanh-GELU MLP, with biases), the last LayerNorm, average pooling of the patch grid, RMSNorm by
    soft_emb_norm, and the input projection (stored as transformers' (vision, text), so x @ W)."""
    w = {name: value[2].astype(np.float64).reshape(value[0][::-1]) for name, value in tensors.items()}
    eps, heads = fields["clip.vision.attention.layer_norm_epsilon"], fields["clip.vision.attention.head_count"]
    size, patch = fields["clip.vision.image_size"], fields["clip.vision.patch_size"]
    side = size // patch
    pieces = image.reshape(side, patch, side, patch, 3).transpose(0, 2, 4, 1, 3).reshape(side * side, -1)
    x = pieces @ w["v.patch_embd.weight"].reshape(len(w["v.patch_embd.bias"]), -1).T + w["v.patch_embd.bias"]
    x = x + w["v.position_embd.weight"]

    def layer_norm(x, name):
        centred = x - x.mean(-1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * w[name + ".weight"] + w[name + ".bias"]

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    for i in range(fields["clip.vision.block_count"]):
        p = f"v.blk.{i}."
        h = layer_norm(x, p + "ln1")
        q, k, v = (linear(h, p + n).reshape(len(x), heads, -1) for n in ("attn_q", "attn_k", "attn_v"))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(np.einsum("hqk,khd->qhd", probs, v).reshape(len(x), -1), p + "attn_out")
        g = linear(layer_norm(x, p + "ln2"), p + "ffn_up")
        g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        x = x + linear(g, p + "ffn_down")
    x = layer_norm(x, "v.post_ln")
    pool = fields.get("clip.vision.projector.scale_factor", 4)
    tokens = side // pool
    x = x.reshape(tokens, pool, tokens, pool, -1).mean(axis=(1, 3)).reshape(tokens * tokens, -1)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w["mm.soft_emb_norm.weight"]
    return x @ w["mm.input_projection.weight"]  # read back as transformers' (vision, text): llama.cpp transposes it


@gguf_marks
@in_torch_suite
def test_mmproj_computed_as_llama_cpp_does_gives_keras_hub_s_soft_tokens(vision_run, tuned, tmp_path):
    """No llama.cpp binding installs here: its clip graph for Gemma 3, in numpy, reads the file instead."""
    import keras

    run, _ = vision_run
    tensors, fields = read_gguf(export(run, "gguf", tmp_path / "gguf", "--dtype", "f32") / "mmproj.gguf")
    with float32_policy():
        encoder = finetune.load(run).backbone.vision_encoder
        for x, _ in tuned:
            picture = x["images"][:1, :1]  # the first picture of the row, already scaled as the converter scales
            expected = keras.ops.convert_to_numpy(encoder(picture))[0]
            got = llama_cpp_gemma3_projector(tensors, fields, picture[0, 0].astype(np.float64))
            assert got.shape == expected.shape == (4, 32)
            # the input projection is f16 whatever --dtype, as llama.cpp's converter writes it
            np.testing.assert_allclose(got, expected, atol=1e-3)  # measured: 1.7e-4


@pytest.mark.one_backend
@pytest.mark.parametrize("kind", ["Gemma4Backbone", "Gemma3nBackbone"])
@pytest.mark.parametrize("fmt", ["hf", "peft", "gguf"])
def test_other_families_with_an_encoder_are_refused_naming_what_works(kind, fmt):
    from finetune.exports import export
    from finetune.platform.errors import UserError

    backbone = type(kind, (), {"vision_encoder": object(), "audio_encoder": None})()
    with pytest.raises(UserError, match="use --format merged or lora"):
        export.check_encoders(backbone, fmt)
    export.check_encoders(type(kind, (), {"vision_encoder": None})(), fmt)  # the text decoder alone is exported


@pytest.mark.backend_neutral  # the refusal and the base are Python and keras' float weights
def test_a_quantized_run_exports_its_float_base_for_the_peft_adapter_and_refuses_a_merge(tmp_path):
    """QLoRA's adapter loads onto the float base, quantized as it loads: `--format hf --base` writes that base, with
    a note, where the merged formats are refused (the adapter merged into the float base is not what trained)."""
    out = tmp_path / "run"
    trained = CliRunner().invoke(app, ["gemma", "--preset", "tiny", "--backend", BACKEND, "--quantize", "int8",
                                       "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--max-records",
                                       "12", "--set", "train.samples=0", "--output", str(out)])  # fmt: skip
    assert trained.exit_code == 0, trained.output
    written = invoke("--run", out, "--format", "hf", "--base", "--output", tmp_path / "base")
    assert written.exit_code == 0, written.output
    assert "the base is written in float; the run trained on its int8 quantization" in written.output
    assert (tmp_path / "base" / "model.safetensors").is_file()
    # safetensors' own writer left the weights readable by their owner alone, beside a config.json all could read
    modes = {name: (tmp_path / "base" / name).stat().st_mode & 0o777 for name in ("model.safetensors", "config.json")}
    assert modes["model.safetensors"] == modes["config.json"], modes
    merged = invoke("--run", out, "--format", "hf", "--output", tmp_path / "merged")
    assert merged.exit_code == 2 and "export it with --format peft or lora" in merged.output
    assert not (tmp_path / "merged").exists()
