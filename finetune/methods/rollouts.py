"""GRPO's and RLOO's rows: the model's own completions of the prompts, scored by the rewards, for the loop.

The order (RolloutOrder) gives the loop what every order gives it: the micro-batches of each optimizer step.
At the first step of each batch of prompts it samples --num-generations completions of each with the model as
it stands (keras-hub's generate, on ids, with the sampler compiled in once), scores them with the reward
functions (rewards.py), turns the rewards into advantages normalised within each prompt's group (TRL's
`sum_then_normalize`), and lays out the rows: prompt + completion, weighted on the completion's tokens, with
each slot's advantage, and where asked its log-probability when sampled and under the base. --num-iterations
steps train on one batch of rollouts.

Each rollout's sampler is seeded from (--seed, the batch's index), so a run samples the same completions
wherever it is resumed, where the backend's sampling is deterministic; a checkpoint part way through a batch's
--num-iterations steps keeps the batch (kept, checkpoint.ORDER), which the resumed run trains on as it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from finetune.data import batching, templates
from finetune.methods import rewards as rewards_module
from finetune.platform.errors import UserError

EVAL_SEED = 7919  # added to --seed for the held-out rewards: the same draw before and after training


@dataclass(frozen=True)
class Sampling:
    """How rollouts are sampled and scored (the method's constants, decided).

    generations: int. Completions per prompt (G).
    max_completion_length: int. The most tokens sampled.
    temperature, top_p: float. keras-hub's TopPSampler's.
    seed: int. --seed.
    rewards: tuple of rewards.Reward.
    stop_ids: tuple of int. The template's stop tokens' ids.
    prompts_at_once: int. The prompts of one optimizer step (--batch-size x --grad-accum), whose completions are
        sampled in one call, as TRL's generation batch: a step's rollouts do not depend on how it is split into
        micro-batches. The held-out prompts are sampled as many at a time, in the shape compiled already.
    """

    generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    seed: int
    rewards: tuple
    stop_ids: tuple
    prompts_at_once: int = 1


@dataclass
class Prompts:
    """Prompt records as ids, for rollouts: one row each, right-padded to the longest.

    ids: (N, P) int32, <bos> and the prompt in the run's template; lengths: (N,) int.
    prompts: what the reward functions get as `prompts` (text, or the messages of a conversational prompt).
    columns: the records' other keys, each a list of N.
    """

    ids: np.ndarray
    lengths: np.ndarray
    prompts: list
    columns: dict
    sampling: Sampling
    tokenizer: object
    conversational: bool = False
    media: dict = field(default_factory=dict)
    """Prompts with pictures or clips: each row's inputs for them (images.model_inputs, audio.model_inputs: their
    arrays and `vision_indices`, `audio_indices`, the soft tokens' positions in the prompt), one array of N rows
    each; empty for text."""

    def __len__(self) -> int:
        return len(self.ids)

    def media_of(self, rows: np.ndarray) -> dict:
        """The picture and clip inputs of `rows`."""
        return {name: value[rows] for name, value in self.media.items()}


def prompt_room(seq_len: int, max_completion_length: int) -> int:
    """The positions a prompt has beside its completion; a UserError where fewer than 8 (registry.check and the
    rollouts both ask)."""
    room = seq_len - max_completion_length
    if room < 8:
        raise UserError(f"--seq-len {seq_len} leaves {room} tokens for the prompt beside --max-completion-length "
                        f"{max_completion_length}; raise --seq-len or lower --max-completion-length")  # fmt: skip
    return room


@dataclass(frozen=True)
class Layout:
    """How prompts_of lays the prompts out.

    width: the prompt width (P) to pad to; the longest prompt's when None (the held-out prompts take the
        training prompts', so that both share the rollouts' compiled shape).
    media: prepare.Media of prompts with pictures or clips: each `<image>` (`<audio>`) written as the family's
        tokens, and each row's inputs for them kept (Prompts.media); such a prompt is never cut, but refused where
        long.
    """

    width: int | None = None
    media: object = None


def prompts_of(pairs: list, template, tokenizer, sampling: Sampling, seq_len: int, layout: Layout = Layout()):
    """Prompts of (record, _) pairs: each prompt cut from its left to leave --max-completion-length in seq_len,
    laid out as `layout` says."""
    width, media = layout.width, layout.media
    room = prompt_room(seq_len, sampling.max_completion_length)
    records = [record for record, _ in pairs]
    turned = templates.read_as_text(template.name, records)
    if turned is not None:
        raise UserError(f"{turned.where or 'a prompt'}: a prompt given as messages needs a chat template "
                        f"({', '.join(templates.CHAT)}), and the run's is {template.name}, chosen for text prompts; "
                        "give the training and held-out prompts in one form")  # fmt: skip
    for reward in sampling.rewards:
        reward.check_prompts(records)
    texts = [template.apply(record)[0] for record in records]
    if media is not None:
        texts = [media.expanded(text, record) for text, record in zip(texts, records)]
    ids = [[batching.BOS, *row] for row in batching.leading_ids(tokenizer, texts, 10**9)] if texts else []
    for record, row in zip(records, ids):
        if len(row) > room and (record.images or record.audios):
            raise UserError(f"{record.where or 'a prompt'}: with its {'pictures' if record.images else 'clips'}, the prompt takes {len(row)} tokens, "
                            f"more than the {room} that --seq-len {seq_len} leaves beside --max-completion-length "
                            f"{sampling.max_completion_length}, and cutting it could cut their soft tokens; raise "
                            "--seq-len or shorten the prompt")  # fmt: skip
    cut = sum(len(row) > room for row in ids)
    ids = [row if len(row) <= room else [batching.BOS, *row[len(row) - room + 1 :]] for row in ids]  # <bos> kept
    if cut:  # the held-out prompts take the training prompts' width: given, they are the held-out ones
        which = "held-out " if width is not None else ""
        print(f"note: {cut} of {len(ids)} {which}prompts cut to {room} tokens from their left (--seq-len less "
              "--max-completion-length)")  # fmt: skip
    longest = max((len(row) for row in ids), default=1)
    width = max(width or 0, longest)
    padded = np.zeros((len(ids), width), np.int32)
    for row, prompt in enumerate(ids):
        padded[row, : len(prompt)] = prompt
    keys = sorted({key for record in records for key in record.columns})
    columns = {key: [record.columns.get(key) for record in records] for key in keys}
    conversational = bool(records) and bool(records[0].turns)
    shown = [messages_of(r) if conversational else r.instruction for r in records]
    lengths = np.array([len(row) for row in ids], np.int64)
    pictured = {}
    if media is not None and records:
        # Each prompt's picture and clip inputs, as a training row's (soft tokens' positions counted from <bos>).
        attached = [media.attached(batching.Example([*row, 0], [0.0] * (len(row) + 1)), record).inputs
                    for row, record in zip(ids, records)]  # fmt: skip
        pictured = {name: np.stack([inputs[name] for inputs in attached]) for name in attached[0]}
    return Prompts(padded, lengths, shown, columns, sampling, tokenizer, conversational, pictured)


def messages_of(record) -> list:
    """A conversational prompt record's messages as the reward functions get them: as the data gives them (TRL's
    prompt column), a system message apart, not folded into the first user turn as Gemma 1-3's template folds it."""
    if record.messages:
        return [dict(message) for message in record.messages]
    return [{"role": role, "content": text} for role, text in record.turns]


