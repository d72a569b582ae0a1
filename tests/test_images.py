"""Pictures in the data: TRL's and LLaMA-Factory's forms, their refusals, and the tiny vision presets (Gemma 3's and
Gemma 4's encoders) training on them (both forms, mixed in one file), resuming, evaluating, generating and exporting
merged. A path that is the same for both families runs tiny-gemma4-vision in the PyTorch suite alone."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import BACKEND, float32_policy, invoke, killed_after

from finetune.data import formats, images

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
GEMMA4 = "tiny-gemma4-vision"
GEMMA3N = "tiny-gemma3n-vision"
# A test of both vision presets runs tiny-gemma4-vision on every backend where its path differs by backend (its
# converter, encoder and generation), and in the PyTorch suite alone where it does not (resuming, text alone).
EVERY_BACKEND = ["tiny-gemma3-vision", GEMMA4]
ONE_FOR_GEMMA4 = [
    "tiny-gemma3-vision",
    pytest.param(GEMMA4, marks=pytest.mark.skipif(BACKEND != "torch", reason="tiny-gemma3-vision covers the path on "
                                                  "every backend, tiny-gemma4-vision in the PyTorch suite")),
]  # fmt: skip


def square(path, colour="red", size=32):
    from PIL import Image

    Image.new("RGB", (size, size), COLOURS[colour]).save(path)
    return path.name


def trl(picture: str, answer: str = "red") -> dict:
    question = [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [picture],
    }


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def llama_factory(picture: str, answer: str = "red") -> dict:
    messages = [{"role": "user", "content": "<image>What colour is this?"}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": [picture]}


def pictures(tmp_path, n=8):
    """n records of coloured squares in tmp_path/pics.jsonl: TRL's form, and every other one LLaMA-Factory's."""
    names = list(COLOURS)
    forms = (trl, llama_factory)
    records = [forms[i % 2](square(tmp_path / f"sq{i}.png", names[i % 3]), names[i % 3]) for i in range(n)]
    return write_lines(tmp_path / "pics.jsonl", records)


@pytest.mark.one_backend
def test_trl_and_llama_factory_forms_read_to_the_same_record(tmp_path):
    square(tmp_path / "a.png")
    write_lines(tmp_path / "trl.jsonl", [trl("a.png")])
    write_lines(tmp_path / "lf.jsonl", [llama_factory("a.png")])
    (from_trl,), _ = formats.read(str(tmp_path / "trl.jsonl"))
    (from_lf,), _ = formats.read(str(tmp_path / "lf.jsonl"))
    assert from_trl == from_lf
    assert from_trl.turns[0] == ("user", "<image>What colour is this?")
    assert from_trl.images == (str((tmp_path / "a.png").resolve()),)  # relative to the data file
    assert formats.fingerprint([from_trl]) != formats.fingerprint(
        [formats.Record("<image>What colour is this?", "red")]
    )


def _missing(tmp_path):
    return [trl("nowhere.png")]


def _not_an_image(tmp_path):
    (tmp_path / "notes.png").write_text("not a picture")
    return [trl("notes.png")]


def _truncated(tmp_path):
    square(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
    return [trl("cut.png")]


def _more_placeholders(tmp_path):
    record = trl(square(tmp_path / "a.png"))
    record["messages"][0]["content"].insert(0, {"type": "image"})
    return [record]


def _fewer_placeholders(tmp_path):
    record = trl(square(tmp_path / "a.png"))
    record["images"].append(square(tmp_path / "b.png"))
    return [record]


def _too_large(tmp_path):
    square(tmp_path / "big.png", size=200)  # 40,000 pixels, past the limit the test sets
    return [trl("big.png")]


BAD = {
    "missing-image": (_missing, "does not exist"),
    "not-an-image": (_not_an_image, "is not an image"),
    "truncated-image": (_truncated, "cannot be read"),
    "more-placeholders-than-images": (_more_placeholders, "2 <image> placeholder(s) and 1 image(s)"),
    "fewer-placeholders-than-images": (_fewer_placeholders, "1 <image> placeholder(s) and 2 image(s)"),
    "decompression-bomb": (_too_large, "too large to decode"),
}


@pytest.mark.one_backend
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_picture_exits_2_naming_its_line_and_writes_nothing(case, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    make, expected = BAD[case]
    good = trl(square(tmp_path / "good.png"))
    data = write_lines(tmp_path / "bad.jsonl", [good, *make(tmp_path)])
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--data", data, "--output", out)
    message = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert message.startswith("error: ") and f"{data}:2" in message and expected in message, message
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "preset, why",
    [
        ("tiny", "tiny has no vision encoder;"),
        ("tiny-gemma3n", "a run on text builds Gemma 3n without its image encoder"),
    ],
)
def test_pictures_on_a_preset_without_a_vision_encoder_exit_2_naming_those_with_one(preset, why, tmp_path):
    result = invoke("gemma", "--preset", preset, "--data", pictures(tmp_path), "--output", tmp_path / "run")
    assert result.exit_code == 2 and why in result.stderr, result.output
    assert "tiny-gemma3-vision, tiny-gemma4-vision, tiny-gemma3n-vision, gemma3_4b and up" in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", [*EVERY_BACKEND, GEMMA3N])
def test_image_inputs_point_at_the_soft_tokens_and_weigh_nothing(preset, tmp_path):
    from finetune.data import templates
    from finetune.methods import prepare

    vision = images.vision_of(vision_preprocessor(preset))
    assert vision.tokens_per_image == 4
    record = formats.read(str(pictures(tmp_path, 1)))[0][0]
    template = templates.get("gemma4-chat" if preset == GEMMA4 else "gemma-chat")
    ((_, example),) = prepare.pictured_examples([record], template, vision_preprocessor(preset), _cfg(preset), "x")
    ids = np.asarray(example.token_ids)
    soft = np.flatnonzero(ids[:-1] == vision.placeholder_id)
    assert list(example.inputs["vision_indices"][:4]) == list(soft) and len(soft) == 4
    assert not np.asarray(example.weights)[ids == vision.placeholder_id].any()
    red = np.array(COLOURS["red"])
    if preset != GEMMA4:
        assert vision.image_size == (32, 32)
        picture = example.inputs["images"]
        assert picture.shape == (1, 32, 32, 3)  # one slot a row: the most pictures a record of the data holds
        scaled = red / 255 if preset == GEMMA3N else red / 127.5 - 1  # MobileNetV5 takes [0, 1], SigLIP [-1, 1]
        np.testing.assert_allclose(picture[0, 0, 0], scaled, atol=1e-6)
        return
    # Gemma 4's converter: the 32x32 square as 16 patches of 8x8 (each flattened row by row, then channels) with
    # their (x, y) places. It scales to [0, 1]; the encoder maps that to [-1, 1] itself.
    patches, places = example.inputs["pixel_values"], example.inputs["pixel_position_ids"]
    assert patches.shape == (1, 16, 192) and places.shape == (1, 16, 2)
    np.testing.assert_allclose(patches[0, 5, :3], red / 255, atol=1e-5)
    assert places[0, :5].tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1]]
    assert vision.image_size is None and "<|image>" in images.shown("<|image|>x", vision)


@pytest.mark.one_backend
def test_every_row_has_room_for_the_most_pictures_a_record_holds(tmp_path):
    from finetune.data import templates
    from finetune.methods import prepare

    two = trl(square(tmp_path / "b.png", "blue"), "blue")
    two["messages"][0]["content"].insert(0, {"type": "image"})
    two["images"].insert(0, square(tmp_path / "c.png", "green"))
    text = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}], "images": []}
    path = write_lines(tmp_path / "mixed.jsonl", [trl(square(tmp_path / "a.png")), two, text])
    records = formats.read(str(path))[0]
    made = prepare.pictured_examples(
        records, templates.get("gemma-chat"), vision_preprocessor(), _cfg("tiny-gemma3-vision"), "x"
    )
    (_, one), (_, both), (_, text) = made
    assert [e.inputs["images"].shape[0] for e in (one, both, text)] == [2, 2, 2]
    assert one.inputs["images"][0].any() and not one.inputs["images"][1].any()  # its second slot is blank
    assert both.inputs["images"][1].any() and not text.inputs["images"].any()
    assert not one.inputs["vision_indices"][4:].any() and both.inputs["vision_indices"][4:].all()


def vision_preprocessor(preset="tiny-gemma3-vision"):
    from finetune.model import presets

    return presets.tiny_preprocessor(preset, presets.tiny_tokenizer(preset), 64)


def _cfg(preset):
    from types import SimpleNamespace

    return SimpleNamespace(model=SimpleNamespace(seq_len=64, preset=preset),
                           data=SimpleNamespace(train_on_prompt=False))  # fmt: skip


@pytest.mark.skipif(BACKEND != "torch", reason="a property of keras-hub's model, checked in the PyTorch suite; every "
                    "suite trains on pictures")  # fmt: skip
@pytest.mark.parametrize("preset", [*EVERY_BACKEND, GEMMA3N])
def test_the_picture_reaches_the_decoder(preset):
    """The text after an image reads the image: its hidden states change with the picture's colour."""
    import keras

    from finetune.model import presets

    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size(preset), name=preset)
    names = [tensor.name for tensor in keras.tree.flatten(backbone.inputs)]
    preprocessor = vision_preprocessor(preset)
    prompt = images.vision_of(preprocessor).marker + "What colour is this?"
    hidden = []
    for colour in ("red", "blue"):
        picture = np.full((32, 32, 3), COLOURS[colour], np.uint8)
        x = preprocessor.generate_preprocess({"prompts": [prompt], "images": [[picture]]})
        x = {k: keras.ops.convert_to_numpy(v) for k, v in x.items()}
        hidden.append(keras.ops.convert_to_numpy(backbone({k: v for k, v in x.items() if k in names})))
    soft = np.flatnonzero(x["vision_mask"][0])
    after = int(soft[-1]) + 2  # a text token after the picture
    assert np.abs(hidden[0][0, after] - hidden[1][0, after]).max() > 1e-4
    np.testing.assert_allclose(hidden[0][0, : soft[0]], hidden[1][0, : soft[0]], atol=1e-6)  # before it: the same


