"""A sequence classifier (--method classify): LoRA on the body and a score head of one output per class, trained
in full, on records with a `label`; `finetune predict` labels new records with a finished run.

The records are SFT's (text, or Dolly and the other formats as the run's template renders them), each with a
`label`, a string or a whole number. The run decides the classes from the training data's labels, sorted
(with_data), and config.yaml records them (train.labels), so evaluation and prediction map ids back to names.

Each record is one sequence: <bos> and its rendered text, cut to seq_len, whose one weighted slot is its last
input token, labelled with the class id (examples). So SFT's rows, packing and order carry it unchanged, and
model/classify_view.py reads the head at exactly the last token of each sequence, packed or not. Held out, a
run reports the mean cross-entropy, the accuracy and the macro F1 (the mean over the classes of each one's F1).
The head is the view's, so checkpoints keep it; a finished run writes it beside its adapter (HEAD).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from finetune.data import batching, templates
from finetune.methods import prepare, reward
from finetune.methods.supervised import Supervised
from finetune.platform.errors import UserError

HEAD = "classify_head.npz"
"""The head's weights, beside the adapter in a finished run's directory: `kernel`, (hidden, classes) float32."""


class Classify(Supervised):
    name = "classify"
    title = "classifier"
    why = "set"
    held_out = ("accuracy", "macro_f1")
    held_out_history = ("macro_f1",)
    generates = False
    labelled = True
    prompt_loss = False  # a score of the whole record
    files = (HEAD,)
    head = HEAD
    uses = "label records with `finetune predict`"

    def head_labels(self, train) -> list[str]:
        return list(train.labels)

    def decide(self, train) -> dict:
        return {"method": (self.name, self.why), "labels": (list(train.labels), "the training data's, sorted")}

    def with_data(self, cfg, records: list, eval_records: list | None = None):
        """`cfg` with its classes decided from the training records' labels (sorted), or checked against the
        --labels given; refuses a record without a label, fewer than two classes, and an --eval-data label the
        training data lacks."""
        found = sorted({label_of(r, cfg.data.path) for r in records}, key=_order)
        given = list(cfg.train.labels)
        if given:
            missing = next((r for r in records if label_of(r, cfg.data.path) not in given), None)
            if missing is not None:
                raise UserError(f"{missing.where or cfg.data.path}: label {label_of(missing, cfg.data.path)!r} is not "
                                f"one of --labels ({', '.join(given)}); add it to --labels or leave --labels out")  # fmt: skip
        labels = given or found
        if len(labels) < 2:
            raise UserError(f"{cfg.data.path} has {len(labels)} class ({', '.join(labels) or 'none'}); a classifier "
                            "needs records of at least 2 labels")  # fmt: skip
        for record in eval_records or ():
            label = label_of(record, cfg.eval.data)
            if label not in labels:
                where = record.where or cfg.eval.data
                raise UserError(f"{where}: label {label!r} is not one the training data has ({', '.join(labels)}); "
                                "evaluate on the training data's classes")  # fmt: skip
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, labels=labels))

    def objective(self, train):
        from finetune.model import classify_view  # keras: imported once the backend is chosen

        return classify_view.Objective(max(len(train.labels), 2), getattr(train, "seed", 0))

    # === Prepare ===

    def usable_examples(self, records, template, preprocessor, cfg, source: str) -> list:
        """(record, Example) of each record: <bos> and its rendered text, its last input token labelled with its
        class id (weight 1, the example's only one); a record whose label is no class of the run is refused."""
        labels = cfg.train.labels or self.with_data(cfg, records).train.labels  # a caller that decided none (bench)
        ids = {name: index for index, name in enumerate(labels)}
        return [
            (record, example) for record, example, _ in sequences(records, template, preprocessor, cfg, source, ids)
        ]

    # === Score ===

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        batches = batching.Batches(rows, batch_size, feed)
        return lambda after_batch=None: class_metrics(model.trainer, batches, after_batch)

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        view = self.view(lm, cfg, directory)
        return class_metrics(view, batching.Batches(rows, cfg.train.batch_size, batching.Feed(inputs=_inputs(lm))))

    def view(self, lm, cfg, directory):
        """A finished run's view: `lm` (its adapter loaded) and its head, read from `directory`."""
        from finetune.model import builder

        view = builder.objective_view(lm, self.objective(cfg.train))
        reward.load_head(view.head, Path(directory) / HEAD)
        return view

    def predict(self, lm, preprocessor, cfg, records, directory) -> list[dict]:
        """Each record's predicted label and the probability of every class, by the finished run in `directory`."""
        template = templates.get(cfg.data.template)
        made = sequences(records, template, preprocessor, cfg, "the data", None)
        rows = batching.pad([example for _, example, _ in made], cfg.model.seq_len)
        view = self.view(lm, cfg, directory)
        batches = batching.Batches(rows, cfg.train.batch_size, batching.Feed(inputs=_inputs(lm)))
        probabilities = _softmax(np.concatenate([logits for logits, _ in outputs(view, batches)]))
        labels = cfg.train.labels
        out = []
        for (_, _, given), p in zip(made, probabilities):
            line = {"predicted": labels[int(np.argmax(p))], "probabilities": dict(zip(labels, map(float, p)))}
            out.append({**line, **({"label": given} if given is not None else {})})
        return out

    def run_metrics(self, train, rows: list) -> dict:
        return {"method": self.name, "labels": list(train.labels)}

    def published(self, trainer) -> dict:
        return {HEAD: lambda path: reward.save_head(trainer.head, path)}

    # === Plan ===

    def plan_note(self, cfg, packed: bool = False) -> str | None:
        return (
            "--method classify: each record is one sequence, scored at its last token by a head of one output a "
            "class: no vocabulary projection"
        )


def _order(label: str):
    """Labels sort as numbers where they are whole numbers, else as text."""
    whole = re.fullmatch(r"-?[0-9]+", label)  # ASCII digits: str.isdigit() takes '²', which int() refuses
    return (0, int(label), "") if whole else (1, 0, label)


def label_of(record, source: str) -> str:
    """A record's label as text; refused where it has none, or one that is neither text nor a whole number."""
    where = record.where or source
    if "label" not in record.columns or record.columns["label"] in (None, ""):
        raise UserError(f"{where}: a record without a `label`; a classifier trains on records that each have one "
                        "(a string or a whole number)")  # fmt: skip
    label = record.columns["label"]
    text = label_text(label)
    if text is None:
        raise UserError(f"{where}: label {label!r} is neither text nor a whole number; give each record's class as "
                        "one of those")  # fmt: skip
    return text


def label_text(value) -> str | None:
    """A label as the run names its class: text as it is, a whole number as its digits (1.0 as 1: pandas writes an
    integer column with a gap as floats); None for anything else (true/false, 1.5, NaN, a list)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return None
    return str(value)


def sequences(records, template, preprocessor, cfg, source: str, ids: dict | None) -> list:
    """(record, Example, its label or None) of each record. ids: label -> class id, each record's label required
    and checked; None: labels are read where present, and the example's class slot holds 0 (`finetune predict`)."""
    tokenizer = prepare.tokenizer_of(preprocessor)
    batching.check_layout(tokenizer)
    seq_len = cfg.model.seq_len
    media = prepare.Media.of(records, preprocessor, cfg.model.preset, source)  # pictures and clips, as SFT's
    texts = ["".join(template.apply(r)) for r in records]
    if media is not None:
        texts = [media.expanded(text, record) for text, record in zip(texts, records)]
    pieces = batching.leading_ids(tokenizer, texts, seq_len)
    out, cut, skipped = [], 0, 0
    for record, piece in zip(records, pieces):
        if media is not None and (record.images or record.audios) and len(piece) > seq_len - 1:
            if ids is None:  # finetune predict writes a line for each record, in order: none is left out
                raise UserError(f"{record.where or source}: with its pictures or audio, the record is longer than the "
                                f"run's --seq-len {seq_len}, and cutting it could cut their tokens; shorten it")  # fmt: skip
            skipped += 1  # cut from its end, it could lose some of its image or audio tokens
            continue
        given = label_of(record, source) if ids is not None or record.columns.get("label") is not None else None
        if ids is not None and given not in ids:
            raise UserError(f"{record.where or source}: label {given!r} is not one of the run's classes "
                            f"({', '.join(ids)})")  # fmt: skip
        cut += len(piece) > seq_len - 1
        tokens = [batching.BOS] + piece[: seq_len - 1]
        # The last id is no input (inputs are ids[:-1]): it is the last token's label, the class id.
        example = batching.Example(tokens + [ids[given] if ids is not None else 0], [0.0] * len(tokens) + [1.0])
        out.append((record, media.attached(example, record) if media is not None else example, given))
    if cut:
        print(f"note: {cut} of {len(records)} records cut to --seq-len {seq_len}: their text from its end")
    if skipped:
        if not out:
            raise UserError(f"no usable records in {source}: with their pictures or audio, all are longer than "
                            f"--seq-len {seq_len}; raise it")  # fmt: skip
        print(f"note: {skipped} records with pictures or audio skipped: longer than --seq-len {seq_len}, and cutting "
              "them could cut their image or audio tokens")  # fmt: skip
    return out


def _inputs(lm):
    from finetune.model import builder

    return builder.input_names(lm)


def outputs(view, batches):
    """(logits, labels) of the weighted slots of each of `batches`: each real sequence's, in row order."""
    from keras import ops

    for index in range(len(batches)):
        x, y, w = batches[index]
        logits = np.asarray(ops.convert_to_numpy(view.logits(x, training=False)), np.float64)
        weighted = np.asarray(w["loss"]).reshape(-1) > 0
        yield logits[weighted], np.asarray(y["loss"]).reshape(-1)[weighted]


def _softmax(logits):
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def class_metrics(view, batches, after_batch=None) -> dict:
    """The held-out sequences' mean cross-entropy, accuracy and macro F1."""
    logits, labels = [], []
    for part, label in outputs(view, batches):
        logits.append(part)
        labels.append(label)
        if after_batch is not None:  # a run's stop check (loop.check_stop)
            after_batch()
    logits, labels = np.concatenate(logits), np.concatenate(labels).astype(int)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    loss = np.log(np.exp(shifted).sum(-1)) - shifted[np.arange(len(labels)), labels]
    predicted = logits.argmax(-1)
    return {"loss": float(loss.mean()), "accuracy": float((predicted == labels).mean()),
            "macro_f1": macro_f1(labels, predicted)}  # fmt: skip


def macro_f1(labels, predicted) -> float:
    """The mean of each class's F1 (2 TP / (2 TP + FP + FN)) over the classes labelled or predicted, as sklearn's
    f1_score(average="macro", zero_division=0) and Hugging Face evaluate's f1 give it: a class the held-out records
    neither hold nor get is left out, not counted as an F1 of 0."""
    scores = []
    for c in np.union1d(labels, predicted):
        hit = int(np.sum((predicted == c) & (labels == c)))
        wrong = int(np.sum(predicted == c)) + int(np.sum(labels == c)) - 2 * hit
        scores.append(2 * hit / (2 * hit + wrong) if hit + wrong else 0.0)
    return float(np.mean(scores))


CLASSIFY = Classify()
