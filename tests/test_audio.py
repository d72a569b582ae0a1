"""Audio clips in the data: LLaMA-Factory's `audios` column and audio content parts, their refusals, resampling, and
tiny-gemma4-audio learning to tell a tone from noise on every backend, then answering `finetune generate --audio`.
The clips are written here with numpy and soundfile."""

import json

import numpy as np
import pytest
from conftest import BACKEND, invoke

from finetune.data import audio, formats
from finetune.methods import prepare

RATE = 16000


def clip(path, kind="tone", seconds=0.5, rate=RATE, seed=0):
    """A clip: a sine between 300 and 900 Hz, or white noise; its file name."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    sound = 0.5 * np.sin(2 * np.pi * rng.uniform(300, 900) * t) if kind == "tone" else 0.3 * rng.standard_normal(len(t))
    soundfile.write(str(path), sound.astype(np.float32), rate)
    return path.name


def llama_factory(name: str, answer: str) -> dict:
    messages = [{"role": "user", "content": "<audio>What is this?"}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "audios": [name]}


def parts(name: str, answer: str) -> dict:
    question = [{"type": "audio", "path": name}, {"type": "text", "text": "What is this?"}]
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sounds(folder, n=24):
    """n records, tones and noise by turns (WAV, every third one FLAC), each asking what it is: both forms."""
    records = []
    for i in range(n):
        kind = ("tone", "noise")[i % 2]
        name = clip(folder / f"c{i}.{'flac' if i % 3 == 0 else 'wav'}", kind, seed=i)
        records.append((llama_factory, parts)[(i // 2) % 2](name, kind))
    return write_lines(folder / "sounds.jsonl", records)


@pytest.mark.one_backend
def test_llama_factory_s_column_and_content_parts_read_to_the_same_record(tmp_path):
    clip(tmp_path / "a.wav")
    write_lines(tmp_path / "lf.jsonl", [llama_factory("a.wav", "tone")])
    write_lines(tmp_path / "parts.jsonl", [parts("a.wav", "tone")])
    (from_lf,), _ = formats.read(str(tmp_path / "lf.jsonl"))
    (from_parts,), _ = formats.read(str(tmp_path / "parts.jsonl"))
    assert from_lf == from_parts and from_lf.audios == (str((tmp_path / "a.wav").resolve()),)
    assert from_lf.turns[0] == ("user", "<audio>What is this?")
    assert formats.fingerprint([from_lf]) != formats.fingerprint([formats.Record("<audio>What is this?", "tone")])


@pytest.mark.one_backend
def test_a_clip_at_another_rate_is_resampled_to_the_converter_s(tmp_path):
    """A 440 Hz tone at 8 kHz and in stereo comes back at 16 kHz, mono, as long, with its pitch."""
    import soundfile

    t = np.arange(4000) / 8000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    soundfile.write(str(tmp_path / "low.wav"), np.stack([tone, tone], axis=1).astype(np.float32), 8000)
    sound = audio.samples(tmp_path / "low.wav", RATE)
    assert sound.shape == (8000,) and audio.length(tmp_path / "low.wav", RATE) == 8000
    spectrum = np.abs(np.fft.rfft(sound))
    assert abs(np.argmax(spectrum) * RATE / len(sound) - 440) < 4


def _missing(tmp_path):
    return [llama_factory("nowhere.wav", "tone")]


def _not_audio(tmp_path):
    (tmp_path / "notes.wav").write_text("not a sound")
    return [llama_factory("notes.wav", "tone")]


def _too_long(tmp_path):
    return [llama_factory(clip(tmp_path / "long.wav", seconds=1.5), "tone")]


def _more_placeholders(tmp_path):
    record = llama_factory(clip(tmp_path / "a.wav"), "tone")
    record["messages"][0]["content"] = "<audio><audio>What is this?"
    return [record]


BAD = {
    "missing-clip": (_missing, "does not exist"),
    "not-audio": (_not_audio, "is not audio soundfile reads"),
    "more-placeholders-than-clips": (_more_placeholders, "2 <audio> placeholder(s) and 1 audio clip(s)"),
    "longer-than-the-converter-keeps": (_too_long, "this preset hears at most 1 s a clip"),
}


@pytest.mark.one_backend
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_clip_exits_2_and_writes_nothing(case, tmp_path):
    make, expected = BAD[case]
    records = [llama_factory(clip(tmp_path / "ok.wav"), "tone"), *make(tmp_path)]
    data = write_lines(tmp_path / "bad.jsonl", records)
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny-gemma4-audio", "--data", data, "--seq-len", "64", "--output", out)
    assert result.exit_code == 2 and expected in result.stderr, result.output + result.stderr
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.one_backend
@pytest.mark.parametrize("preset", ["tiny-gemma4", "tiny-gemma3-vision"])
def test_audio_on_a_preset_without_an_audio_encoder_exits_2_naming_those_with_one(preset, tmp_path):
    result = invoke("gemma", "--preset", preset, "--data", sounds(tmp_path, 4), "--output", tmp_path / "run")
    assert result.exit_code == 2 and f"{preset} has no audio encoder" in result.stderr, result.output
    assert "tiny-gemma4-audio" in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.one_backend
def test_a_clip_s_soft_tokens_follow_its_length_and_weigh_nothing(tmp_path):
    """Gemma 4 gives a clip one soft token per 4 mel frames (25 a second): a half-second clip takes 13, between
    <|audio> and <audio|>, and audio_indices points at them, as keras-hub's preprocessor lays them out."""
    from types import SimpleNamespace

    from finetune.data import templates
    from finetune.methods import prepare
    from finetune.model import presets

    preprocessor = presets.tiny_preprocessor("tiny-gemma4-audio", presets.tiny_tokenizer("tiny-gemma4-audio"), 64)
    hearing = audio.hearing_of(preprocessor)
    record = formats.read(str(sounds(tmp_path, 1)))[0][0]
    cfg = SimpleNamespace(model=SimpleNamespace(seq_len=64, preset="tiny-gemma4-audio"),
                          data=SimpleNamespace(train_on_prompt=False))  # fmt: skip
    ((_, example),) = prepare.pictured_examples([record], templates.get("gemma4-chat"), preprocessor, cfg, "x")
    ids = np.asarray(example.token_ids)
    soft = np.flatnonzero(ids[:-1] == hearing.placeholder_id)
    assert len(soft) == 13 and list(example.inputs["audio_indices"]) == list(soft)
    assert not np.asarray(example.weights)[ids == hearing.placeholder_id].any()
    assert example.inputs["audio_mel"].shape == (1, 100, 16) and example.inputs["audio_mel_mask"].sum() == 50
    import keras

    sound = audio.samples(record.audios[0], RATE)
    x = preprocessor.generate_preprocess({"prompts": ["<|audio|>What is this?"], "audio": [sound]})
    theirs = keras.ops.convert_to_numpy(x["audio_mel"])[0, 0]
    np.testing.assert_allclose(example.inputs["audio_mel"][0], theirs, atol=1e-4)  # keras-hub's converter's frames