def settings(out, data, preset="tiny-gemma3-vision", **more):
    return {
        "backend": BACKEND, "output.dir": str(out), "model.preset": preset, "model.seq_len": 64,
        "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 6, "train.checkpoint_every": 3,
        "train.keep_checkpoints": 3,
        "train.samples": 1, "train.max_new_tokens": 2, "data.path": str(data), "data.template": "auto", **more,
    }  # fmt: skip


@pytest.fixture(scope="module", params=EVERY_BACKEND)
def trained(request, tmp_path_factory):
    """A 6-step run of a tiny vision preset on 12 pictures, checkpointed every 3 steps: (run directory, data,
    metrics, preset, the times it handed freed host memory back)."""
    import finetune
    from finetune.platform import backend

    folder = tmp_path_factory.mktemp("pictures")
    data = pictures(folder, 12)
    out = folder / "run"
    released = []
    with float32_policy(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "release_freed_host_memory", lambda: released.append(1) or True)
        metrics = finetune.run(finetune.load_config("tiny", settings(out, data, request.param)))
    return out, data, metrics, request.param, len(released)


def test_a_tiny_vision_preset_trains_and_evaluates_on_pictures(trained):
    import finetune

    out, data, metrics, _, released = trained
    assert metrics["steps"] == 6 and metrics["packing"] is False and np.isfinite(metrics["eval_loss"])
    assert released == 6  # on a CPU, after each step: the next step's encoder pass does not stack on its leftovers
    resolved = (out / "config.yaml").read_text()
    assert "the data has images" in resolved
    adapted = [entry["layer"] for entry in json.loads((out / "adapter.json").read_text())["adapted"]]
    assert adapted and not [path for path in adapted if "vision" in path or "image" in path], adapted
    again = finetune.evaluate(out)  # `finetune eval` scores the held-out pictures as training did
    assert again["loss"] == pytest.approx(metrics["eval_loss"], rel=1e-4)


