"""Token ids and response-only weights, laid out in fixed-size batches.

keras-hub's Gemma preprocessor takes whole strings and cannot tell prompt from
response, so the ids are built here: <bos> prompt response <eos>, weight 0 on
prompt positions and 1 on response positions (and on <eos>, so the model
learns to stop). Arrays carry `segment_ids` (1 for the only example of a
row, 0 for padding); packing.py puts several examples in a row with ids
1, 2, 3..., and attention.py makes them a per-example mask in the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from finetune.data import audio, images
from finetune.platform.errors import UserError

BOS, EOS = 2, 1  # Gemma's ids; asserted against the tokenizer in tokenize().
# What a batch feeds the model. Gemma 4's backbone also takes position_ids (model.input_names says which).
INPUTS = ("token_ids", "padding_mask")
# The pictures' and audio clips' inputs: per row (kept whole when a batch is cut to its longest row), and all.
PER_ROW = (*images.PER_ROW, *audio.PER_ROW)
MEDIA = (*images.INPUTS, *audio.INPUTS)


@dataclass
class Example:
    token_ids: list[int]
    """<bos> prompt response <eos>, at most seq_len + 1 ids (inputs and shifted targets)."""
    weights: list[float]
    """Per id: 1.0 where the id is a training target, 0.0 where it is not."""
    inputs: dict = field(default_factory=dict)
    """The example's model inputs beside its ids, one array each: its pictures (images.model_inputs)."""


def template_overhead(tokenizer, template) -> int:
    """Tokens the template's fixed text takes, with empty instruction and response."""
    from finetune.data.formats import Record

    prompt, response = template.apply(Record(instruction="", response=""))
    return 2 + len(_ids(tokenizer, prompt + response))  # + <bos> and <eos>


def tokenize(items, tokenizer, seq_len: int, train_on_prompt: bool = False):
    """Texts to Examples; returns (examples, indices of dropped items).

    items: (prompt, response) pairs, or lists of (text, trained) segments (a
        template's `segments()`: every turn of a chat). Trained segments and the
        closing <eos> get weight 1, the others 0 (1 with train_on_prompt).
    An item cut at seq_len with no trained token left (its prompt alone fills
    the sequence) has nothing to learn from and is dropped.
    """
    check_layout(tokenizer)
    items = [[(item[0], False), (item[1], True)] if isinstance(item, tuple) else list(item) for item in items]
    texts = [text for item in items for text, _ in item]
    pieces = iter(leading_ids(tokenizer, texts, seq_len))
    examples, dropped = [], []
    for index, item in enumerate(items):
        ids, weights, trained = [BOS], [0.0], [False]
        for _, is_trained in item:
            segment = next(pieces)
            ids += segment
            weights += [1.0 if is_trained or train_on_prompt else 0.0] * len(segment)
            trained += [is_trained] * len(segment)
        ids, weights, trained = ids + [EOS], weights + [1.0], trained + [True]
        ids, weights = ids[: seq_len + 1], weights[: seq_len + 1]
        if not any(trained[: len(ids)]):  # nothing of the response survived the cut
            dropped.append(index)
            continue
        examples.append(Example(ids, weights))
    return examples, dropped


def check_layout(tokenizer) -> None:
    if tokenizer.token_to_id("<bos>") != BOS or tokenizer.token_to_id("<eos>") != EOS:
        raise ValueError("tokenizer does not have Gemma's <bos>=2 / <eos>=1 layout")


def leading_ids(tokenizer, texts, seq_len: int):
    """The ids of each text, as far as seq_len + 1 of them can be kept; very long texts are cut first.

    Tokenizing takes time in the text's length (6.8 s for a 10 MB record with the
    tiny tokenizer) though at most seq_len + 1 ids are kept. A text is cut to 32
    characters per kept id, and the cut is used only if it still gives twice the
    ids kept: SentencePiece pieces are short and the cut changes only the last
    few, so the kept ids are the whole text's. Texts of long pieces (a run of
    unknown characters merged into one <unk>) fall back to the whole text.
    """
    return _kept_ids(tokenizer, texts, seq_len, lambda text, limit: text[:limit])


def trailing_ids(tokenizer, texts, seq_len: int):
    """The ids of each text whose last seq_len + 1 are its own (a prompt cut from its left keeps its end); a very
    long text is cut from its left first, as leading_ids() cuts one from its right, so its first ids may differ."""
    return _kept_ids(tokenizer, texts, seq_len, lambda text, limit: text[-limit:])