@pytest.mark.parametrize(
    "preset",
    # CI time: Gemma 4's audio preset learns on every backend, Gemma 3n's in the PyTorch suite.
    ["tiny-gemma4-audio", pytest.param("tiny-gemma3n-audio", marks=pytest.mark.backend_neutral)],
)
def test_a_tiny_audio_preset_learns_tone_from_noise_and_answers_generate_audio(preset, tmp_path):
    """`finetune gemma` on 24 clips, tones and noise, each asking what it is: the held-out loss falls and the held-out
    accuracy rises past what the text alone gives; then `finetune generate --audio` answers, each in a fresh process as typed."""
    from test_as_typed import finetune as typed

    sounds(tmp_path)
    typed("gemma", "--preset", preset, "--backend", BACKEND, "--data", "sounds.jsonl", "--max-steps",
          "18", "--target", "all-linear", "--seq-len", "64", "--batch-size", "4", "--precision", "float32",
          "--set", "train.samples=0",
          "--output", "run", cwd=tmp_path)  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["eval_loss"] < metrics["eval_loss_before"] - 1.0, metrics
    # Half the answers are each word: above 0.5, the model tells them apart by their sound (1.0 measured).
    assert metrics["eval_accuracy"] >= 0.75 > metrics["eval_accuracy_before"], metrics
    answered = typed("generate", "--run", "run", "--audio", "c0.flac", "--prompt", "What is this?",
                     "--max-new-tokens", "2", cwd=tmp_path)  # fmt: skip
    assert answered.stdout.strip() and "What is this" not in answered.stdout, answered.stdout