# === Sampling ===


class Sampler:
    """Completions of prompt ids from `lm` as it stands, by keras-hub's TopPSampler compiled into `lm`.

    keras-hub takes a sampler through compile(), which resets its generate function (JAX then traces it again).
    The samples of samples.md compile the greedy one in between (scoring.generate), so each call makes sure its
    own is in; the held-out rewards and the rollouts share one, so they take turns without a compile.
    """

    def __init__(self, lm, sampling: Sampling):
        import keras_hub

        from finetune.model import attention, builder

        self.lm, self.sampling = lm, sampling
        self.names = builder.input_names(lm)  # the model's inputs: a picture model's among them
        # Prompts laid out on the left of their rows where every decoder block takes the key mask (attention.py):
        # the loop then samples --max-completion-length steps whatever the prompts' lengths.
        self.left = attention.packs_exactly(lm.backbone)
        if not getattr(lm, "left_padded", False):
            attention.left_padded_generate_step(lm)
            lm.left_padded = True
        own = getattr(lm, "sampler", None)
        same = isinstance(own, keras_hub.samplers.TopPSampler) and (own.p, own.temperature) == (sampling.top_p,
                                                                                              sampling.temperature)  # fmt: skip
        self.top_p = own if same else keras_hub.samplers.TopPSampler(p=sampling.top_p, temperature=sampling.temperature,
                                                                     seed=sampling.seed)  # fmt: skip

    def complete(self, ids: np.ndarray, lengths: np.ndarray, seed: int, media: dict | None = None):
        """(each row's completion ids, whether each was cut at --max-completion-length), from prompt rows `ids`
        (right-padded, `lengths` long), sampled with the sampler's state set to `seed` (and on for each further
        call of generate, calls()); `media`: the rows' picture and clip inputs (Prompts.media_of)."""
        import keras

        media = media or {}
        completions, cut = [None] * len(ids), np.zeros(len(ids), bool)
        together = [np.arange(len(ids))] if self.left else None  # left-padded: one call samples the budget alone
        for index, rows in enumerate(together or calls(lengths, self.sampling.max_completion_length,
                                                       keras.config.backend())):  # fmt: skip
            pictured = {name: value[rows] for name, value in media.items()}
            made, stopped = self._call(ids[rows], lengths[rows], seed + index, pictured)
            for row, completion, done in zip(rows, made, stopped):
                completions[row], cut[row] = completion, done
        return completions, cut

    def _call(self, ids: np.ndarray, lengths: np.ndarray, seed: int, media: dict) -> tuple[list, np.ndarray]:
        import keras

        if self.lm.sampler is not self.top_p:
            self.lm.compile(sampler=self.top_p)
        state = self.top_p.seed_generator.state
        state.assign(np.array([seed % 2**31, 0], dtype=keras.backend.standardize_dtype(state.dtype)))
        limit = self.sampling.max_completion_length
        rows, width = len(ids), prompt_width(lengths, ids.shape[1], keras.config.backend())
        token_ids = np.zeros((rows, width + limit), np.int32)
        positions = np.arange(width + limit)[None, :]
        if self.left:  # each prompt ends at `width`, where the sampler starts every row
            for row, length in enumerate(lengths):
                token_ids[row, width - length : width] = ids[row, :length]
            inputs = {"token_ids": token_ids, "padding_mask": np.broadcast_to(positions < width, token_ids.shape),
                      "key_mask": positions >= (width - lengths)[:, None]}  # fmt: skip
            starts = np.full(rows, width)
        else:
            token_ids[:, :width] = ids[:, :width]
            inputs = {"token_ids": token_ids, "padding_mask": positions < lengths[:, None]}
            starts = lengths
        if media:  # each prompt's soft tokens moved with it where it sits at the right of its row
            inputs.update(generation_media(media, starts - lengths, width + limit, self.names))
        out = self.lm.generate(inputs, stop_token_ids=self.sampling.stop_ids)
        made, kept = (np.asarray(keras.ops.convert_to_numpy(out[k])) for k in ("token_ids", "padding_mask"))
        completions, cut = [], np.zeros(rows, bool)
        for row, start in enumerate(starts):
            span = made[row, start : start + limit][kept[row, start : start + limit]]
            completions.append([int(t) for t in span])
            cut[row] = not any(t in self.sampling.stop_ids for t in completions[-1])
        return completions, cut