def test_a_vision_run_killed_after_a_checkpoint_resumes_to_the_same_adapter(trained, tmp_path):
    from test_families import adapter_arrays

    import finetune

    whole, data, _, preset, _ = trained
    if preset == GEMMA4 and BACKEND != "torch":
        pytest.skip("resuming is the same for both families: tiny-gemma4-vision resumes in the PyTorch suite")
    out = tmp_path / "killed"
    killed_after(whole, out, 3)
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", settings(out, data, preset)), resume=True)
    assert metrics["resumed_from_step"] == 3 and metrics["steps"] == 6
    expected, got = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_generate_takes_pictures_through_the_api(trained):
    import finetune
    from finetune.platform.errors import UserError

    out, data, _, _, _ = trained
    picture = str(data.parent / "sq0.png")
    (answer,) = finetune.generate(out, "What colour is this?", images=[picture], max_new_tokens=2)
    assert isinstance(answer, str) and "<img>" not in answer and "<|image|>" not in answer, answer  # soft tokens
    with pytest.raises(UserError, match="2 <image> placeholder"):
        finetune.generate(out, "<image> or <image>?", images=[picture], max_new_tokens=2)
    with pytest.raises(UserError, match="does not exist"):
        finetune.generate(out, "What colour?", images=[str(data.parent / "nowhere.png")])


