"""New tokens (--add-tokens): one id each in the tokenizer, and their embedding rows trained beside LoRA.

Where the ids come from: a Gemma tokenizer reserves `<unusedN>` pieces, and renaming one keeps the vocabulary
size, so every export keeps its shapes; a tokenizer without them (the tiny presets') gets the rest appended after
its last piece. Either way the new piece is a SentencePiece USER_DEFINED piece, which the encoder always matches
whole, wherever it stands in a text: the token is one id in training data, chat templates, eval and generate.

The base's embedding matrix is never trained, nor touched: the new rows are a variable of their own
(`added_token_rows`, float32, on the token embedding), which the embedding's call uses for the new ids, both ways
(Gemma ties its input and output embeddings: the logits of a new id are its new row times the hidden state). So
AdamW's steps and its weight decay reach these rows alone, and every other row stays bit for bit.

A new row starts as the mean of the base's rows of the pieces its text encoded to before it was added: the token
starts out meaning about what its spelling did, its logit about that of its pieces, where a Gemma `<unusedN>` row
(never trained) or a random one would give it a logit unrelated to the rest (transformers' resize_token_embeddings
starts new rows at the mean of all rows, about what every token means at once).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

import numpy as np
from keras import ops

from finetune.platform import keras_compat
from finetune.platform.errors import UserError

ROWS = "added_token_rows"
"""The variable of the new rows, on the token embedding: what the optimizer steps at --embedding-lr."""

_UNUSED = re.compile(r"<unused(\d+)>")


@dataclass(frozen=True)
class Added:
    """The new tokens of a tokenizer, as `plan` placed them.

    Args:
        tokens: tuple of str. The tokens, in the order given.
        ids: tuple of int. Each token's id: a renamed `<unusedN>` piece's, or one past the base's vocabulary.
        base_vocabulary: int. The base tokenizer's (and embedding's) size.
        pieces: tuple of tuple of int. The ids each token's text encoded to before it was added.
    """

    tokens: tuple
    ids: tuple
    base_vocabulary: int
    pieces: tuple = ()

    @property
    def vocabulary(self) -> int:
        """The vocabulary with the new tokens: larger than the base's by the tokens appended."""
        return max(self.base_vocabulary, max(self.ids) + 1)

    @property
    def appended(self) -> int:
        return self.vocabulary - self.base_vocabulary

    def describe(self) -> dict:
        """adapter.json's `added_tokens`."""
        return {"tokens": list(self.tokens), "ids": list(self.ids), "vocabulary": self.vocabulary}


def plan(tokenizer, tokens, rows: int) -> tuple[Added, bytes]:
    """(where each token goes, the tokenizer's SentencePiece model with them) for `tokenizer` and an embedding of
    `rows` rows: the lowest `<unusedN>` pieces renamed, in order, then pieces appended. Refuses a token that is a
    piece already, and appending where the tokenizer has other than `rows` pieces."""
    from sentencepiece import sentencepiece_model_pb2

    tokens = tuple(tokens)  # each checked already (config._new_tokens)
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(_proto_bytes(tokenizer))
    pieces = {p.piece: i for i, p in enumerate(model.pieces)}
    for token in tokens:
        if token in pieces:
            raise UserError(
                f"--add-tokens {token!r} is already one piece of this tokenizer (id {pieces[token]}); it needs no "
                "new row: leave it out"
            )
    unused = sorted((int(m.group(1)), i) for p, i in pieces.items() if (m := _UNUSED.fullmatch(p)))
    free = [i for _, i in unused]
    if len(free) < len(tokens) and len(model.pieces) != rows:
        raise UserError(
            f"--add-tokens: this tokenizer has {len(model.pieces)} pieces and its embedding {rows} rows, and too few "
            f"<unusedN> pieces ({len(free)}) to rename; finetune appends new tokens only where the two agree"
        )
    before = tuple(tuple(int(t) for t in np.asarray(tokenizer.tokenize(token)).reshape(-1)) for token in tokens)
    ids = []
    for token in tokens:
        if free:
            index = free.pop(0)
            piece = model.pieces[index]
        else:
            index = len(model.pieces)
            piece = model.pieces.add()
        piece.piece, piece.score, piece.type = token, 0.0, sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
        ids.append(index)
    return Added(tokens, tuple(ids), rows, before), model.SerializeToString()