def generation_media(media: dict, offsets: np.ndarray, length: int, names) -> dict:
    """The picture and clip inputs of generate's rows: each row's soft tokens `offsets` positions on from where
    its prompt's inputs counted them (its left padding), and their masks over the `length` positions, as
    batching.inputs feeds a training row's (batching.media_inputs: Gemma 3n's in the batch's order)."""
    from finetune.data import images

    x = dict(media)
    for indices, mask in (("vision_indices", "vision_mask"), ("audio_indices", "audio_mask")):
        if indices in x:
            moved = np.where(x[indices] > 0, x[indices] + offsets[:, None], 0).astype(x[indices].dtype)
            x[indices], x[mask] = moved, images.vision_mask(moved, length)
    return batching.media_inputs(x, names)


def prompt_width(lengths: np.ndarray, width: int, backend: str) -> int:
    """The prompt positions a call of generate is given: the call's longest prompt, rounded up to 16 positions, or
    where each width compiles a program (JAX and TensorFlow trace generate per shape) to a quarter of the data's.

    keras-hub's loop runs from the shortest prompt's end to the last position given, so prompts padded to the
    longest of the data would sample (and throw away) that many tokens more than --max-completion-length."""
    step = 16 if backend == "torch" else max(16, -(-width // 4))
    return min(width, -(-int(np.max(lengths)) // step) * step)


def calls(lengths: np.ndarray, limit: int, backend: str) -> list[np.ndarray]:
    """The rows of each call of generate: all in one, or on PyTorch (which compiles no shape) rows of like prompt
    lengths together.

    One call's loop takes (its longest prompt, rounded) - (its shortest) + limit steps, each about as costly for
    a few rows as for one, so a step whose prompts run from 40 to 300 tokens would sample 260 steps more than
    --max-completion-length asks. On PyTorch the rows, shortest prompt first, are cut where a call of their own
    takes fewer steps than joining the call before them; under XLA each call's row count is a compiled shape, so
    there they stay one call."""
    if backend != "torch" or len(lengths) < 2:
        return [np.arange(len(lengths))]
    rounded = -(-np.asarray(lengths) // 16) * 16
    out, current = [], []
    for row in np.argsort(lengths, kind="stable"):
        if current:
            joined = rounded[row] - lengths[current[0]] + limit
            apart = (rounded[current[-1]] - lengths[current[0]] + limit) + (rounded[row] - lengths[row] + limit)
            if joined > apart:
                out.append(np.array(current))
                current = []
        current.append(row)
    out.append(np.array(current))
    return out


def texts(tokenizer, completions: list, stop_ids: tuple) -> list[str]:
    """Each completion's text, without its stop token, and without ids past the tokenizer's vocabulary (a model's
    embedding may have rows no piece names: they have no text)."""
    size = tokenizer.vocabulary_size()
    kept = [[t for t in ids if t not in stop_ids and t < size] for ids in completions]
    return [str(np.asarray(keras_string(tokenizer.detokenize(ids)))) if ids else "" for ids in kept]


def keras_string(value):
    """A detokenized string as Python text (TensorFlow gives bytes in a tensor)."""
    value = value.numpy() if hasattr(value, "numpy") else value
    return value.decode("utf-8") if isinstance(value, bytes) else value


def scored(prompts: Prompts, indices: np.ndarray, completions: list, step: int, logged: dict | None = None):
    """(completions, functions): the rewards of `completions`, G to a prompt of `indices`, in order; `logged`
    gathers what the functions gave TRL's `log_metric` (rewards.score)."""
    g = len(completions) // len(indices)
    repeat = np.repeat(indices, g)
    shown = [prompts.prompts[i] for i in repeat]
    stop = prompts.sampling.stop_ids
    made = texts(prompts.tokenizer, completions, stop)
    if prompts.conversational:
        made = [[{"role": "assistant", "content": text}] for text in made]
    columns = {key: [values[i] for i in repeat] for key, values in prompts.columns.items()}
    columns["completion_ids"] = completions
    return rewards_module.score(list(prompts.sampling.rewards), shown, made, columns, step, logged)


def advantages(table: np.ndarray, weights: np.ndarray, generations: int, scale: str) -> tuple[np.ndarray, dict]:
    """(each completion's advantage, the rewards' statistics): TRL's sum_then_normalize.

    table: (completions, functions), NaN where a function gave None; rows are G to a prompt, in order.
    The total reward is the weighted sum of those given; a completion no function scored is NaN, left out of
    its group's mean and std, and its advantage is 0. scale: group, batch or none (--scale-rewards).
    """
    unscorable = np.isnan(table).all(axis=1)
    total = np.nansum(table * weights[None, :], axis=1)
    total[unscorable] = np.nan
    grouped = total.reshape(-1, generations)
    with np.errstate(invalid="ignore", divide="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.repeat(np.nanmean(grouped, axis=1), generations)
            if scale == "batch":
                std = np.full_like(total, nanstd(total))
            else:
                std = np.repeat(nanstd(grouped, axis=1), generations)
            out = total - mean
            if scale != "none":
                out = out / (std + 1e-4)
    stats = {"reward": _nanmean(total), "reward_std": float(nanstd(total)),
             "frac_reward_zero_std": float(np.mean(np.isclose(np.nan_to_num(std, nan=1.0), 0.0)))}  # fmt: skip
    return np.nan_to_num(out, nan=0.0), stats


def nanstd(values: np.ndarray, axis=None):
    """The std of the values that are not NaN, Bessel-corrected (TRL's nanstd); NaN with fewer than two."""
    count = np.sum(~np.isnan(values), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(values, axis=axis, keepdims=True)
            variance = np.nanmean((values - mean) ** 2, axis=axis) * count / (count - 1)
    return np.where(count > 1, np.sqrt(variance), np.nan)


def _nanmean(values) -> float:
    values = np.asarray(values, np.float64)
    return float(np.nanmean(values)) if np.any(~np.isnan(values)) else float("nan")


# === The loss's weights ===


def token_weights(loss_type: str, counts: np.ndarray, real: np.ndarray, micro_rows: int, grad_accum: int,
                  max_completion_length: int) -> np.ndarray:  # fmt: skip
    """Each row's weight per completion token, so that objective.TokenShare's sum, averaged over the micro-batches
    (Keras' accumulation), is TRL's loss of the step for `loss_type`.

    counts: (rows,) the completion tokens of each of the step's rows, micro-batch after micro-batch; real: (rows,)
    False for the rows that only fill the last batch of an epoch, which weigh 0.
    """
    counts = np.where(real, counts, 0).astype(np.float64)
    rows = max(int(real.sum()), 1)
    if loss_type == "grpo":  # each sequence's token mean, averaged over the sequences
        weight = grad_accum / (rows * np.maximum(counts, 1.0))
    elif loss_type == "dapo":  # every completion token of the step alike
        weight = np.full_like(counts, grad_accum / max(counts.sum(), 1.0))
    elif loss_type == "bnpo":  # every completion token of the micro-batch alike, averaged over the micro-batches
        per_micro = counts.reshape(-1, micro_rows).sum(axis=1)
        # of real rows: an epoch's last step may hold micro-batches of filler alone, which Keras' mean counts as 0
        held = max(int(real.reshape(-1, micro_rows).any(axis=1).sum()), 1)
        weight = np.repeat(grad_accum / (held * np.maximum(per_micro, 1.0)), micro_rows)
    else:  # dr_grpo: over rows x the longest completion, a constant
        weight = np.full_like(counts, grad_accum / (rows * max_completion_length))
    return np.where(real, weight, 0.0).astype(np.float32)


# === The order ===


@dataclass
class Rollout:
    """One batch of rollouts: every micro-batch of the steps that train on it."""

    group: int
    batches: list
    tokens: tuple
    metrics: dict
    weights: list = field(default_factory=list)


class SlotSums:
    """Per-slot inputs of a step's micro-batches (loss_old, loss_reference: each slot's log-probability) summed by
    completion: `sums(name)` is (rows,), each row's sum over its completion tokens."""

    def __init__(self, xs: list, slot_rows: list, rows: int):
        self.xs, self.slot_rows, self.rows = xs, slot_rows, rows

    def __call__(self, name: str) -> np.ndarray:
        out = np.zeros(self.rows, np.float64)
        for x, where in zip(self.xs, self.slot_rows):
            np.add.at(out, where[where >= 0], np.asarray(x[name], np.float64)[where >= 0])
        return out


class RolloutOrder(batching.Order):
    """The micro-batches of every optimizer step: --batch-size prompts a micro-batch, --num-generations rows
    each; a fresh batch of rollouts every --num-iterations steps (methods/grpo.py)."""

    def __init__(self, prompts: Prompts, batch_size: int, cfg, feed: batching.Feed, model, constants: dict):
        self.prompts, self.batch_size, self.feed, self.model = prompts, batch_size, feed, model
        self.objective, self.constants = model.trainer.objective, constants  # the GRPOView's
        self.grad_accum, self.seed = cfg.train.grad_accum, cfg.train.seed
        self.iterations = constants["num_iterations"]
        self._rows = batching.EpochRows(len(prompts), batch_size * self.grad_accum, self.seed)
        self.steps_per_epoch = self._rows.steps_per_epoch * self.iterations
        self.sampler = Sampler(model.lm, prompts.sampling)
        self._rollout = None
        self._views = {}
        self._first = True

    def micro_batches(self, step: int) -> list:
        return [batch for batch, _ in self._made(step).batches]

    def metric_weights(self, step: int) -> list:
        """Each micro-batch's completion tokens: the view's metrics are token means, as TRL's."""
        return self._made(step).weights

    def tokens(self, step: int) -> tuple[int, int]:
        return self._made(step).tokens

    def step_metrics(self, step: int) -> dict:
        """The rollouts' rewards and completion lengths, for history.csv."""
        return self._made(step).metrics

    def kept(self, steps: int) -> dict | None:
        """What a checkpoint after `steps` steps keeps to go on exactly: the batch of rollouts the next step trains
        on where it was sampled already (part way through its --num-iterations steps), by name; None otherwise."""
        made = self._rollout
        if made is None or steps % self.iterations == 0 or made.group != steps // self.iterations:
            return None
        arrays = {"group": np.array(made.group), "tokens": np.array(made.tokens), "weights": np.array(made.weights),
                  "metrics": np.array(json.dumps(made.metrics))}  # fmt: skip
        for index, ((x, y, w), _) in enumerate(made.batches):
            arrays.update({f"batch{index}.x.{name}": np.asarray(value) for name, value in x.items()})
            arrays[f"batch{index}.y"], arrays[f"batch{index}.w"] = np.asarray(y), np.asarray(w)
        return arrays

    def take_up(self, steps: int, arrays: dict) -> None:
        """Go on from a checkpoint after `steps` steps with the batch of rollouts it kept (kept)."""
        group = int(arrays["group"])
        if group != steps // self.iterations:
            return
        batches = []
        while f"batch{len(batches)}.y" in arrays:
            index, prefix = len(batches), f"batch{len(batches)}.x."
            x = {name[len(prefix) :]: value for name, value in arrays.items() if name.startswith(prefix)}
            batches.append(((x, arrays[f"batch{index}.y"], arrays[f"batch{index}.w"]), None))
        self._rollout = Rollout(group, batches, tuple(int(t) for t in arrays["tokens"]),
                                json.loads(str(arrays["metrics"])), [float(w) for w in arrays["weights"]])  # fmt: skip
        self._first = False

    def _made(self, step: int) -> Rollout:
        group = step // self.iterations
        if self._rollout is None and step % self.iterations:
            print(f"note: resumed at step {step + 1}, within a batch of rollouts that --num-iterations "
                  f"{self.iterations} trains on, which the checkpoint did not keep (an older finetune wrote it): it "
                  "is sampled again from the adapter as it stands, so the run goes on from here as an uninterrupted "
                  "one would not", flush=True)  # fmt: skip
        if self._rollout is None or self._rollout.group != group:
            self._rollout = self._roll(group, step)
        return self._rollout

    def _roll(self, group: int, step: int) -> Rollout:
        sampling, g = self.prompts.sampling, self.prompts.sampling.generations
        chosen = self._rows(group)
        size = self.batch_size * self.grad_accum
        filled = np.concatenate([chosen, chosen[np.arange(size - len(chosen)) % len(chosen)]])
        real = np.repeat(np.arange(size) < len(chosen), g)
        rows = np.repeat(filled, g)
        micro_rows = self.batch_size * g
        completions, cut = self.sampler.complete(self.prompts.ids[rows], self.prompts.lengths[rows],
                                                 self.seed * 1_000_003 + group, self.prompts.media_of(rows))  # fmt: skip
        count = len(chosen) * g
        logged = {}
        table = scored(self.prompts, chosen, completions[:count], step, logged)
        counts = np.array([len(c) for c in completions])
        loss_weights = self.loss_weights(counts, real, micro_rows)
        made = [self._batch(rows[s : s + micro_rows], completions[s : s + micro_rows], loss_weights[s : s + micro_rows])
                for s in range(0, len(rows), micro_rows)]  # fmt: skip
        # Each slot's row in the step (-1: a slot of no completion token), for the advantages and the sums by row.
        slot_rows = [np.where(real_slot, s + row_of_slot, -1) for s, (_, row_of_slot, real_slot)
                     in zip(range(0, len(rows), micro_rows), made)]  # fmt: skip
        advantage, stats = self.advantages(
            table, SlotSums([batch[0] for batch, _, _ in made], slot_rows, len(rows)), counts
        )
        advantage = np.concatenate([advantage, np.zeros(len(rows) - count)])
        batches = []
        for (x, y, w), where in zip((batch for batch, _, _ in made), slot_rows):
            x["loss_advantages"] = np.where(where >= 0, advantage[np.maximum(where, 0)], 0.0).astype(np.float32)
            batches.append(((x, y, w), None))
        real_counts = counts[:count]
        metrics = {**stats, **_per_function(table, sampling.rewards),
                   "completion_length": float(real_counts.mean()), "completion_length_min": int(real_counts.min()),
                   "completion_length_max": int(real_counts.max()),
                   "completion_clipped": float(cut[:count].mean())}  # fmt: skip
        metrics.update(rewards_module.logged_metrics(logged, metrics))
        alike = float(np.all(np.abs(advantage[:count].reshape(-1, g)) < 1e-6, axis=1).mean())
        self._report(group, metrics, alike)
        tokens = (int(sum(self.prompts.lengths[rows][real]) + counts[real].sum()), int(counts[real].sum()))
        return Rollout(group, batches, tokens, metrics, self.micro_weights(counts, real, micro_rows))

    # The method's parts of a batch of rollouts: GRPO's here, RLOO's in methods/rloo.py.

    def advantages(self, table: np.ndarray, sums: SlotSums, counts: np.ndarray) -> tuple[np.ndarray, dict]:
        """(each real completion's advantage, the rewards' statistics for history.csv), from the rewards `table`
        (completions, functions); `sums` sums the micro-batches' per-slot inputs by completion; `counts`: each
        row's completion tokens. GRPO's: TRL's sum_then_normalize."""
        weights = np.array([r.weight for r in self.prompts.sampling.rewards])
        return advantages(table, weights, self.prompts.sampling.generations, self.constants["scale_rewards"])

    def loss_weights(self, counts: np.ndarray, real: np.ndarray, micro_rows: int) -> np.ndarray:
        """Each row's weight per completion token (token_weights): --loss-type's average."""
        return token_weights(self.constants["loss_type"], counts, real, micro_rows, self.grad_accum,
                             self.prompts.sampling.max_completion_length)  # fmt: skip

    def micro_weights(self, counts: np.ndarray, real: np.ndarray, micro_rows: int) -> list:
        """Each micro-batch's weight in the step's metrics (metric_weights): its completion tokens, as the view's
        metrics are token means."""
        return [float(np.where(real, counts, 0)[s : s + micro_rows].sum()) for s in range(0, len(real), micro_rows)]

    def _report(self, group: int, metrics: dict, alike: float) -> None:
        """The rollout's line; a note where the first rollout of the session has no advantage anywhere (later, every
        completion scoring alike is what a learned reward looks like)."""
        shown = ", ".join(f"{r.name} {metrics['reward_' + r.name]:.3f}" for r in self.prompts.sampling.rewards)
        print(f"rollout {group + 1}: reward {metrics['reward']:.3f} (std {metrics['reward_std']:.3f}; {shown}), "
              f"completion length {metrics['completion_length']:.1f} [{metrics['completion_length_min']}, "
              f"{metrics['completion_length_max']}], {metrics['completion_clipped']:.0%} clipped, "
              f"{alike:.0%} of prompts without advantage", flush=True)  # fmt: skip
        first, self._first = self._first, False
        if alike == 1.0 and first:
            g = self.prompts.sampling.generations
            print(f"note: each prompt's {g} completions scored alike, so every advantage is 0 and this step "
                  "learns nothing: the rollouts teach by the differences within a prompt's group. Raise --temperature "
                  "or --num-generations, or give prompts the model does not answer by rote, and a reward that "
                  "varies among their completions", flush=True)  # fmt: skip

    def _batch(self, rows, completions, weights):
        """((x, y, sample weights), each slot's row in the micro-batch, whether each slot is a completion token) of
        one micro-batch of rollout rows; its advantages are set once the step's are known (_roll)."""
        examples = []
        for row, completion in zip(rows, completions):
            prompt = [int(t) for t in self.prompts.ids[row, : self.prompts.lengths[row]]]
            media = {name: value[row] for name, value in self.prompts.media.items()}  # the prompt's, from its <bos>
            examples.append(batching.Example(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion),
                                             media))  # fmt: skip
        width = self.prompts.ids.shape[1] + self.prompts.sampling.max_completion_length
        arrays = batching.pad(examples, width - 1)
        # Cut to the micro-batch's longest row, rounded to the feed's step (a compiled shape each on XLA): the
        # prompts are padded to the longest of the data, and most completions stop before the budget.
        length = None
        if self.feed.length_step:
            length = batching.batch_length(np.array([len(e.token_ids) - 1 for e in examples]), self.feed.length_step,
                                           width - 1)  # fmt: skip
        slots = -(-self.prompts.sampling.max_completion_length // 8) * 8
        first, end, shards = self.feed.part
        local = batching.local(np.arange(len(rows)), self.feed.part)
        x, _, slot_weights = batching.inputs(arrays, local, end - first, slots, length, self.feed.inputs)
        per_shard = len(rows) // shards
        first_row = (first + np.arange(len(local)) // per_shard) * per_shard
        row_of_slot = first_row[:, None] + x["loss_positions"] // x["token_ids"].shape[1]
        real_slot = slot_weights > 0
        x["loss_advantages"] = np.zeros(slot_weights.shape, np.float32)
        x["loss_old"] = np.zeros_like(x["loss_advantages"])
        x["loss_reference"] = np.zeros_like(x["loss_advantages"])
        if self.objective.scores_old:
            x["loss_old"] = self._logps(x, "policy")
        if self.objective.beta != 0.0:
            x["loss_reference"] = self._logps(x, "reference")
        weight = np.zeros((*slot_weights.shape, len(self.objective.columns)), np.float32)
        weight[..., 0] = np.where(real_slot, weights[row_of_slot], 0.0)
        return (x, np.zeros_like(weight), weight), row_of_slot, real_slot

    def _logps(self, x, which: str) -> np.ndarray:
        """Each slot's log-probability under the model as it stands, or under its base (LoRA off)."""
        from finetune.model import builder

        lm = self.model.lm
        if which == "policy":
            return score_logps(self.model.trainer, x)
        with builder.lora_off(lm):  # a view of its own, traced with LoRA off (a traced call keeps what it traced)
            if "reference" not in self._views:  # the trainer's data shards: the slots are laid out per shard
                self._views["reference"] = builder.objective_view(lm, self.objective, self.model.trainer.shards)
            return score_logps(self._views["reference"], x)


def score_logps(view, x) -> np.ndarray:
    """Each slot's log-probability by a GRPOView in inference mode (grpo_view.COLUMNS' last)."""
    import keras

    eager = keras.config.backend() != "jax"  # as preference.pair_outputs: TensorFlow's predict relaxes shapes
    values = view(x, training=False) if eager else view.predict_on_batch(x)
    return np.asarray(keras.ops.convert_to_numpy(values), np.float32)[..., -1]


def _per_function(table: np.ndarray, rewards) -> dict:
    out = {}
    for index, reward in enumerate(rewards):
        out[f"reward_{reward.name}"] = _nanmean(table[:, index])
        out[f"reward_{reward.name}_std"] = float(nanstd(table[:, index]))
    return out


# === Held-out rewards ===


def held_out_reward(sampler: Sampler, prompts: Prompts, after_batch=None) -> dict:
    """The mean total reward of one completion of each held-out prompt, sampled with a fixed seed (--seed + 7919)
    so that the scores before and after training are drawn alike, as many at a time as a step's rollouts (their
    shape is compiled already); after_batch() after each call (a run's stop check).

    loss: the negated mean reward, so that lower is better as for every method (--keep-best, --early-stop);
    accuracy: the share of prompts whose completion scored above 0."""
    count, rows = len(prompts), prompts.sampling.prompts_at_once * prompts.sampling.generations
    totals, weights = [], np.array([r.weight for r in prompts.sampling.rewards])
    for start in range(0, count, rows):
        part = np.arange(start, min(start + rows, count))
        filled = np.concatenate([part, part[np.arange(rows - len(part)) % len(part)]])
        made, _ = sampler.complete(prompts.ids[filled], prompts.lengths[filled],
                                   prompts.sampling.seed + EVAL_SEED + start, prompts.media_of(filled))  # fmt: skip
        table = scored(prompts, part, made[: len(part)], None)
        total = np.nansum(table * weights[None, :], axis=1)
        totals.append(total)
        if after_batch is not None:
            after_batch()
    total = np.concatenate(totals)
    reward = float(total.mean())
    return {"loss": -reward, "reward": reward, "accuracy": float(np.mean(total > 0)), "examples": count}
