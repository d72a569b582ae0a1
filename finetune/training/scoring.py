"""What a run is scored on: its held-out records (scored as its method says: Method.held_out_scores), generations
(greedy, or sampled by keras-hub's samplers) and ROUGE-L.
"""

from __future__ import annotations

import contextlib
import importlib.util

from finetune.data import audio, images, templates
from finetune.platform.errors import UserError
from finetune.training import loop


def eval_metrics(before: dict | None, after: dict | None, names=("perplexity", "accuracy")) -> dict:
    """metrics.json's held-out metrics: the loss and the method's `names` (Method.held_out), before training and
    of the published adapter; None where nothing was held out."""
    out = {}
    for name in ("loss", *names):
        out[f"eval_{name}_before"] = before.get(name) if before else None
        out[f"eval_{name}"] = after.get(name) if after else None
    return out


@contextlib.contextmanager
def preprocessor_attached(lm, preprocessor):
    """generate() takes strings, so it needs the preprocessor that fit() must not see."""
    lm.preprocessor = preprocessor
    try:
        yield lm
    finally:
        lm.preprocessor = None


def generate(lm, preprocessor, prompts, max_new_tokens: int, stop_tokens=("<eos>",), sampling=None):
    """Continuations of `prompts`, without the prompt text: greedy, or as `sampling` (config.Sampling) says.

    prompts: list of str, or images.generation_input()'s {"prompts", "images"} for prompts with pictures.
    """
    import keras_hub

    pictured = isinstance(prompts, dict)
    texts = prompts["prompts"] if pictured else prompts
    if not texts:
        return []
    if sampling is not None and not sampling.greedy:
        vocabulary = preprocessor.tokenizer.vocabulary_size()  # the logits' width, or fewer (new tokens appended)
        lm.compile(sampler=sampler(sampling, vocabulary))  # compile() is where keras-hub takes a sampler
    elif not isinstance(lm.sampler, keras_hub.samplers.GreedySampler):  # a GRPO run's rollouts compiled theirs in
        lm.compile(sampler="greedy")
    tokenizer = preprocessor.tokenizer
    counted = _written(prompts, preprocessor) if pictured else texts
    longest = max(len(tokenizer.tokenize(p)) for p in counted) + 1  # + <bos>
    stop_ids = templates.stop_ids(tokenizer, stop_tokens)
    # Under a distribution the prompts are split over the data axis, which must divide their count.
    from finetune.model import distribution

    replicas = distribution.data_replicas()
    extra = -len(texts) % replicas
    padded = {k: v + [v[-1]] * extra for k, v in prompts.items()} if pictured else texts + [texts[-1]] * extra
    with preprocessor_attached(lm, preprocessor), each_its_budget(preprocessor, max_new_tokens), \
            loop.StopSignals.deferred():  # fmt: skip
        outputs = lm.generate(padded, max_length=longest + max_new_tokens, stop_token_ids=stop_ids)
    loop.check_stop()  # a run's stop (loop.StopSignals) that came while generating
    if isinstance(outputs, str):
        outputs = [outputs]
    outputs = outputs[: len(texts)]
    stripped = images.stripped_tokens(preprocessor) if pictured else ()
    shown = [images.shown_text(p, stripped) for p in counted] if pictured else texts
    return [out[len(p) :] if out.startswith(p) else out for p, out in zip(shown, outputs)]


@contextlib.contextmanager
def each_its_budget(preprocessor, max_new_tokens: int):
    """Each row of keras-hub's generate ending `max_new_tokens` after its own prompt.

    keras-hub samples a batch up to one max_length (the longest prompt's end and the budget), from its shortest
    prompt's end, so a shorter prompt's row came back with more than `max_new_tokens` (50 tokens for 5 beside a
    long prompt): its text depended on which prompts shared its batch, and so did ROUGE-L. Each row's prompt
    length is read from generate_preprocess's padding mask (a picture's or clip's tokens counted, as the model
    reads them), and the mask cut there plus the budget before generate_postprocess makes text of the ids."""
    import numpy as np
    from keras import ops

    own_preprocess, own_postprocess = preprocessor.generate_preprocess, preprocessor.generate_postprocess
    ends = []

    def generate_preprocess(*args, **kwargs):
        x = own_preprocess(*args, **kwargs)
        ends.append(np.sum(ops.convert_to_numpy(x["padding_mask"]).astype(bool), axis=1) + max_new_tokens)
        return x

    def generate_postprocess(x):
        mask = ops.convert_to_numpy(x["padding_mask"]).astype(bool)
        end = ends.pop(0) if ends else None
        if end is not None and len(end) == len(mask):
            x = {**x, "padding_mask": mask & (np.arange(mask.shape[1])[None, :] < end[:, None])}
        return own_postprocess(x)

    # the instance's own attributes, which keras-hub's generate calls, and not keras' setattr (nothing to track)
    preprocessor.__dict__.update(generate_preprocess=generate_preprocess, generate_postprocess=generate_postprocess)
    try:
        yield
    finally:
        preprocessor.__dict__.pop("generate_preprocess", None)
        preprocessor.__dict__.pop("generate_postprocess", None)