def _proto_bytes(tokenizer) -> bytes:
    proto = tokenizer.proto
    if isinstance(proto, str):  # keras-hub keeps bytes once set; a path where it was given one
        with open(proto, "rb") as f:
            return f.read()
    return bytes(proto)


def add(lm, preprocessor, tokens) -> Added | None:
    """Give `preprocessor`'s tokenizer the new `tokens` and `lm`'s token embedding their rows (trainable, the
    mean of their pieces' rows); None and nothing changed when there are none. Before LoRA or after it."""
    if not tokens:
        return None
    embedding = token_embedding(lm.backbone)
    added, proto = plan(preprocessor.tokenizer, tokens, int(embedding.embeddings.shape[0]))
    if added.appended and getattr(lm.backbone, "per_layer_token_embedding", None) is not None:
        raise UserError(
            f"this model also keys a per-layer embedding by token id, of {added.base_vocabulary} ids; a token "
            "beyond its vocabulary has no row there, and its tokenizer has too few <unusedN> pieces to rename"
        )
    preprocessor.tokenizer.set_proto(proto)
    base = np.asarray(ops.convert_to_numpy(ops.cast(embedding.embeddings, "float32")))
    start = np.stack([base[list(pieces)].mean(axis=0) for pieces in added.pieces]).astype("float32")
    install(embedding, added)
    embedding.added_token_rows.assign(start)
    embedding.added_token_start = start  # the base model's rows: what at_start swaps in
    return added


@contextlib.contextmanager
def at_start(backbone):
    """The new token rows as they started (add()) for a while, as the base model has them: what a DPO reference
    and GRPO's KL term score (builder.lora_off), in training and in a later `finetune eval` alike; the trained rows
    are put back after. Nothing where the model has no new tokens."""
    variable = rows(backbone)
    start = getattr(getattr(backbone, "token_embedding", None), "added_token_start", None)
    if variable is None or start is None:
        yield
        return
    trained = np.array(ops.convert_to_numpy(variable))
    variable.assign(start)
    try:
        yield
    finally:
        variable.assign(trained)


def token_embedding(backbone):
    """The backbone's tied token embedding, which the new rows join; a UserError where the model has none."""
    embedding = getattr(backbone, "token_embedding", None)
    if embedding is None or not getattr(embedding, "tie_weights", False):
        raise UserError(
            "--add-tokens needs a model whose token embedding is tied to its output (Gemma 1 to 4); this one "
            "keeps its embedding elsewhere (Gemma 3n's text model), which finetune does not extend yet"
        )
    return embedding


def install(embedding, added: Added) -> None:
    """The embedding's variable of new rows (zeros) and its call: new ids read their row, and the logits of a new
    id (reverse) are made from it."""
    width = int(embedding.embeddings.shape[-1])
    with keras_compat.adding_variables(embedding):
        embedding.added_token_rows = embedding.add_weight(
            name=ROWS, shape=(len(added.ids), width), initializer="zeros", dtype="float32", trainable=True
        )
    embedding.added_tokens = added
    embedding.trainable = True  # a frozen layer's variables train not at all; the base matrix stays frozen
    embedding.embeddings.trainable = False
    own = embedding.call
    slots = np.zeros((added.vocabulary,), "int32")
    slots[list(added.ids)] = np.arange(len(added.ids), dtype="int32")
    is_new = np.zeros((added.vocabulary,), bool)
    is_new[list(added.ids)] = True

    def call(inputs, reverse=False, **kwargs):
        if reverse:
            hidden = inputs if embedding.reverse_dtype is None else ops.cast(inputs, embedding.reverse_dtype)
            kernel = ops.convert_to_tensor(embedding.embeddings)
            if embedding.reverse_dtype is not None:
                kernel = ops.cast(kernel, embedding.reverse_dtype)
            logits = projection(embedding, kernel).logits(hidden, dtype=hidden.dtype)
            cap = embedding.logit_soft_cap
            return logits if cap is None else ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        ids = ops.cast(inputs, "int32")
        x = own(ops.minimum(ids, added.base_vocabulary - 1), **kwargs)  # an appended id has no row in the base
        new = ops.take(ops.cast(embedding.added_token_rows, x.dtype), ops.take(slots, ids), axis=0)
        return ops.where(ops.expand_dims(ops.take(is_new, ids), -1), new, x)

    keras_compat.replace_call(embedding, call)