@pytest.mark.one_backend
def test_generate_takes_a_clip_through_the_api_and_refuses_a_bad_one(tmp_path):
    import finetune
    from finetune.platform.errors import UserError

    data = sounds(tmp_path, 8)
    out = tmp_path / "run"
    flags = [
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
        "--eval-fraction",
        "0",
        "--precision",
        "float32",
    ]
    result = invoke("gemma", "--preset", "tiny-gemma4-audio", "--data", data, *flags, "--output", out,
                    "--set", "train.samples=0")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    (answer,) = finetune.generate(out, "What is this?", audio=str(tmp_path / "c1.wav"), max_new_tokens=2)
    assert isinstance(answer, str) and "<|audio|>" not in answer, answer
    with pytest.raises(UserError, match="does not exist"):
        finetune.generate(out, "What is this?", audio=str(tmp_path / "nowhere.wav"))
    with pytest.raises(UserError, match="2 <audio> placeholders"):
        finetune.generate(out, "<audio> or <audio>?", audio=str(tmp_path / "c1.wav"))


@pytest.mark.one_backend
def test_a_merged_export_reloads_in_keras_hub_hearing_as_the_run_and_hf_is_refused(tmp_path):
    """`--format merged` writes the audio converter beside the model: keras-hub's Gemma4CausalLM reloads it and gives
    the run's outputs on a clip. transformers' export of a Gemma 4 with an encoder is refused, with its reason."""
    import keras
    import keras_hub

    import finetune
    from finetune.training import runs

    data = sounds(tmp_path, 8)
    out = tmp_path / "run"
    flags = [
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--eval-fraction",
        "0",
        "--precision",
        "float32",
    ]
    result = invoke("gemma", "--preset", "tiny-gemma4-audio", "--data", data, *flags, "--output", out,
                    "--set", "train.samples=0")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    finetune.export(out, "merged", tmp_path / "merged")
    tuned, _ = runs.load_model(runs.open_on(str(out), None))
    lm = keras_hub.models.Gemma4CausalLM.from_preset(str(tmp_path / "merged"))
    assert lm.preprocessor.audio_converter.num_mels == 16 and lm.preprocessor.audio_converter.max_audio_length == 1
    prompt = "<|turn>user\n<|audio|>What is this?<turn|>\n<|turn>model\n"
    sound = audio.samples(tmp_path / "c0.flac", RATE)
    x = lm.preprocessor.generate_preprocess({"prompts": [prompt], "audio": [sound]}, sequence_length=48)
    names = [tensor.name for tensor in keras.tree.flatten(lm.backbone.inputs)]
    x = {name: keras.ops.convert_to_numpy(value) for name, value in x.items() if name in names}
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(lm.backbone(x)), keras.ops.convert_to_numpy(tuned.backbone(x)), atol=1e-4
    )
    refused = invoke("export", "--run", out, "--format", "hf", "--output", tmp_path / "hf")
    assert refused.exit_code == 2 and "audio encoder" in refused.stderr and not (tmp_path / "hf").exists()


@pytest.mark.one_backend
def test_the_plan_counts_a_clip_s_tokens_and_the_audio_encoder_as_built():
    from finetune import config
    from finetune.model import presets
    from finetune.platform.errors import UserError
    from finetune.training import plan

    def planned(**settings):
        return plan.make(config.load(None, {"backend": "torch", "model.seq_len": 64, **settings}), None, None)

    gemma3n = planned(**{"model.preset": "tiny-gemma3n-audio", "data.audio_seconds": 0.5})
    assert gemma3n.audio == {"seconds": 0.5, "tokens": 24}  # Gemma 3n's fixed count, and a blank line either side
    assert "24 soft tokens: 28 of the 64 tokens" in " ".join(gemma3n.notes)
    built = presets.tiny_backbone(presets.tiny_vocabulary_size("tiny-gemma3n-audio"), name="tiny-gemma3n-audio")
    assert built.audio_encoder.count_params() + built.embed_audio.count_params() == gemma3n.model.audio_params
    half = planned(**{"model.preset": "tiny-gemma4-audio", "data.audio_seconds": 0.5})
    assert half.audio == {"seconds": 0.5, "tokens": 13}  # a half-second clip, as the run writes it
    assert "audio: a clip of 0.5 s, 13 soft tokens: 15 of the 64 tokens" in " ".join(half.notes)
    assert half.memory["audio_frames"] == half.batch_size * 100 * 16 * 4 * 2
    name = "tiny-gemma4-audio"
    backbone = presets.tiny_backbone(presets.tiny_tokenizer(name).vocabulary_size(), name=name)
    assert backbone.audio_encoder.count_params() == presets.TINY_GEMMA4_AUDIO_PARAMS == half.model.audio_params
    for settings, why in [
        ({"model.preset": "tiny-gemma4", "data.audio_seconds": 1}, "it has none"),
        ({"model.preset": "gemma4_2b", "data.audio_seconds": 1}, "does not count yet"),
        ({"model.preset": "tiny-gemma4-audio", "data.audio_seconds": 2}, "hears at most 1 s a clip"),
    ]:
        with pytest.raises(UserError, match=why):
            planned(**settings)