@pytest.mark.one_backend
def test_finetune_data_counts_the_pictures(tmp_path):
    from finetune.tools import datacheck

    data = pictures(tmp_path, 3)
    square(tmp_path / "wide.png", size=48)
    lines = datacheck.report(str(data), "tiny-gemma3-vision", "auto", 64)
    assert "images: 3 in 3 of 3 records, at most 1 a record" in lines
    assert any(line.startswith("image sizes") and "32x32 (3)" in line for line in lines), lines
    assert any(line.startswith("packing: off for data with images") for line in lines), lines


@pytest.mark.parametrize("preset", ONE_FOR_GEMMA4)
def test_the_command_line_trains_on_pictures_and_generates_from_one(preset, tmp_path):
    """`finetune gemma` on a picture file, then `finetune generate --image`, each in a fresh process as typed."""
    from test_as_typed import finetune as typed

    pictures(tmp_path, 8)
    typed("gemma", "--preset", preset, "--backend", BACKEND, "--data", "pics.jsonl", "--max-steps",
          "2", "--seq-len", "64", "--batch-size", "2", "--eval-fraction", "0", "--set", "train.samples=0", "--output", "run",
          cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    answered = typed("generate", "--run", "run", "--image", "sq1.png", "--prompt", "What colour is this?",
                     "--max-new-tokens", "2", cwd=tmp_path)  # fmt: skip
    assert answered.stdout.strip() and "generated on" in answered.stderr


def test_a_merged_export_of_a_vision_run_gives_its_outputs_on_a_picture_in_keras_hub(trained, tmp_path):
    import keras
    import keras_hub

    import finetune
    from finetune.training import runs

    out, data, _, preset, _ = trained
    if preset == GEMMA4:
        pytest.skip("keras-hub 0.32's Gemma4ImageConverter.get_config leaves out max_soft_tokens and "
                    "pooling_kernel_size: a saved tiny-gemma4-vision reloads a converter of Gemma 4's sizes")  # fmt: skip
    finetune.export(out, "merged", tmp_path / "merged")
    lm = keras_hub.models.Gemma3CausalLM.from_preset(str(tmp_path / "merged"))
    assert lm.preprocessor.image_converter is not None and lm.preprocessor.num_vision_tokens_per_image == 4
    picture = images.rgb(data.parent / "sq2.png")
    prompt = "<start_of_turn>user\n<start_of_image>What colour is this?<end_of_turn>\n<start_of_turn>model\n"
    x = lm.preprocessor.generate_preprocess({"prompts": [prompt], "images": [[picture]]}, sequence_length=40)
    x = {name: keras.ops.convert_to_numpy(value) for name, value in x.items()}
    tuned, _ = runs.load_model(runs.open_on(str(out), None))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(lm.backbone(x)), keras.ops.convert_to_numpy(tuned.backbone(x)), atol=1e-4
    )


@pytest.mark.parametrize("preset", ONE_FOR_GEMMA4)
def test_a_vision_preset_trains_on_text_alone_unpacked(preset, tmp_path):
    """Text records feed no pictures (the encoder is skipped), and the rows are not packed: a vision model's decoder
    takes keras-hub's own mask, which would let packed examples attend to each other."""
    data = write_lines(tmp_path / "text.jsonl", [{"instruction": f"Add {i} and 1.", "response": f"{i + 1}"}
                                                  for i in range(8)])  # fmt: skip
    out = tmp_path / "run"
    flags = ["--backend", BACKEND, "--seq-len", "64", "--batch-size", "2", "--max-steps", "1", "--eval-fraction", "0"]
    result = invoke("gemma", "--preset", preset, "--data", data, *flags, "--output", out,
                    "--set", "train.samples=0")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert "auto: a model with an image or audio encoder takes keras-hub's own mask" in result.output
    assert json.loads((out / "metrics.json").read_text())["steps"] == 1