def _written(prompts: dict, preprocessor) -> list[str]:
    """Prompts with pictures or a clip (images.generation_input(), audio.generation_input()) as the model reads
    them: each marker written out as its picture's or clip's tokens."""
    written = list(prompts["prompts"])
    if prompts.get("images") is not None:
        vision = images.vision_of(preprocessor)
        written = [images.written_prompt(p, vision) for p in written]
    hearing = audio.hearing_of(preprocessor)
    if hearing is not None and prompts.get(hearing.prompt_key) is not None:
        sounds = prompts[hearing.prompt_key]
        written = [audio.written_prompt(p, hearing, len(sound)) for p, sound in zip(written, sounds)]
    return written


def sampler(sampling, vocabulary: int):
    """keras-hub's sampler for `sampling` (config.Sampling, not greedy): top-p (with top-k, if given, first),
    top-k, or plain sampling at the temperature. A top-k past the `vocabulary` keeps every token, as transformers'
    does (the frameworks' top_k refuses a k larger than the logits)."""
    import keras_hub

    temperature = sampling.temperature or 1.0
    k = None if sampling.top_k is None else min(sampling.top_k, vocabulary)
    if sampling.top_p is not None:
        return keras_hub.samplers.TopPSampler(p=sampling.top_p, k=k, seed=sampling.seed, temperature=temperature)
    if k is not None:
        return keras_hub.samplers.TopKSampler(k=k, seed=sampling.seed, temperature=temperature)
    return keras_hub.samplers.RandomSampler(seed=sampling.seed, temperature=temperature)


def check_rouge() -> None:
    """Refuse ROUGE-L before any model is loaded when rouge-score is not installed."""
    if importlib.util.find_spec("rouge_score") is None:
        raise UserError(
            "--generate scores the answers with ROUGE-L, which needs the rouge-score package: "
            "pip install 'finetune[eval]'"
        )


def rouge_l(predictions: list[str], references: list[str]) -> float:
    """The mean ROUGE-L F-measure of `predictions` against `references`.

    Scored by Google's rouge-score, the scorer keras_hub.metrics.RougeL wraps: keras-hub's metric needs
    TensorFlow, which a JAX or PyTorch run leaves out of its process.
    """
    check_rouge()
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(reference, prediction)["rougeL"].fmeasure for prediction, reference in
              zip(predictions, references)]  # fmt: skip
    return sum(scores) / len(scores) if scores else 0.0


def sample_inputs(prompts: list[str], records, preprocessor):
    """What generate() is given for the sample prompts of `records`: the prompts, with the records' pictures or
    clips where they have any (images.generation_input, audio.generation_input)."""
    if any(r.images for r in records):
        return images.generation_input(prompts, [r.images for r in records], images.vision_of(preprocessor))
    if records and all(len(r.audios) == 1 for r in records):  # keras-hub's generate() takes a clip a prompt
        hearing = audio.hearing_of(preprocessor)
        return audio.generation_input(prompts, [r.audios[0] for r in records], hearing)
    return prompts


class HeldOut:
    """The records a run holds out: metrics over them, and generations on the first few's prompts (samples.md).

    Args:
        score: callable() -> dict. The held-out metrics as the model stands (the method's held_out_scores).
        records: int. The held-out records scored (prepared.held_out: records, pairs or prompts), as the log counts them.
        model: builder.Model. The run's model: its causal LM and preprocessor generate the samples.
        samples: list of data.Record. The held-out records to generate for; their responses are the references.
        template: templates.Template. Puts each sample's prompt in the run's format.
        max_new_tokens: int. The longest generation.
    """

    judge = None  # the method's sample_scores (a line under each generation), where it scores them

    def __init__(self, score, records: int, model, samples, template, max_new_tokens: int):
        self.score = score
        self.records = records
        self.lm = model.lm
        self.preprocessor = model.preprocessor
        self.samples = samples
        self.template = template
        self.prompts = [template.sample_prompt(r) for r in samples]
        self.inputs = sample_inputs(self.prompts, samples, self.preprocessor)
        """What generate() is given: the prompts, with their pictures where the samples have any."""
        self.stop_tokens = template.stop_tokens
        self.max_new_tokens = max_new_tokens

    def metrics(self) -> dict:
        """The held-out metrics (loss, accuracy and the method's own), as the model stands; a run's stop asked for
        meanwhile is taken once the compiled evaluation is done (loop.StopSignals)."""
        with loop.StopSignals.deferred():
            scores = self.score(after_batch=loop.check_stop)
        loop.check_stop()
        return scores

    def generate(self, when: str, phase=print) -> list[str]:
        """The samples' generations as the model stands; `when` (before, after) names the phase in the log."""
        if self.prompts:
            phase(f"generating {len(self.prompts)} samples {when} training")
        return generate(self.lm, self.preprocessor, self.inputs, self.max_new_tokens, self.stop_tokens)

    def sample_rows(self, before: list[str], after: list[str]) -> list[dict]:
        """samples.md's rows (outputs.write_samples). A sample with no generation before training (a run resumed
        with more --samples than it started with) has None there, and is kept with its generation after."""
        before = [*before, *[None] * (len(after) - len(before))]
        rows = [
            {"prompt": p, "reference": self.template.sample_reference(r), "before": b, "after": a}
            for p, r, b, a in zip(self.prompts, self.samples, before, after)
        ]
        if self.judge is not None and rows:
            for when in ("before", "after"):
                made = [row for row in rows if row[when] is not None]
                for row, scored in zip(made, self.judge([row[when] for row in made]) if made else []):
                    row[f"{when}_score"] = scored
        return rows