def _pair(name: str) -> dict:
    return {"prompt": "<audio>What is this?", "chosen": "tone", "rejected": "noise", "audios": [name]}


@pytest.mark.backend_neutral  # the sampler with clips: test_rollouts.py, on every backend
def test_grpo_learns_from_prompts_with_clips(tmp_path):
    """GRPO's prompts with clips, as SFT's records hold them, in a fresh process as typed: the rollouts hear each
    prompt's clip (the sampler: test_rollouts.py, every backend) and train on it; before, such prompts were
    refused."""
    from test_as_typed import finetune as typed

    (tmp_path / "rewards.py").write_text(
        "def chars(completions, **columns):\n    return [float(len(c)) for c in completions]\n"
    )
    lines = [{"prompt": "<audio>What is this?", "audios": [clip(tmp_path / f"{i}.wav", kind, seed=i)]}
             for i, kind in enumerate(["tone", "noise"] * 4)]  # fmt: skip
    lines[1::4] = [{"prompt": "Name a sound."}] * 2  # text prompts beside them
    write_lines(tmp_path / "prompts.jsonl", lines)
    done = typed("gemma", "--preset", "tiny-gemma4-audio", "--backend", BACKEND, "--method", "grpo", "--data",
                 "prompts.jsonl", "--reward", "rewards.py:chars", "--num-generations", "2", "--batch-size", "2",
                 "--max-completion-length", "8", "--seq-len", "64", "--max-steps", "2", "--set", "train.samples=0",
                 "--output", "run", cwd=tmp_path)  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["adapter_changed"], metrics
    assert "rollout 2: reward" in done.stdout


@pytest.mark.backend_neutral  # the pairs' layout is numpy's; every suite trains on audio (above)
def test_a_preference_pair_hears_its_clip(tmp_path):
    """A pair's clip goes in its prompt, and both answers' rows carry it (prepare.Media, as SFT's rows): a tone and
    noise under the same texts train apart; before, pairs with audio were refused (their rows held the text
    <audio>)."""
    import csv

    runs = []
    for kind in ("tone", "noise"):
        data = write_lines(tmp_path / f"{kind}.jsonl", [_pair(clip(tmp_path / f"{kind}.wav", kind))] * 8)
        out = tmp_path / kind
        # bfloat16 on every machine: the default on a GPU, where keras' PyTorch einsum once refused the audio
        # encoder's mixed dtypes (keras_compat.promoted_torch_einsums)
        result = invoke("gemma", "--preset", "tiny-gemma4-audio", "--method", "dpo", "--data", data, "--max-steps",
                        "2", "--batch-size", "2", "--set", "train.samples=0", "--precision", "bfloat16",
                        "--output", out)  # fmt: skip
        assert result.exit_code == 0, result.output + result.stderr
        with (out / "history.csv").open() as f:
            runs.append([float(r["grad_norm"]) for r in csv.DictReader(f) if r["train_loss"]])
    assert len(runs[0]) == 2 and all(np.isfinite(runs[0] + runs[1]))
    assert runs[0] != runs[1]


@pytest.mark.one_backend
def test_gemma3n_gives_every_clip_its_fixed_tokens_and_keras_hub_s_frames(tmp_path):
    """tiny-gemma3n-audio: a blank line, <start_of_audio>, 24 soft tokens and <end_of_audio>, then a blank line, as
    keras-hub's Gemma3nCausalLMPreprocessor writes a clip, whatever its length; its frames are its converter's."""
    import keras

    from finetune.model import presets

    name = "tiny-gemma3n-audio"
    preprocessor = presets.tiny_preprocessor(name, presets.tiny_tokenizer(name), 64)
    hearing = audio.hearing_of(preprocessor)
    assert hearing.tokens(8000) == hearing.tokens(16000) == 24 and hearing.marker == "<start_of_audio>"
    sound = audio.samples(tmp_path / clip(tmp_path / "a.wav"), RATE)
    x = preprocessor.generate_preprocess({"prompts": ["<start_of_audio>What is this?"], "audios": [sound]})
    ids = keras.ops.convert_to_numpy(x["token_ids"])[0]
    written = preprocessor.tokenizer.tokenize(audio.written_prompt("<start_of_audio>What is this?", hearing, 8000))
    assert list(ids[1 : 1 + len(written)]) == [int(i) for i in keras.ops.convert_to_numpy(written)]
    features, held = hearing.converted(sound)
    np.testing.assert_allclose(features, keras.ops.convert_to_numpy(x["input_features"])[0, 0], atol=1e-5)
    assert held.sum() == 48 and not keras.ops.convert_to_numpy(x["input_features_mask"])[0, 0].any()  # 1: padding
    fed = audio.frames((str(tmp_path / "a.wav"),), hearing, 2, 60)["input_features_mask"]
    assert not fed[0, :48].any() and fed[0, 48:].all() and fed[1].all()  # as keras-hub feeds it: padding marked


