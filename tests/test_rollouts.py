"""GRPO's rollouts: advantages as TRL's sum_then_normalize makes them, and the loss types' token weights."""

import numpy as np
import pytest

from finetune.methods import rewards, rollouts


@pytest.mark.one_backend
def test_advantages_are_normalised_within_each_group():
    table = np.array([[1.0], [0.0], [0.0], [0.0], [2.0], [2.0]])
    got, stats = rollouts.advantages(table, np.array([1.0]), 3, "group")
    first = np.array([1.0, 0.0, 0.0]) - 1 / 3
    np.testing.assert_allclose(got[:3], first / (np.std([1.0, 0, 0], ddof=1) + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(got[3:], [-4 / 3 / (np.std([0, 2, 2.0], ddof=1) + 1e-4)] + [2 / 3 / (np.std([0, 2, 2.0], ddof=1) + 1e-4)] * 2, rtol=1e-6)  # fmt: skip
    none, _ = rollouts.advantages(table, np.array([1.0]), 3, "none")
    np.testing.assert_allclose(none[:3], first)
    assert stats["reward"] == pytest.approx(5 / 6)


@pytest.mark.one_backend
def test_unscored_completions_have_no_advantage_and_weights_add():
    table = np.array([[np.nan, np.nan], [1.0, np.nan], [0.0, 1.0], [1.0, 1.0]])
    got, _ = rollouts.advantages(table, np.array([1.0, 0.5]), 4, "none")
    assert got[0] == 0.0
    np.testing.assert_allclose(got[1:], np.array([1.0, 0.5, 1.5]) - 1.0)


@pytest.mark.one_backend
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_token_weights_average_as_trl_does(loss_type):
    """Summed over the tokens and averaged over K micro-batches (Keras' accumulation), per-token losses weighted
    so give TRL's loss of the step (each micro-batch's loss / K, summed)."""
    rng = np.random.default_rng(0)
    counts, k, micro, longest = np.array([3, 1, 4, 2]), 2, 2, 5
    losses = [rng.normal(size=c) for c in counts]
    weights = rollouts.token_weights(loss_type, counts, np.ones(4, bool), micro, k, longest)
    ours = sum(w * x.sum() for w, x in zip(weights, losses)) / k
    trl = 0.0
    for m in range(k):
        part = losses[m * micro : (m + 1) * micro]
        if loss_type == "grpo":
            trl += np.mean([x.mean() for x in part]) / k
        elif loss_type == "bnpo":
            trl += sum(x.sum() for x in part) / sum(len(x) for x in part) / k
        elif loss_type == "dr_grpo":
            trl += sum(x.sum() for x in part) / (micro * longest) / k
        else:  # dapo: over the step's tokens
            trl += sum(x.sum() for x in part) / counts.sum()
    assert ours == pytest.approx(trl, rel=1e-6)


@pytest.mark.one_backend
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_an_epoch_s_short_last_step_weighs_as_a_step_of_its_real_rows(loss_type):
    """An epoch's last step with --grad-accum 2 whose second micro-batch is filler alone (Keras' mean counts it as
    0): the weighted sum is the loss of the step its real rows make alone, as TRL (which drops such a batch) would
    take them. bnpo's halved: its weights did not count the micro-batches of filler."""
    rng = np.random.default_rng(1)
    counts, real, longest = np.array([3, 1, 4, 2]), np.array([True, True, False, False]), 5
    losses = [rng.normal(size=c) for c in counts]
    short = rollouts.token_weights(loss_type, counts, real, 2, 2, longest)
    ours = sum(w * x.sum() for w, x in zip(short, losses)) / 2  # K = 2 micro-batches, the second filler
    alone = rollouts.token_weights(loss_type, counts[:2], np.ones(2, bool), 2, 1, longest)
    assert ours == pytest.approx(sum(w * x.sum() for w, x in zip(alone, losses)), rel=1e-6)
    assert not short[2:].any()


class Letters:
    """A tokenizer of one letter a token: 1 is a, 2 is b..."""

    def detokenize(self, ids):
        return "".join(chr(96 + i) for i in ids)

    def vocabulary_size(self):
        return 26


@pytest.mark.one_backend
def test_ids_past_the_tokenizer_s_pieces_have_no_text():
    """A model's embedding may have more rows than its tokenizer has pieces; a sampled id among them has no text
    (SentencePiece refused it, and stopped the run)."""
    assert rollouts.texts(Letters(), [[1, 2, 27, 3, 1], [300]], stop_ids=(1,)) == ["bc", ""]


@pytest.mark.one_backend
def test_conversational_prompts_reach_the_rewards_as_messages_with_their_columns():
    """TRL's conversational form: the prompt's messages, each completion one assistant message without its stop
    token, and each record's other columns, all repeated G times in the order of the completions."""
    seen = {}

    def judge(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [float(len(c[0]["content"])) for c in completions]

    sampling = rollouts.Sampling(2, 4, 1.0, 1.0, 0, (rewards.Reward("judge", judge),), (9,))
    messages = [[{"role": "user", "content": "Hi?"}], [{"role": "user", "content": "Bye?"}]]
    prompts = rollouts.Prompts(np.zeros((2, 3), np.int32), np.array([3, 3]), messages, {"answer": ["x", "y"]},
                               sampling, Letters(), conversational=True)  # fmt: skip
    table = rollouts.scored(prompts, np.array([1, 0]), [[1, 2], [3, 9], [4], [5, 6, 7]], step=0)
    assert seen["prompts"] == [messages[1], messages[1], messages[0], messages[0]]
    assert seen["completions"] == [[{"role": "assistant", "content": text}] for text in ("ab", "c", "d", "efg")]
    assert seen["answer"] == ["y", "y", "x", "x"] and seen["completion_ids"] == [[1, 2], [3, 9], [4], [5, 6, 7]]
    assert table[:, 0].tolist() == [2.0, 1.0, 1.0, 3.0]


def test_rollouts_sample_and_the_samples_stay_greedy_whichever_ran_last():
    """The rollouts' sampler and samples.md's greedy generations take turns on one model: each finds its own
    sampler compiled in. The samples of a GRPO run were drawn by the rollouts' sampler (at --temperature, from
    wherever its seed had got to), under samples.md's heading "Greedy decoding"."""
    from conftest import float32_policy

    from finetune.model import builder, presets
    from finetune.training import scoring

    with float32_policy():
        lm, preprocessor = builder.build(presets.Source("tiny", "tiny", "gemma"), seq_len=48)
        greedy = scoring.generate(lm, preprocessor, ["Write a story about a cat."], 6)
        sampler = rollouts.Sampler(lm, rollouts.Sampling(4, 6, 5.0, 1.0, 0, (), (1,)))
        ids, lengths = np.array([[2, 3110, 476, 3904, 1105, 476, 4401, 235265]] * 4, np.int32) % 700, np.full(4, 8)
        first, _ = sampler.complete(ids, lengths, seed=3)
        assert len({tuple(c) for c in first}) > 1  # at temperature 5, four draws of one prompt differ
        assert scoring.generate(lm, preprocessor, ["Write a story about a cat."], 6) == greedy
        again, _ = sampler.complete(ids, lengths, seed=3)
        assert again == first


@pytest.mark.one_backend  # the ids and the note: Python's
def test_prompts_cut_to_leave_the_completions_room_are_counted_by_split(capsys):
    """Each note says how many of which prompts were cut: the training prompts', then the held-out ones'."""
    from finetune.data import batching, formats, templates
    from finetune.model import builder, presets

    tokenizer = builder.load_tokenizer(presets.resolve("tiny"))
    pairs = [(formats.Record("word " * n, ""), None) for n in (40, 2, 60)]
    sampling = rollouts.Sampling(2, 8, 1.0, 1.0, 0, (), (1,))
    train = rollouts.prompts_of(pairs, templates.get("none"), tokenizer, sampling, 32)
    assert train.ids.shape == (3, 24) and train.lengths[0] == train.lengths[2] == 24 > train.lengths[1]
    whole = [2, *batching.leading_ids(tokenizer, ["word " * 60], 10**9)[0]]
    assert list(train.ids[2]) == [2, *whole[-23:]]  # cut from the left after its <bos>
    rollouts.prompts_of(pairs[:2], templates.get("none"), tokenizer, sampling, 32, rollouts.Layout(train.ids.shape[1]))
    said = capsys.readouterr().out
    assert "note: 2 of 3 prompts cut to 24 tokens from their left" in said
    assert "note: 1 of 2 held-out prompts cut to 24 tokens" in said
    exact = len(batching.leading_ids(tokenizer, ["word " * 5], 10**9)[0]) + 1  # with <bos>: the room, not cut
    rollouts.prompts_of(
        [(formats.Record("word " * 5, ""), None)], templates.get("none"), tokenizer, sampling, exact + 8
    )
    assert "cut" not in capsys.readouterr().out


def test_prompts_of_like_length_share_a_call_of_generate_and_far_ones_do_not():
    """keras-hub's loop runs from a call's shortest prompt to its longest, plus the completion budget: on PyTorch
    rows far apart in length are sampled in calls of their own; under XLA (a shape compiled per row count) one."""
    lengths = np.array([300, 12, 290, 10, 11])
    made = rollouts.calls(lengths, 16, "torch")
    assert sorted(int(r) for call in made for r in call) == list(range(5))  # each row once
    assert [sorted(int(r) for r in call) for call in made] == [[1, 3, 4], [0, 2]]
    assert [list(call) for call in rollouts.calls(lengths, 16, "jax")] == [list(range(5))]
    assert [list(call) for call in rollouts.calls(np.array([5, 40, 20]), 64, "torch")] == [[0, 2, 1]]  # close: one
    assert rollouts.prompt_width(np.array([17, 30]), 300, "torch") == 32
    assert rollouts.prompt_width(np.array([17, 30]), 300, "jax") == 75  # a quarter of the data's width
    assert rollouts.prompt_width(np.array([290]), 300, "jax") == 300


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3", "tiny-gemma4", "tiny-gemma3n"])
def test_left_padded_prompts_sample_what_each_prompt_alone_samples(preset):
    """Prompts of unlike lengths are laid out on the left of their rows (padding first) so that keras-hub's loop
    samples the budget alone; the key mask keeps every query off that padding, and the rotary embeddings see
    only i - j. Greedy (top-p of almost nothing), a batch of three samples what each prompt samples alone,
    right-padded as keras-hub lays a prompt out, on every family's decoder blocks."""
    from conftest import float32_policy

    from finetune.model import attention, builder, presets

    with float32_policy():
        lm, _ = builder.build(presets.resolve(preset), seq_len=48)
    attention.enable(lm.backbone)
    greedy = rollouts.Sampling(1, 6, 1.0, 1e-9, 0, (), (1,))
    rng = np.random.default_rng(0)
    lengths = np.array([5, 9, 14])
    ids = np.zeros((3, 14), np.int32)
    for row, length in enumerate(lengths):
        ids[row, :length] = [2, *rng.integers(10, 600, size=length - 1)]
    batch = rollouts.Sampler(lm, greedy)
    assert batch.left  # every block takes the key mask
    together, _ = batch.complete(ids, lengths, seed=1)
    alone = rollouts.Sampler(lm, greedy)
    alone.left = False
    for row, length in enumerate(lengths):
        (own,), _ = alone.complete(ids[row : row + 1, :length], lengths[row : row + 1], seed=1)
        assert together[row] == own, (row, together[row], own)
        assert len(own) >= 1


def _media_prompts(preset: str, path, seq_len: int):
    """(`preset`'s model in float32, its preprocessor, rollouts.Prompts) of the prompt file `path` with pictures or
    clips, for greedy sampling (top-p of almost nothing)."""
    from conftest import float32_policy

    from finetune.data import formats, templates
    from finetune.methods import prepare
    from finetune.model import builder, presets

    records, _ = formats.read(str(path))
    with float32_policy():
        lm, preprocessor = builder.build(presets.resolve(preset), seq_len=seq_len, images=True)
    greedy = rollouts.Sampling(1, 6, 1.0, 1e-9, 0, (), (1, 106))
    media = prepare.Media.of(records, preprocessor, preset, path.name)
    prompts = rollouts.prompts_of([(r, None) for r in records], templates.get("none"), preprocessor.tokenizer,
                                  greedy, seq_len, rollouts.Layout(media=media))  # fmt: skip
    return lm, preprocessor, prompts


def _sampled_together_as_alone(lm, prompts):
    """(the sampler, what it samples for `prompts` (_media_prompts) in one left-padded batch), having checked that
    each prompt samples the same alone with its media, laid out as keras-hub lays one out (right of its row)."""
    greedy = prompts.sampling
    rows = np.arange(len(prompts))
    batch = rollouts.Sampler(lm, greedy)
    assert batch.left
    together, _ = batch.complete(prompts.ids, prompts.lengths, 1, prompts.media_of(rows))
    alone = rollouts.Sampler(lm, greedy)
    alone.left = False
    for row, length in enumerate(prompts.lengths):
        own_rows = rows[row : row + 1]
        (own,), _ = alone.complete(prompts.ids[own_rows, :length], prompts.lengths[own_rows], 1,
                                   prompts.media_of(own_rows))  # fmt: skip
        assert together[row] == own, (row, together[row], own)
    return batch, together


@pytest.mark.parametrize(
    "preset",
    # CI time: Gemma 3's and 4's on every backend; Gemma 3n's batch order (numpy's) in the PyTorch suite
    [
        "tiny-gemma3-vision",
        "tiny-gemma4-vision",
        pytest.param("tiny-gemma3n-vision", marks=pytest.mark.backend_neutral),
    ],
)
def test_prompts_with_pictures_sample_what_each_prompt_alone_samples(preset, tmp_path):
    """GRPO's prompts with pictures: each prompt's soft tokens move with it to the right of its row, and a batch
    of prompts of unlike lengths samples (greedily) what each prompt samples alone with its pictures, laid out as
    keras-hub lays one out; a blank picture samples something else, so the pictures reach the decoder. The last
    prompt holds two pictures beside rows of one (Gemma 3n places the batch's pictures by their order)."""
    from test_images import square, write_lines

    texts = ["<image>What colour?", "Tell me, in a few words and with care, what colour <image> this is.",
             "Say it: <image> then <image>"]  # fmt: skip
    colours = ["red", "green", "blue"]
    lines = [{"prompt": text, "images": [square(tmp_path / f"{i}{n}.png", colours[(i + n) % 3])
                                         for n in range(text.count("<image>"))], "answer": colour}
             for i, (text, colour) in enumerate(zip(texts, colours))]  # fmt: skip
    lm, _, prompts = _media_prompts(preset, write_lines(tmp_path / "prompts.jsonl", lines), 256)
    assert len(set(prompts.lengths)) == 3 and set(prompts.media) >= {"vision_indices"}
    batch, together = _sampled_together_as_alone(lm, prompts)
    rows = np.arange(3)
    pixels = "images" if "images" in prompts.media else "pixel_values"
    blank = {**prompts.media_of(rows), pixels: np.zeros_like(prompts.media[pixels])}
    unseen, _ = batch.complete(prompts.ids, prompts.lengths, 1, blank)
    assert unseen != together


@pytest.mark.parametrize(
    "preset",
    # CI time: Gemma 4's clips on every backend; Gemma 3n's batch order (numpy's) in the PyTorch suite
    ["tiny-gemma4-audio", pytest.param("tiny-gemma3n-audio", marks=pytest.mark.backend_neutral)],
)
def test_prompts_with_clips_sample_what_each_prompt_alone_samples(preset, tmp_path):
    """GRPO's prompts with audio clips, as its pictures (above): each prompt's soft tokens move with it to the
    right of its row, a batch of prompts of unlike lengths samples (greedily) what each prompt samples alone with
    its clip, and silence samples something else, so the clips reach the decoder. A text prompt sits beside them
    (Gemma 3n places the batch's clips by their order)."""
    from test_audio import clip
    from test_images import write_lines

    from finetune.data import audio

    texts = ["<audio>What is this?", "Say what it is, in a few words: a tone or a noise?",
             "Listen with care to this and say, in a few words and with care, what it is: <audio>"]  # fmt: skip
    lines = [{"prompt": text, **({"audios": [clip(tmp_path / f"{i}.wav", kind)]} if "<audio>" in text else {})}
             for i, (text, kind) in enumerate(zip(texts, ["tone", "tone", "noise"]))]  # fmt: skip
    lm, preprocessor, prompts = _media_prompts(preset, write_lines(tmp_path / "prompts.jsonl", lines), 128)
    assert len(set(prompts.lengths)) == 3 and "audio_indices" in prompts.media
    batch, together = _sampled_together_as_alone(lm, prompts)
    rows = np.arange(3)
    features = audio.hearing_of(preprocessor).names[0]
    silent = {**prompts.media_of(rows), features: np.zeros_like(prompts.media[features])}
    unheard, _ = batch.complete(prompts.ids, prompts.lengths, 1, silent)
    assert unheard != together