def _kept_ids(tokenizer, texts, seq_len: int, cut):
    limit = 32 * (seq_len + 1)
    ids = _ids(tokenizer, [cut(text, limit) for text in texts])
    for index, text in enumerate(texts):
        if len(text) > limit and len(ids[index]) < 2 * (seq_len + 1):
            ids[index] = _ids(tokenizer, text)
    return ids


def _ids(tokenizer, texts):
    out = tokenizer.tokenize(texts)
    if isinstance(texts, str):
        return [int(t) for t in np.asarray(out)]
    return [[int(t) for t in np.asarray(row)] for row in out]


def pad(examples: list[Example], seq_len: int) -> dict[str, np.ndarray]:
    """One example per row, right-padded: inputs, shifted targets and weights."""
    n = len(examples)
    ids = np.zeros((n, seq_len + 1), np.int32)
    weights = np.zeros((n, seq_len + 1), np.float32)
    for row, example in enumerate(examples):
        ids[row, : len(example.token_ids)] = example.token_ids
        weights[row, : len(example.weights)] = example.weights
    lengths = np.array([len(e.token_ids) - 1 for e in examples])
    present = np.arange(seq_len)[None, :] < lengths[:, None]
    arrays = {
        "token_ids": ids[:, :-1],
        "padding_mask": present,
        "segment_ids": present.astype(np.int32),
        "labels": ids[:, 1:],
        "weights": weights[:, 1:],
    }
    if examples and examples[0].inputs:
        arrays.update({key: np.stack([e.inputs[key] for e in examples]) for key in examples[0].inputs})
        for indices, mask in (("vision_indices", "vision_mask"), ("audio_indices", "audio_mask")):
            if indices in arrays:
                arrays[mask] = images.vision_mask(arrays[indices], seq_len)
    return arrays


def check_fits(examples, dropped: list[int], source: str, seq_len: int) -> None:
    """Refuse records none of which leaves a token to score. A trained run's seq_len is fixed (`finetune eval`
    reads it from the run): shorter records are the first fix, a run trained longer the other."""
    if not examples:
        raise UserError(
            f"no usable records in {source}: all {len(dropped)} prompts fill the whole sequence of {seq_len} "
            "tokens; use shorter records, or train with a longer --seq-len"
        )