@pytest.mark.one_backend  # the batch's layout is numpy's; every suite trains on clips
def test_a_gemma3n_row_hears_its_own_clip_beside_a_row_without_one(tmp_path):
    """keras-hub's Gemma 3n places the batch's clips by their order in the whole batch, not by row: a row with a
    clip after a text row (its slot empty) gives the hidden states it gives alone, as does the text row."""
    from test_images import _cfg, batch_hidden

    from finetune.data import batching, templates
    from finetune.model import builder, presets

    name = "tiny-gemma3n-audio"
    text = {"messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "words"}]}
    data = write_lines(tmp_path / "mixed.jsonl", [text, llama_factory(clip(tmp_path / "a.wav"), "tone")])
    records = formats.read(str(data))[0]
    lm, preprocessor = builder.build(presets.resolve(name), 64, "float32", images=True)
    made = prepare.pictured_examples(records, templates.get("gemma-chat"), preprocessor, _cfg(name), "x")
    arrays = batching.pad([example for _, example in made], 64)
    names = builder.input_names(lm)
    assert "audio_indices" not in names  # its causal LM declares them; its backbone never reads them

    both, heard = batch_hidden(lm, arrays, [0, 1]), batch_hidden(lm, arrays, [1])
    np.testing.assert_allclose(both[1], heard[0], atol=1e-5)
    np.testing.assert_allclose(both[0], batch_hidden(lm, arrays, [0])[0], atol=1e-5)


def test_gemma3n_s_clip_positions_past_its_end_take_the_padding_embedding():
    """keras-hub's Gemma 3n embedded the audio encoder's outputs past a clip's end (zeros: the encoder zeroes
    them) as they are; transformers' Gemma3nModel gives them the padding embedding, the one both pad a clip's soft
    tokens with. A short clip beside a longer one in a batch is padded to its frames, so its tail read the
    embedding of zeros there and the padding embedding alone (0.003-0.01 nats of loss apart). The audio
    embedder's soft path now gives a row of zeros the padding embedding, and every other row what it gave."""
    import keras

    from finetune.model import builder, presets

    lm, _ = builder.build(presets.resolve("tiny-gemma3n-audio"), 64, "float32", images=True)
    embedder = lm.backbone.embed_audio
    assert embedder.pads_clips  # builder.load_base: every Gemma 3n the runs, exports and evaluations build
    features = np.random.default_rng(0).normal(size=(2, 5, embedder.multimodal_hidden_size)).astype("float32")
    features[0, 3:] = 0.0  # past a clip's end, as the encoder leaves it
    last = embedder.vocab_offset + embedder.embedding.input_dim - 1
    padding = keras.ops.convert_to_numpy(embedder(np.array([[last]], "int32")))[0, 0]
    got = keras.ops.convert_to_numpy(embedder(features))
    np.testing.assert_allclose(got[0, 3:], np.broadcast_to(padding, got[0, 3:].shape), atol=1e-6)
    unpatched = type(embedder).call  # keras-hub's own, on the rows that hold a clip
    np.testing.assert_allclose(got[1], keras.ops.convert_to_numpy(unpatched(embedder, features))[1], atol=1e-6)
    assert np.abs(keras.ops.convert_to_numpy(unpatched(embedder, features))[0, 3] - padding).max() > 1e-2


@pytest.mark.one_backend
def test_a_conversational_prompt_completion_hears_its_audio_parts(tmp_path):
    """TRL's conversational prompt-completion with an audio content part in its prompt: the record's clip, and the
    placeholder where it goes (it was written as the text <audio> with no clip)."""
    name = clip(tmp_path / "a.wav")
    question = [{"type": "audio", "path": name}, {"type": "text", "text": "What is this?"}]
    row = {"prompt": [{"role": "user", "content": question}], "completion": [{"role": "assistant", "content": "tone"}]}
    (record,), found = formats.read(str(write_lines(tmp_path / "c.jsonl", [row])))
    assert found == "completion-chat" and record.audios == (str(tmp_path / name),)
    assert record.instruction.startswith(audio.PLACEHOLDER) and record.prompt_messages == 1