def rows(backbone):
    """The backbone's variable of new rows, or None."""
    embedding = getattr(backbone, "token_embedding", None)
    return getattr(embedding, "added_token_rows", None)


def added_of(backbone) -> Added | None:
    embedding = getattr(backbone, "token_embedding", None)
    return getattr(embedding, "added_tokens", None)


def is_rows(variable) -> bool:
    """Whether `variable` is a model's new token rows (the optimizer's --embedding-lr group)."""
    return variable.path.endswith(ROWS)


def projection(embedding, kernel):
    """The output projection of an embedding with new rows: `kernel` (the base's, a tensor) with them; `kernel`
    itself where it has none."""
    added = getattr(embedding, "added_tokens", None)
    if added is None:
        return kernel
    return Projection(kernel, ops.convert_to_tensor(embedding.added_token_rows), added)


class Projection:
    """The logits' projection with new rows: the base's (V, D) kernel, and k rows that replace its rows at the
    new ids (or follow it, for ids past V). A low-rank change of the kernel, K + P^T (rows - K[ids]), P the new
    ids one-hot, so the base is never copied: logits = h K^T with the new ids' columns set to h rows^T.

    Args:
        base: tensor. The base kernel (V, D).
        rows: tensor. The new rows (k, D).
        added: Added. Where they go.
    """

    def __init__(self, base, rows, added: Added):
        self.base = base
        self.rows = rows
        self.added = added

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def shape(self):
        return (self.added.vocabulary, self.base.shape[-1])

    def __truediv__(self, value):
        """Both divided (GRPO's logits at a temperature)."""
        return Projection(self.base / ops.cast(value, self.base.dtype), self.rows / ops.cast(value, self.rows.dtype),
                          self.added)  # fmt: skip

    def _spots(self):
        return _spots(self.added.ids, self.added.vocabulary)

    def logits(self, hidden, dtype="float32"):
        """hidden (N, D) or (B, T, D) times the kernel with the new rows, in `dtype`."""
        logits = ops.cast(ops.matmul(hidden, ops.transpose(self.base)), dtype)
        if self.added.appended:
            widths = [[0, 0]] * (len(logits.shape) - 1) + [[0, self.added.appended]]
            logits = ops.pad(logits, widths)
        new = ops.cast(ops.matmul(hidden, ops.transpose(ops.cast(self.rows, hidden.dtype))), "float32")
        spots, is_new = self._spots()
        placed = ops.cast(ops.matmul(new, spots), dtype)  # each column holds one new id's logit, or 0
        return ops.where(is_new, placed, logits)

    def old_rows(self):
        """The base's rows at the new ids (zeros for appended ones), float32: what the new rows replace."""
        ids = np.asarray(self.added.ids)
        inside = np.minimum(ids, self.added.base_vocabulary - 1).astype("int32")
        kept = (ids < self.added.base_vocabulary).astype("float32")[:, None]
        return ops.cast(ops.take(self.base, inside, axis=0), "float32") * kept

    def times(self, delta, dtype):
        """delta (N, V') times the kernel with the new rows: the gradient of the hidden states, in `dtype`."""
        vocabulary = self.added.base_vocabulary
        grad = ops.matmul(ops.cast(delta[:, :vocabulary], dtype), self.base)
        change = ops.cast(ops.convert_to_tensor(self.rows), "float32") - self.old_rows()
        return ops.cast(grad + ops.cast(ops.matmul(self.columns(delta), change), dtype), dtype)

    def columns(self, delta):
        """delta's (N, k) columns of the new ids, float32."""
        return ops.cast(ops.take(delta, np.asarray(self.added.ids, "int32"), axis=1), "float32")