def batch_hidden(lm, arrays, rows, seq_len=64):
    """The backbone's hidden states of `rows` of padded `arrays`, fed as a run feeds them (the model's own inputs)."""
    import keras

    from finetune.data import batching
    from finetune.model import builder

    names = builder.input_names(lm)
    x, _, _ = batching.inputs(arrays, np.array(rows), 1, seq_len, names=names)
    x = {name: x[name] for name in names}
    x["padding_mask"] = x["padding_mask"] > 0
    return keras.ops.convert_to_numpy(lm.backbone(x))


@pytest.mark.skipif(BACKEND != "torch", reason="the batch's layout is the same on every backend; every suite trains "
                    "tiny-gemma3n-vision on pictures")  # fmt: skip
def test_a_gemma3n_row_reads_its_own_picture_beside_a_row_with_more(tmp_path):
    """keras-hub's Gemma 3n places the batch's pictures by their order in the whole batch, not by row. A row with two
    pictures after a row with one (and an empty slot) gives the same hidden states as it does alone: the batch's
    pictures are laid out in their order, then the empty slots (images.in_batch_order)."""
    from finetune.data import batching, templates
    from finetune.methods import prepare
    from finetune.model import builder, presets

    one = trl(square(tmp_path / "a.png", "red"))
    two = trl(square(tmp_path / "b.png", "blue"), "blue")
    two["messages"][0]["content"].insert(0, {"type": "image"})
    two["images"].insert(0, square(tmp_path / "c.png", "green"))
    records = formats.read(str(write_lines(tmp_path / "mixed.jsonl", [one, two])))[0]
    made = prepare.pictured_examples(
        records, templates.get("gemma-chat"), vision_preprocessor(GEMMA3N), _cfg(GEMMA3N), "x"
    )
    arrays = batching.pad([example for _, example in made], 64)
    lm, _ = builder.build(presets.resolve(GEMMA3N), 64, "float32", images=True)
    names = builder.input_names(lm)  # the model's own: its causal LM declares indices its backbone never reads
    assert "vision_indices" not in names

    def hidden(rows):
        return batch_hidden(lm, arrays, rows)

    both, alone = hidden([0, 1]), hidden([1])
    length = len(made[1][1].token_ids) - 1
    np.testing.assert_allclose(both[1, :length], alone[0, :length], atol=1e-5)
    np.testing.assert_allclose(both[0], hidden([0])[0], atol=1e-5)
    np.testing.assert_allclose(hidden([1, 0])[0], alone[0], atol=1e-5)  # first, beside one with fewer
    flat = batching.inputs(arrays, np.array([0, 1]), 1, 64, names=names)[0]["images"].reshape(4, -1)
    assert flat[:3].any(axis=1).all() and not flat[3].any()  # the three pictures, then the empty slot


