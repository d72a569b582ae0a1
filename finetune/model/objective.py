"""The training objective: cross-entropy of the weighted (response) tokens, computed only where it counts.

keras-hub's causal LM projects every position of every row onto the whole
vocabulary, and the loss then reads the response positions alone. At Gemma's
256k vocabulary that projection is a fifth of a training step's matmuls, and
its float32 logits (batch x seq x vocabulary, 4 GB at batch 8 x 512) are the
largest tensor of the step. Here the backbone's hidden states are gathered at
the positions that carry a loss weight (batching.targets lays them out) and
projected a chunk of positions at a time, inside one custom-gradient op:

- the forward computes each position's loss (log-sum-exp minus the label's
  logit) and, while the chunk's logits exist, softmax minus one-hot times the
  (frozen) embedding: the hidden state's gradient per unit of loss, the only
  gradient LoRA needs. The backward scales it by the upstream gradient, so no
  logits are kept for it, and none recomputed; each chunk waits for the one
  before it, so one chunk's logits exist at a time;
- a chunk whose positions all weigh 0 (the padding of the gathered layout) is
  skipped. Compiled, the step chooses on the device (`ops.cond`); run eagerly
  (PyTorch), that choice is a read of the device for each chunk, so the weights
  are read once instead, before the backbone runs (weighted_on_host).

So the vocabulary projection costs what the loss needs, and at most one chunk
of logits exists at a time. The loss is the same as the full projection's
(tests/test_objective.py checks both against each other on every backend).
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras import ops

from finetune.data import batching
from finetune.model import tokens
from finetune.platform import keras_compat
from finetune.platform.errors import UserError


def logit_projection(backbone):
    """(kernel, soft cap) of the backbone's output projection: Gemma ties it to the token embedding.

    The kernel is (vocabulary, hidden). Gemma 1 to 4 keep a ReversibleEmbedding
    on the backbone; Gemma 3n keeps its embedding, and the soft cap, in its text model.
    """
    embedding = getattr(backbone, "token_embedding", None)
    if embedding is None:
        text = backbone.language_model
        return text.embed_tokens.embedding.embeddings, text.final_logit_soft_cap
    if not getattr(embedding, "tie_weights", True) or getattr(embedding, "quantization_mode", None):
        raise UserError(
            "this preset's output embedding is untied or quantized; finetune trains presets whose token embedding "
            "is tied and unquantized (as keras-hub's Gemma presets are)"
        )
    return embedding.embeddings, embedding.logit_soft_cap


def _logits(hidden, kernel, soft_cap):
    if isinstance(kernel, tokens.Projection):  # new tokens' rows (--add-tokens) in their columns
        logits = kernel.logits(hidden)
    else:
        logits = ops.cast(ops.matmul(hidden, ops.transpose(kernel)), "float32")
    if soft_cap is not None:  # Gemma 2's final soft cap: cap * tanh(logits / cap)
        logits = ops.tanh(logits / soft_cap) * soft_cap
    return logits


def _chunks(total: int, chunk: int):
    return [(start, min(start + chunk, total)) for start in range(0, total, chunk)]


def weighted_on_host(weights):
    """Whether each position weighs anything, as a numpy array, where a step runs eagerly on PyTorch; else None.

    Run eagerly, choosing a chunk on the device (`ops.cond`) reads the device: on a GPU the host waits for every
    op queued before it, and at a 256k vocabulary and 4096 positions a step has 32 chunks. targets() reads this
    once instead, before the backbone runs, when all the device has to finish is the batch's own copy, and the
    chunks are chosen in Python. Traced or compiled (JAX, TensorFlow, torch.compile), the device chooses.
    """
    if keras.config.backend() != "torch":
        return None
    import torch

    if torch.compiler.is_compiling() or weights.device.type == "meta":
        return None
    return (weights.detach() > 0).cpu().numpy()


def _carrying(weighted, spans) -> list | None:
    """Whether each chunk has a position that weighs anything, from weighted_on_host's array; None: the device
    chooses (ops.cond)."""
    return None if weighted is None else [bool(weighted[start:end].any()) for start, end in spans]


def token_losses_and_entropies(t: Targets, chunk: int):
    """(N, 2) float32: token_losses' losses, and each position's entropy of the softmax (GRPO's metric), made from
    the chunk's logits while they exist, without a gradient."""
    return _token_losses(t, chunk, entropy=True)


def token_losses(t: Targets, chunk: int):
    """Per-position cross-entropy of `t.labels` under `t.hidden @ t.kernel.T`, float32, 0 where a chunk weighs
    nothing; `chunk` positions are projected at a time.

    t.hidden: (N, D) in the compute dtype; t.kernel: (V, D); t.labels: (N,) int; t.weights: (N,); t.soft_cap
    (or None) caps the logits; t.weighted: weighted_on_host's array, or None (the device chooses the chunks).
    The gradient flows to `hidden` only: the kernel is the frozen embedding. Each
    position's loss is a scalar of its own, so its gradient is the upstream
    scalar times (softmax - one-hot) @ kernel; that product is made in the
    forward, while the chunk's logits exist, and kept (N x D), so the backward
    neither keeps nor recomputes any logits.
    """
    return _token_losses(t, chunk, entropy=False)


def _token_losses(t: Targets, chunk: int, entropy: bool):
    hidden, labels, weights, kernel, soft_cap, weighted = t
    spans = _chunks(hidden.shape[0], chunk)
    carrying = _carrying(weighted, spans)
    projection = kernel if isinstance(kernel, tokens.Projection) else None

    @ops.custom_gradient
    def losses(hidden, kernel, labels, weights, *new_rows):
        # With new tokens (--add-tokens) the kernel is the base's, and their rows come as the last input: the
        # one kernel gradient made, (softmax - one-hot)'s columns of the new ids times the hidden states.
        if projection is not None:
            kernel = tokens.Projection(kernel, new_rows[0], projection.added)  # the inputs, not the closure's
        loss_parts, grad_parts, column_parts = [], [], []
        for number, (start, end) in enumerate(spans):
            h, y = _after(hidden[start:end], loss_parts, carrying), labels[start:end]

            def chunk_loss(h=h, y=y):
                logits = _logits(h, kernel, soft_cap)
                if soft_cap is not None:  # d capped / d logit = 1 - tanh^2, tanh = capped / cap
                    slope = 1.0 - ops.square(logits / soft_cap)
                # Run eagerly (PyTorch), the logits are overwritten in place and each array freed when done with.
                loss, delta, spread = _loss_and_delta(logits, y, eager=keras.config.backend() == "torch",
                                                      entropy=entropy)  # fmt: skip
                del logits
                if soft_cap is not None:
                    delta = delta * slope
                if entropy:
                    loss = ops.stack([loss, ops.stop_gradient(spread)], axis=-1)
                # The hidden states' gradient in their dtype: under mixed_bfloat16 they are bfloat16 beside a
                # float32 kernel, and XLA's cond takes no branch of another dtype than nothing()'s.
                if projection is None:
                    return loss, ops.cast(ops.matmul(ops.cast(delta, h.dtype), kernel), h.dtype)
                return loss, kernel.times(delta, h.dtype), kernel.columns(delta)

            def nothing(h=h):
                empty = ops.zeros((h.shape[0], 2) if entropy else (h.shape[0],)), ops.zeros_like(h)
                return empty if projection is None else (*empty, ops.zeros((h.shape[0], len(projection.added.ids))))

            if carrying is None:
                parts = ops.cond(ops.any(weights[start:end] > 0), chunk_loss, nothing)
            else:
                parts = chunk_loss() if carrying[number] else nothing()
            loss_parts.append(parts[0])
            grad_parts.append(parts[1])
            column_parts.append(parts[2] if projection is not None else None)
        out = ops.concatenate(loss_parts, axis=0) if len(spans) > 1 else loss_parts[0]
        per_position = ops.concatenate(grad_parts, axis=0) if len(spans) > 1 else grad_parts[0]
        if projection is not None:
            columns = ops.concatenate(column_parts, axis=0) if len(spans) > 1 else column_parts[0]

        def gradient(*args, upstream=None):
            if upstream is None:  # jax and tensorflow pass it positionally, torch by name
                (upstream,) = args
            if entropy:  # the entropies carry no gradient
                upstream = upstream[:, 0]
            scale = ops.cast(ops.expand_dims(upstream, -1), per_position.dtype)
            if projection is None:
                return per_position * scale, None, None, None
            weighted = columns * ops.cast(scale, "float32")
            row_grad = ops.matmul(ops.transpose(weighted), ops.cast(hidden, "float32"))
            return per_position * scale, None, None, None, ops.cast(row_grad, new_rows[0].dtype)

        return out, gradient

    if projection is not None:
        return losses(hidden, projection.base, labels, weights, projection.rows)
    return losses(hidden, kernel, labels, weights)


def _loss_and_delta(logits, labels, eager: bool, entropy: bool = False):
    """(each row's cross-entropy, softmax - one-hot, each row's entropy or None), float32, from a chunk's float32
    logits.

    softmax - one-hot is made in float32, before any cast: a confident softmax
    rounded to bf16 first (p = 0.99 is 1 - 2^-7) would cancel the one against
    its own rounding error. Run eagerly (PyTorch), every step is a pass over
    (chunk x vocabulary) floats, so they are made in place, in the logits' own
    buffer (_loss_and_delta_in_place), the one subtracted at each row's label
    alone. Compiled (JAX, TensorFlow), the comparison with every vocabulary
    entry fuses into the loops that make the softmax: at gemma-2b dims on an
    Intel Xeon with AMX, JAX trained at 15.7 tokens/s with this form and at
    10-11 with log-softmax and a scatter in its place.
    """
    if eager:
        return _loss_and_delta_in_place(logits, labels, entropy)
    log_total = ops.logsumexp(logits, axis=-1, keepdims=True)
    picked = ops.take_along_axis(logits, ops.expand_dims(labels, -1), axis=-1)
    softmax = ops.exp(logits - log_total)
    is_label = ops.equal(ops.expand_dims(ops.arange(logits.shape[-1], dtype="int32"), 0),
                         ops.expand_dims(ops.cast(labels, "int32"), -1))  # fmt: skip
    spread = log_total[:, 0] - ops.sum(softmax * logits, axis=-1) if entropy else None  # -sum p log p
    return (log_total - picked)[:, 0], ops.where(is_label, softmax - 1.0, softmax), spread


def _loss_and_delta_in_place(logits, labels, entropy: bool = False):
    """_loss_and_delta on PyTorch, in the logits' own buffer: the softmax and its gradient overwrite them.

    Run eagerly, each step of the other form is a fresh (chunk x vocabulary)
    float32 array: four of them at once at the peak, 500 MiB for a chunk of
    128 positions at Gemma's 256k vocabulary. Here: the label's logit is read
    out, then the row's maximum subtracted, exp, divided by the row's sum and
    1 subtracted at the label, all in place; the losses come from the maximum
    and the sum. `logits` is consumed.
    """
    import torch

    rows = torch.arange(logits.shape[0], device=logits.device)
    labels = labels.long()
    picked = logits[rows, labels]
    top = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    probs.div_(total)
    spread = torch.special.entr(probs).sum(dim=-1) if entropy else None  # -sum p log p: one more chunk, asked for
    probs[rows, labels] -= 1.0
    return (top + torch.log(total))[:, 0] - picked, probs, spread


def _after(hidden, done: list, carrying=None):
    """`hidden`, made to depend on the chunks before it: TensorFlow's executor would otherwise run independent
    chunks at once (two were alive at the memory peak at gemma-2b's size). A NaN still propagates. Run eagerly
    (`carrying` given), the chunks run one after another as written: `hidden` itself."""
    if not done or carrying is not None:
        return hidden
    return hidden + ops.cast(0.0 * ops.sum(done[-1]), hidden.dtype)


def token_scores(t: Targets, chunk: int):
    """(loss, correct) per position, without gradients: what evaluation averages over the weighted tokens."""
    hidden, labels, weights, kernel, soft_cap, weighted = t
    losses, correct = [], []
    spans = _chunks(hidden.shape[0], chunk)
    carrying = _carrying(weighted, spans)
    for number, (start, end) in enumerate(spans):
        h, y = _after(hidden[start:end], losses, carrying), labels[start:end]

        def score(h=h, y=y):
            logits = _logits(h, kernel, soft_cap)
            picked = ops.take_along_axis(logits, ops.expand_dims(y, -1), axis=-1)[:, 0]
            hit = ops.cast(ops.equal(ops.cast(ops.argmax(logits, axis=-1), "int32"), ops.cast(y, "int32")), "float32")
            return ops.logsumexp(logits, axis=-1) - picked, hit

        n = end - start
        skip = lambda n=n: (ops.zeros((n,)), ops.zeros((n,)))  # noqa: E731
        if carrying is None:
            loss, hit = ops.cond(ops.any(weights[start:end] > 0), score, skip)
        else:
            loss, hit = score() if carrying[number] else skip()
        losses.append(loss)
        correct.append(hit)
    return ops.concatenate(losses, axis=0), ops.concatenate(correct, axis=0)


def _gathered(backbone, inputs, shards: int, rows: int | None = None, training=None):
    """The backbone's hidden states at inputs["loss_positions"], flattened to (batch x width, hidden).

    Positions index within their data shard's rows (batching.targets), so each
    shard gathers from its own rows only. rows: the batch's rows, when the
    inputs' shapes leave it unknown (TensorFlow's evaluate() traces a batch of
    None rows): the chunks of objective's op need a static count of positions.
    """
    hidden = backbone(
        {name: value for name, value in inputs.items() if not name.startswith("loss_")}, training=training
    )
    width = hidden.shape[-1]
    positions = inputs["loss_positions"]
    per_shard = ops.reshape(hidden, (shards, -1, width))
    index = ops.reshape(positions, (shards, -1, 1))
    gathered = ops.take_along_axis(per_shard, ops.cast(index, "int32"), axis=1)
    count = positions.shape[0] or rows
    return ops.reshape(gathered, (count * positions.shape[1] if count else -1, width))


class Targets(NamedTuple):
    """What every view's loss reads: the hidden states at the trained positions, their labels and weights, and
    the logits' projection (its kernel as a tensor, and the family's soft cap or None)."""

    hidden: object
    labels: object
    weights: object
    kernel: object
    soft_cap: float | None
    weighted: object = None
    """weighted_on_host's array, read before the backbone ran (PyTorch run eagerly), or None."""


def targets(backbone, inputs, shards: int, rows: int | None = None, training=None) -> Targets:
    """The backbone run on a batch's model inputs, and what its loss positions need (_gathered says how)."""
    labels = ops.reshape(inputs["loss_labels"], (-1,))
    weights = ops.reshape(inputs["loss_weights"], (-1,))
    weighted = weighted_on_host(weights)  # before the backbone is queued: the read waits for the batch's copy alone
    hidden = _gathered(backbone, inputs, shards, rows, training=training)
    kernel, soft_cap = logit_projection(backbone)
    embedding = getattr(backbone, "token_embedding", None)
    kernel = tokens.projection(embedding, ops.convert_to_tensor(kernel))
    return Targets(hidden, labels, weights, kernel, soft_cap, weighted)


class ResponseTokens:
    """SFT's objective: the mean cross-entropy of the response tokens (methods/supervised.py)."""

    def view(self, lm, chunk: int, shards: int = 1) -> TrainingView:
        """The view of `lm` that trains this loss."""
        return TrainingView(lm, chunk, shards, dtype=keras.config.dtype_policy())


class TrainingView(keras.Model):
    """`lm`'s backbone with the response-token loss: call() returns each gathered position's loss.

    It shares every layer and weight with `lm`, so what it trains is what `lm`
    generates with and saves. Compiled with TokenShare, train_on_batch
    minimises the mean loss over the step's weighted tokens.
    """

    def __init__(self, lm, chunk: int, shards: int = 1, rows: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.lm = lm
        self.chunk = chunk
        self.shards = shards
        self.rows = rows

    def call(self, inputs, training=None):
        # keras' trainers pass `training` only to a call that takes it, and JAX's stateless call sets no call
        # context: passed on to the backbone, it reaches LoRA dropout and NEFTune, which act only while training.
        t = targets(self.lm.backbone, inputs, self.shards, training=training)
        losses = token_losses(t, self.chunk)
        return ops.reshape(losses, ops.shape(inputs["loss_labels"]))

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs["loss_labels"].shape, dtype="float32")

    def step_metrics(self) -> list | None:
        """The metrics compile() reports beside the loss, each step; None: the loss alone."""
        return None

    def train_on_batch(self, *args, **kwargs):
        """keras' train_on_batch, which on PyTorch walks every layer for the trainable weights three times a step
        and for the metrics three more (about 5% of a host-bound step at gemma-2b's depth): from the second step
        on, with lean ops on (keras_compat.lean_torch_ops), each is collected once a step (_walked_once). Nothing
        changes which weights train within a step."""
        if keras.config.backend() != "torch" or self.train_function is None or not keras_compat.lean_torch_ops_on():
            return super().train_on_batch(*args, **kwargs)
        self.__dict__["_walked"] = {}  # past keras' attribute tracking
        try:
            return super().train_on_batch(*args, **kwargs)
        finally:
            self.__dict__["_walked"] = None

    def _walked_once(self, name: str, walk):
        walked = self.__dict__.get("_walked")
        if walked is None:
            return walk()
        if name not in walked:
            walked[name] = walk()
        return walked[name]

    @property
    def trainable_weights(self):
        return self._walked_once("trainable_weights", lambda: super(TrainingView, self).trainable_weights)

    @property
    def metrics(self):
        return self._walked_once("metrics", lambda: super(TrainingView, self).metrics)

    def make_train_function(self, force=False):
        """On TensorFlow, one graph for every batch length, traced on the first step.

        Keras' own step relaxes the length to a dynamic one only after it has
        seen two lengths, so a run resumed mid-way would train a step in a graph
        specialised to one length where the uninterrupted run used the relaxed
        one: the same sums in another order, an adapter off in its last bits.
        """
        if keras.config.backend() != "tensorflow" or self.run_eagerly:
            return super().make_train_function(force)
        if self.train_function is None or force:
            self.train_function = _one_graph(self.train_step, self.jit_compile)
        return self.train_function


def _one_graph(train_step, jit_compile: bool):
    """train_on_batch's function: `train_step` traced once for each batch size and loss width, with every other
    input's length (axis 1) left dynamic, so a run's steps share one graph.

    A run's micro-batches all have one size; `--batch-size auto` tries several, and each traces its own (a graph
    traced for one size refused the next). jit_compile: Keras' choice (XLA on a GPU, where XLA compiles each
    length on its own, as under JAX)."""
    import tensorflow as tf

    traced = {}

    def spec(name, value):  # the loss_ inputs keep their static width: the loss's chunks need it
        shape = tuple(value.shape)
        # So do the per-row image inputs: a run's image slots are fixed, and keras-hub's Gemma 4 layers branch in
        # Python on their count, which a traced graph cannot do on a dynamic one.
        kept = name.startswith("loss_") or name in batching.PER_ROW or len(shape) < 2
        shape = shape if kept else (shape[0], None, *shape[2:])
        return tf.TensorSpec(shape, tf.as_dtype(value.dtype))

    def function(batches):
        for x, y, weights in batches:
            signature = [{name: spec(name, value) for name, value in x.items()}, spec("loss_", y),
                         spec("loss_", weights)]  # fmt: skip
            key = repr(signature)
            if key not in traced:
                traced[key] = tf.function(
                    lambda x, y, w: train_step((x, y, w)), input_signature=signature, jit_compile=jit_compile
                )
            return traced[key](x, y, weights)

    return function


class ScoringView(TrainingView):
    """The same, for evaluation: call() returns {"loss", "correct"}, each gathered position's.

    Compiled by model.scorer() with weighted means of both, so Keras' evaluate()
    averages them over every weighted token of every batch, and distributes the
    batches over processes as it does for training.
    """

    def call(self, inputs):
        t = targets(self.lm.backbone, inputs, self.shards, self.rows)
        loss, correct = token_scores(t, self.chunk)
        shape = ops.shape(inputs["loss_labels"])
        return {"loss": ops.reshape(loss, shape), "correct": ops.reshape(correct, shape)}

    def compute_output_spec(self, inputs):
        shape = inputs["loss_labels"].shape
        return {name: keras.KerasTensor(shape, dtype="float32") for name in ("loss", "correct")}


def output_itself(y_true, y_pred):
    """A metric function whose value is the model's output: a ScoringView's loss or correctness."""
    del y_true
    return y_pred


class WeightedMean(keras.losses.Loss):
    """The loss of a TrainingView, whose output is already each position's loss: their weighted mean."""

    def __init__(self, name: str = "token_loss"):
        super().__init__(name=name, reduction="mean_with_sample_weight")

    def call(self, y_true, y_pred):
        del y_true  # the labels went in with the inputs
        return y_pred


class TokenShare(keras.losses.Loss):
    """The training loss of a TrainingView: each position's loss times its weight, summed.

    batching.TrainOrder makes the weights each token's share of its optimizer
    step (times the micro-batches, which Keras' accumulation averages), so the
    sum is the mean over the step's response tokens however they fall into
    micro-batches; WeightedMean would divide each micro-batch by its own count.
    """

    def __init__(self, name: str = "token_loss"):
        super().__init__(name=name, reduction="sum")

    def call(self, y_true, y_pred):
        del y_true  # the labels went in with the inputs
        return y_pred


class ColumnMean(keras.metrics.Metric):
    """The mean of one column of a method's view output (a step metric TRL names), over what its loss weighs.

    by_weight: bool. Each row (a pair) counts by its column-0 weight, its share of the step (0 for padding rows and
        filler pairs): a preference or reward view's. False: each slot the column-0 weight keeps counts once, as
        TRL's masked means over completion tokens (GRPO's KL and clip ratios).
    """

    def __init__(self, column: int, name: str, by_weight: bool = True, **kwargs):
        super().__init__(name=name, **kwargs)
        self.column, self.by_weight = column, by_weight
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        del y_true
        weight = ops.cast(sample_weight[..., 0], "float32")
        weight = weight if self.by_weight else ops.cast(weight > 0, "float32")
        self.total.assign_add(ops.sum(ops.cast(y_pred[..., self.column], "float32") * weight))
        self.count.assign_add(ops.sum(weight))

    def result(self):
        return self.total / ops.maximum(self.count, 1e-12)

    def reset_state(self):
        self.total.assign(0.0)
        self.count.assign(0.0)

    def get_config(self):
        return {**super().get_config(), "column": self.column, "by_weight": self.by_weight}