@functools.lru_cache(maxsize=8)
def _spots(ids: tuple, vocabulary: int):
    """(k, V') float32 one-hot of the new ids, and (V',) whether each column is a new id's: made once a run."""
    spots = np.zeros((len(ids), vocabulary), "float32")
    spots[np.arange(len(ids)), list(ids)] = 1.0
    return spots, spots.sum(axis=0) > 0


def merged_embedding(base: np.ndarray, added: Added, new_rows: np.ndarray) -> np.ndarray:
    """The embedding matrix with the new rows in place (and appended), as an export holds it, in base's dtype."""
    out = np.zeros((added.vocabulary, base.shape[1]), base.dtype)
    out[: base.shape[0]] = base
    out[list(added.ids)] = np.asarray(new_rows).astype(base.dtype)
    return out


def merged(lm, preprocessor, tokens, values, recorded: dict | None = None, where: str = "the run"):
    """`lm` (a plain base, LoRA merged or not) with the new `tokens` as plain weights, for an export: the tokenizer
    with them, their rows `values` in the embedding matrix; a backbone of the larger vocabulary where tokens were
    appended (the causal LM returned is then a new one around it, preprocessor detached)."""
    embedding = token_embedding(lm.backbone)
    added, proto = plan(preprocessor.tokenizer, tokens, int(embedding.embeddings.shape[0]))
    check_place(added, recorded, where)
    matrix = merged_embedding(np.asarray(embedding.embeddings.numpy()), added, values)
    preprocessor.tokenizer.set_proto(proto)
    if not added.appended:
        embedding.embeddings.assign(matrix)
        return lm
    backbone = resized(lm.backbone, added.vocabulary)
    backbone.token_embedding.embeddings.assign(matrix)
    return type(lm)(backbone=backbone, preprocessor=None)


def resized(backbone, vocabulary: int):
    """A copy of `backbone` with a vocabulary of `vocabulary` ids: its config so changed, every other weight
    copied; the embedding is left for the caller."""
    config = dict(backbone.get_config(), vocabulary_size=vocabulary)
    fresh = type(backbone).from_config(config)
    old, new = backbone.weights, fresh.weights
    if len(old) != len(new):
        raise UserError(f"cannot resize this model's vocabulary: its copy has {len(new)} weights, not {len(old)}")
    for before, after in zip(old, new, strict=True):
        if before is backbone.token_embedding.embeddings:
            continue
        if tuple(before.shape) != tuple(after.shape):
            raise UserError(f"cannot resize this model's vocabulary: {before.path} changed shape with it")
        after.assign(before.numpy())
    return fresh


def assign_rows(backbone, values) -> None:
    """The new rows from a finished run's file."""
    variable = rows(backbone)
    values = np.asarray(values, "float32")
    if variable is None or tuple(variable.shape) != values.shape:
        shape = None if variable is None else tuple(variable.shape)
        raise UserError(f"the run's new token rows are {values.shape}, this model's {shape}; retrain the run")
    variable.assign(values)


def check_place(added: Added, recorded: dict | None, where: str) -> None:
    """Refuse a tokenizer that places the tokens elsewhere than the run's adapter.json recorded."""
    if recorded is None:
        return
    if list(added.ids) != list(recorded.get("ids", [])) or added.vocabulary != recorded.get("vocabulary"):
        raise UserError(
            f"{where} placed its new tokens at ids {list(recorded.get('ids', []))}, this base's tokenizer at "
            f"{list(added.ids)}; use the base the run trained on"
        )