def test_gemma3n_trains_on_pictures_from_the_command_line_generates_and_exports_merged(tmp_path):
    """tiny-gemma3n-vision through `finetune gemma`, `finetune generate --image` and `finetune export --format merged`,
    each in a fresh process as typed; the merged preset reloads in keras-hub with its image converter and gives the
    run's outputs on a picture (in the PyTorch suite)."""
    from test_as_typed import finetune as typed

    pictures(tmp_path, 8)
    typed("gemma", "--preset", GEMMA3N, "--backend", BACKEND, "--data", "pics.jsonl", "--max-steps", "2",
          "--seq-len", "64", "--batch-size", "2", "--eval-fraction", "0", "--precision", "float32",
          "--set", "train.samples=0", "--output", "run", cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    answered = typed("generate", "--run", "run", "--image", "sq1.png", "--prompt", "What colour is this?",
                     "--max-new-tokens", "2", cwd=tmp_path)  # fmt: skip
    assert answered.stdout.strip() and "What colour" not in answered.stdout, answered.stdout  # the answer alone
    if BACKEND == "torch":  # the export is the same from every backend's run
        typed("export", "--run", "run", "--format", "merged", "--output", "merged", cwd=tmp_path)
        _merged_gives_the_runs_outputs(tmp_path / "merged", tmp_path / "run", tmp_path / "sq2.png")


def _merged_gives_the_runs_outputs(merged, run, picture):
    import keras
    import keras_hub

    from finetune.training import runs

    with float32_policy():
        tuned, _ = runs.load_model(runs.open_on(str(run), None))
        lm = keras_hub.models.Gemma3nCausalLM.from_preset(str(merged))
    assert lm.preprocessor.image_converter is not None and lm.preprocessor.num_vision_tokens_per_image == 4
    prompt = "<start_of_turn>user\n<start_of_image>What colour is this?<end_of_turn>\n<start_of_turn>model\n"
    x = lm.preprocessor.generate_preprocess(
        {"prompts": [prompt], "images": [[images.rgb(picture)]]}, sequence_length=40
    )
    names = [tensor.name for tensor in keras.tree.flatten(lm.backbone.inputs)]
    x = {name: keras.ops.convert_to_numpy(value) for name, value in x.items() if name in names}
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(lm.backbone(x)), keras.ops.convert_to_numpy(tuned.backbone(x)), atol=1e-4
    )


@pytest.mark.one_backend
def test_a_prompt_of_trl_s_content_parts_reads_as_its_placeholder_form(tmp_path):
    """GRPO's prompts as messages take TRL's content parts, as SFT's messages do: they were refused ("message 1
    must be an object with a `role` and a string `content`"), text parts alone too."""
    square(tmp_path / "a.png")
    parts = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    write_lines(tmp_path / "parts.jsonl", [{"prompt": [{"role": "user", "content": parts}], "images": ["a.png"],
                                            "answer": "red"}])  # fmt: skip
    write_lines(tmp_path / "text.jsonl", [{"prompt": [{"role": "user", "content": "<image>What colour?"}],
                                           "images": ["a.png"], "answer": "red"}])  # fmt: skip
    (from_parts,), found = formats.read(str(tmp_path / "parts.jsonl"))
    (from_text,), _ = formats.read(str(tmp_path / "text.jsonl"))
    assert found == "prompts-chat" and dataclasses.replace(from_parts, where="") == dataclasses.replace(
        from_text, where="")  # fmt: skip
    assert from_parts.images == (str(tmp_path / "a.png"),) and from_parts.turns == (("user", "<image>What colour?"),)
    write_lines(tmp_path / "plain.jsonl", [{"prompt": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}])
    (plain,), _ = formats.read(str(tmp_path / "plain.jsonl"))
    assert plain.turns == (("user", "Hi"),) and plain.images == ()


@pytest.mark.one_backend  # token counts: numpy's and the tokenizer's
@pytest.mark.parametrize("preset", ["tiny-gemma3-vision", GEMMA3N])
def test_finetune_data_counts_a_picture_as_the_preset_s_soft_tokens(preset, tmp_path):
    """`finetune data` counted each `<image>` as its text; it counts the soft tokens a run writes, so its longest
    record is the run's own (prepare.pictured_examples), and a preset that sees no pictures says why it cannot."""
    from types import SimpleNamespace

    from finetune.data import templates
    from finetune.methods import prepare

    data = pictures(tmp_path, 4)
    result = invoke("data", str(data), "--preset", preset, "--seq-len", "64")
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("tokens (")]
    assert f"each picture and clip as {preset}'s soft tokens" in line, line
    records, _ = formats.read(str(data))
    made = prepare.pictured_examples(records, templates.get("gemma-chat"), vision_preprocessor(preset),
                                     SimpleNamespace(model=SimpleNamespace(seq_len=4096, preset=preset),
                                                     data=SimpleNamespace(train_on_prompt=False)), "x")  # fmt: skip
    assert line.endswith(f"max {max(len(e.token_ids) for _, e in made):,}"), line
    text = invoke("data", str(data), "--preset", "tiny", "--seq-len", "64")
    assert "each <image> and <audio> counted as its text: " in text.output and "no vision encoder" in text.output