def target_width(arrays, rows_per_shard: int) -> int:
    """Gathered-target slots per row: room for the weighted positions of any `rows_per_shard` rows of `arrays`.

    One width serves every batch, so each step has one shape (one compile): the
    rows with the most weighted positions set it. A batch with fewer fills the
    rest with weight-0 slots, which objective.py skips a chunk at a time.
    """
    counts = np.sort((np.asarray(arrays["weights"]) > 0).sum(axis=1))[::-1]
    most = int(counts[:rows_per_shard].sum())
    return max(8, -(-most // (8 * rows_per_shard)) * 8)


def targets(arrays, rows: np.ndarray, shards: int, width: int) -> dict[str, np.ndarray]:
    """loss_positions, loss_labels and loss_weights of `rows`: each data shard's weighted positions, in front.

    `rows` are split into `shards` equal groups (a data shard each); a group's
    weighted positions, as row-in-group * seq_len + position, fill its
    rows * width slots in order, then weight-0 slots pointing at position 0.
    Indices stay within their shard, so each device gathers from its own rows.
    """
    length = arrays["weights"].shape[1]
    per_shard = len(rows) // shards
    positions = np.zeros((shards, per_shard * width), np.int32)
    labels = np.zeros((shards, per_shard * width), np.int32)
    weights = np.zeros((shards, per_shard * width), np.float32)
    for shard in range(shards):
        group = rows[shard * per_shard : (shard + 1) * per_shard]
        w = arrays["weights"][group]
        local_row, position = np.nonzero(w > 0)
        n = len(position)
        if n > per_shard * width:
            raise ValueError(f"{n} weighted positions do not fit {per_shard} rows of {width} target slots")
        positions[shard, :n] = local_row * length + position
        labels[shard, :n] = arrays["labels"][group][local_row, position]
        weights[shard, :n] = w[local_row, position]
    shape = (len(rows), width)
    return {
        "loss_positions": positions.reshape(shape),
        "loss_labels": labels.reshape(shape),
        "loss_weights": weights.reshape(shape),
    }


def inputs(arrays, rows: np.ndarray, shards: int, width: int, length: int | None = None, names=INPUTS):
    """(x, y, sample_weight) for a TrainingView or ScoringView: the rows' model inputs and gathered targets.

    length: int. Keep the first `length` positions of each row (batch_length); None keeps them all.
    names: the model's inputs (model.input_names).
    """
    if length is not None and length < arrays["token_ids"].shape[1]:
        arrays = {key: value if key in PER_ROW else value[:, :length] for key, value in arrays.items()}
    gathered = targets(arrays, rows, shards, width)
    # The segment ids stand in for keras-hub's padding mask: attention.py makes them a per-example mask.
    x = {**model_inputs(arrays["token_ids"][rows], arrays["segment_ids"][rows], names), **gathered}
    x.update(media_inputs({name: arrays[name][rows] for name in MEDIA if name in arrays}, names))
    return x, gathered["loss_labels"], gathered["loss_weights"]


def media_inputs(media: dict, names) -> dict:
    """The pictures' and clips' inputs the model takes (`names`), of one batch's `media` (MEDIA arrays of its
    rows): for keras-hub's Gemma 3n, which places them by their order in the whole batch and takes no indices,
    laid out in that order (images.in_batch_order). A training batch's and a sampled batch's alike."""
    x = {name: value for name, value in media.items() if name in names}
    if "images" in x and "vision_indices" not in names and "vision_indices" in media:
        x["images"] = images.in_batch_order(x["images"], media["vision_indices"])
    if "input_features" in x and "audio_indices" not in names and "audio_indices" in media:
        for name in ("input_features", "input_features_mask"):
            x[name] = images.in_batch_order(x[name], media["audio_indices"])
    return x


def model_inputs(token_ids: np.ndarray, padding_mask: np.ndarray, names=INPUTS) -> dict:
    """The model's inputs for these rows: ids, the padding mask (or segment ids), and positions if it takes them.

    Positions count from 0 in each example of a row, as they would in a row of
    its own; rotary embeddings see only their differences in any case.
    """
    x = {"token_ids": token_ids, "padding_mask": padding_mask}
    if "position_ids" in names:
        x["position_ids"] = example_positions(padding_mask)
    return x


def example_positions(segment_ids: np.ndarray) -> np.ndarray:
    """(rows, length) int32: each position's index within its example (padding counts on from its start)."""
    segments = np.asarray(segment_ids).astype(np.int32)
    index = np.broadcast_to(np.arange(segments.shape[1], dtype=np.int32), segments.shape)
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def length_step(backend: str, seq_len: int, device: str = "cpu", compiled: bool = False) -> int:
    """How finely a batch's length is cut to its longest row: each length is a compiled shape.

    XLA compiles a program per shape (JAX everywhere, TensorFlow on an accelerator or with --compile), and so does
    torch.compile (PyTorch with --compile), so there the lengths are few (eighths of seq_len); TensorFlow on a CPU
    traces one graph with a dynamic length (objective.TrainingView) and PyTorch runs eagerly, so theirs follow the
    rows to within 16 positions.

    compiled: bool. The run compiles its step further (--compile, builder.compile_step).
    """
    return max(16, seq_len // 8) if compiles_per_length(backend, device, compiled) else 16


def compiles_per_length(backend: str, device: str = "cpu", compiled: bool = False) -> bool:
    """Whether each new batch length compiles a new program (see length_step)."""
    return backend == "jax" or compiled or (backend == "tensorflow" and device != "cpu")


def batch_length(lengths: np.ndarray, step: int, seq_len: int) -> int:
    """The positions a batch whose rows hold `lengths` tokens needs: the longest, rounded up to `step`."""
    longest = int(lengths.max()) if len(lengths) else seq_len
    return min(seq_len, max(step, -(-longest // step) * step))


@dataclass(frozen=True)
class Feed:
    """How batches are fed to the model, for TrainOrder and Batches alike.

    part: (first, end, n). The data shards of each batch this process feeds (distribution.data_part).
    length_step: int or None. Cut each batch to its longest row, rounded up to this (length_step()); None keeps
        seq_len.
    inputs: tuple of str. The model's input names (builder.input_names).
    grouped: bool. Training orders draw each step's rows of like length (--group-by-length; EpochRows).
    """

    part: tuple = (0, 1, 1)
    length_step: int | None = None
    inputs: tuple = INPUTS
    grouped: bool = False


GROUP_STEPS = 50
"""--group-by-length: the most steps of rows sorted together (transformers' mega-batch is 50 batches)."""


class EpochRows:
    """Which rows each optimizer step trains, a pure function of (seed, step): data epoch e takes the rows of
    permutation(seed + e) in order, `size` at a time, every row once; the last step of an epoch may hold fewer.
    TrainOrder (rows of tokens) and pair_batches.PairOrder (pairs) both draw their steps from it.

    lengths: each row's length, to group rows of like length (--group-by-length): the epoch's permutation is cut
    into stretches of `size` x GROUP_STEPS rows (fewer, so an epoch has about four), each sorted longest first
    (ties in shuffled order), and the epoch's longest row trades places with the first stretch's first (an
    out-of-memory shows at the epoch's first step, as transformers' LengthGroupedSampler does). Steps then hold rows of like
    length, in an order still shuffled across stretches; every row is trained once an epoch, and the step count
    is unchanged."""

    def __init__(self, count: int, size: int, seed: int, lengths: np.ndarray | None = None):
        self.count, self.size, self.seed = count, size, seed
        self.steps_per_epoch = -(-count // size)
        self.lengths = None if lengths is None else np.asarray(lengths)
        self._epoch, self._order = None, None

    def __call__(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            order = np.random.default_rng(self.seed + epoch).permutation(self.count)
            self._epoch, self._order = epoch, order if self.lengths is None else self._grouped(order)
        return self._order[index * self.size : (index + 1) * self.size]

    def _grouped(self, order: np.ndarray) -> np.ndarray:
        stretch = self.size * max(1, min(GROUP_STEPS, -(-self.steps_per_epoch // 4)))
        parts = [order[i : i + stretch] for i in range(0, len(order), stretch)]
        grouped = np.concatenate([part[np.argsort(-self.lengths[part], kind="stable")] for part in parts])
        longest = int(np.argmax(self.lengths[grouped]))  # the first of its stretch: sorted longest first
        grouped[[0, longest]] = grouped[[longest, 0]]  # the epoch's longest row into its first step
        return grouped


class Order:
    """What the loop (training/loop.py) asks of the order a method's rows train in, whatever the method.

    An order gives each optimizer step's micro-batches (micro_batches), their metric weights (metric_weights) and
    tokens (tokens), as a pure function of (seed, step), so that a resumed run trains what an uninterrupted one did.
    The steps below are those few orders need; each is a no-op here.
    """

    def step_metrics(self, step: int) -> dict:
        """What history.csv keeps of step `step` beside the loss (GRPO's rewards and lengths); {} for most."""
        return {}

    def kept(self, steps: int) -> dict | None:
        """Arrays a checkpoint after `steps` steps keeps so that the next step trains what it would have (GRPO's
        batch of rollouts part way through --num-iterations); None where the order is a function of the step."""
        return None

    def take_up(self, steps: int, arrays: dict) -> None:
        """Go on from a checkpoint after `steps` steps with the arrays kept() gave it."""


class TrainOrder(Order):
    """The training batches of every global optimizer step, a pure function of (seed, step).

    Data epoch e trains the rows of permutation(seed + e) in order (grouped by
    length with feed.grouped: EpochRows), batch_size x grad_accum at a time:
    every row once per epoch. The last step of an epoch
    may hold fewer rows; it is filled up with weight-0 copies of its own rows,
    so every micro-batch keeps one shape (one XLA compile) and its length, and
    nothing is dropped. Since step s always trains the same rows, a run resumed
    at step s trains exactly the batches an uninterrupted run would, and the
    tokens counted for a step are those of the rows that step trained.

    Each micro-batch's sample weights are its tokens' weights over the step's
    total weight, times grad_accum: summed (objective.TokenShare) and averaged
    over the micro-batches (Keras' accumulation), the loss is the mean over every
    response token of the step, as one batch of batch_size x grad_accum rows gives.
    """

    def __init__(self, arrays, batch_size: int, seed: int, feed: Feed = None, grad_accum: int = 1):
        feed = feed or Feed()
        self.arrays = arrays
        self.feed = feed
        self.inputs = feed.inputs
        """The model's input names (model.input_names)."""
        self.batch_size = batch_size
        """Rows per micro-batch."""
        self.grad_accum = grad_accum
        self.seed = seed
        self.part = feed.part
        self.lengths = np.count_nonzero(arrays["padding_mask"], axis=1)
        self._rows = EpochRows(len(arrays["token_ids"]), batch_size * grad_accum, seed,
                               self.lengths if feed.grouped else None)  # fmt: skip
        self.steps_per_epoch = self._rows.steps_per_epoch
        self.width = target_width(arrays, batch_size // feed.part[2])
        self.length_step = feed.length_step
        """Cut each micro-batch to its longest row, rounded up to this (length_step()); None keeps seq_len."""

    def rows(self, step: int) -> np.ndarray:
        """The rows optimizer step `step` trains: batch_size x grad_accum, or fewer at an epoch's end."""
        return self._rows(step)

    def micro_batches(self, step: int) -> list:
        """[(inputs, labels, weights)] of global step `step` (0-based), one per micro-batch: this process's part."""
        rows = self.rows(step)
        size = self.batch_size * self.grad_accum
        filled = np.concatenate([rows, rows[np.arange(size - len(rows)) % len(rows)]])
        real = np.arange(size) < len(rows)
        arrays = {key: value[filled] for key, value in self.arrays.items()}
        arrays["weights"] = np.where(real[:, None], arrays["weights"], np.float32(0))
        scale = np.float32(self.grad_accum / max(float(arrays["weights"].sum()), 1.0))
        first, end, _ = self.part
        out = []
        for micro in range(self.grad_accum):
            group = np.arange(micro * self.batch_size, (micro + 1) * self.batch_size)
            x, labels, weights = inputs(
                arrays, local(group, self.part), end - first, self.width, self.length(filled[group]), self.inputs
            )
            out.append((x, labels, weights * scale))
        return out

    def batch(self, step: int):
        """(inputs, labels, weights) of global step `step` without accumulation (micro_batches' only one)."""
        if self.grad_accum != 1:
            raise ValueError("a step of several micro-batches has no one batch; use micro_batches(step)")
        return self.micro_batches(step)[0]

    def metric_weights(self, step: int) -> list[float]:
        """The weight of each micro-batch's reported metrics in the step's mean (PairOrder's are its real pairs).
        The response-token loss reports none beside the loss, which its sample weights average already."""
        return [1.0] * self.grad_accum

    def length(self, rows: np.ndarray) -> int | None:
        """The positions the batch of `rows` is cut to: the same in every process, from the global rows."""
        if self.length_step is None:
            return None
        return batch_length(self.lengths[rows], self.length_step, self.arrays["token_ids"].shape[1])

    def tokens(self, step: int) -> tuple[int, int]:
        """Non-padding input tokens and weighted (trained) targets of step `step`'s rows."""
        rows = self.rows(step)
        return int(self.arrays["padding_mask"][rows].sum()), int(self.arrays["weights"][rows].sum())


def _batches_class():
    """Batches, made on first use: a keras PyDataset, so that importing this module imports no framework (the plan
    and the method registry read it before a backend is chosen)."""
    import keras

    class Batches(keras.utils.PyDataset):
        """Held-out batches for model.scorer()'s evaluate(): every row once, in order, in batches of one shape.

        The ragged last batch is filled with weight-0 copies of other rows, so XLA
        compiles once and the weighted averages ignore the copies.
        """

        def __init__(self, arrays, batch_size: int, feed: Feed = None):
            super().__init__()
            feed = feed or Feed()
            self.arrays = arrays
            self.inputs = feed.inputs
            self.batch_size = batch_size
            self.rows = len(arrays["token_ids"])
            self.part = feed.part
            self.width = target_width(arrays, batch_size // feed.part[2])
            self.length_step = feed.length_step
            """As TrainOrder's: held-out rows hold one example each, so most of a row is padding."""

        def __len__(self):
            return -(-self.rows // self.batch_size)

        def __getitem__(self, index):
            rows = np.arange(index * self.batch_size, min((index + 1) * self.batch_size, self.rows))
            short = self.batch_size - len(rows)
            arrays = self.arrays
            if short:  # filler rows: copies of earlier ones, their weights zeroed
                rows = np.concatenate([rows, np.arange(short) % self.rows])
                arrays = {k: v[rows] for k, v in arrays.items()}
                arrays["weights"] = arrays["weights"].copy()
                arrays["weights"][len(rows) - short :] = 0
                rows = np.arange(self.batch_size)
            first, end, _ = self.part
            length = None
            if self.length_step is not None:
                lengths = np.count_nonzero(arrays["padding_mask"][rows], axis=1)
                length = batch_length(lengths, self.length_step, arrays["token_ids"].shape[1])
            x, labels, weights = inputs(arrays, local(rows, self.part), end - first, self.width, length, self.inputs)
            # A ScoringView has two outputs, each averaged with the same weights.
            return x, {"loss": labels, "correct": labels}, {"loss": weights, "correct": weights}

    return Batches


def __getattr__(name: str):
    if name == "Batches":
        globals()["Batches"] = _batches_class()
        return globals()["Batches"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def local(rows: np.ndarray, part: tuple[int, int, int]) -> np.ndarray:
    """The rows of data shards first..end-1 of n, for part (first, end, n): what this process feeds."""
    first, end, n = part
    share = len(rows) // n
    return rows[first * share : end * share]
