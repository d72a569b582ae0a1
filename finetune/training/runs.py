"""Reopen a finished run: base model plus saved adapter (or a --full run's trained weights, full_model.py), for
eval, generate, load and export.

The run's config.yaml says which preset, template and LoRA layout were used;
the adapter file holds only the LoRA factors (backbone.save_lora_weights), so
the base weights come from the same preset as in training. adapter.json must
agree with both before a factor is loaded (adapter.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune import config as config_module
from finetune.platform import documents, storage
from finetune.platform.errors import UserError
from finetune.training import adapter, full_model, outputs


@dataclass
class Run:
    directory: Path
    config: config_module.Config
    adapter: dict
    """adapter.json, already checked against config.yaml; a --full run's model.json (full_model.py)."""
    url: str = ""
    """Where a run on Cloud Storage was read from (`directory` is then the local copy of its files)."""

    @property
    def shown(self) -> str:
        """Where messages say the run is: its URL, else its directory as given."""
        return self.url or str(self.directory)

    @property
    def origin(self) -> str:
        """The run as its user names it: its URL, else its directory's full path."""
        return self.url or str(self.directory.resolve())

    @property
    def name(self) -> str:
        """The run directory's own name (the URL's last part for a run on Cloud Storage)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1] if self.url else self.directory.resolve().name

    @property
    def full(self) -> bool:
        """The run trained every weight (--full): it holds the whole model, not an adapter."""
        return self.config.model.full


def open_run(directory: str | Path) -> Run:
    """Read a run directory's config; pure Python, so it can run before the backend is chosen. A run on Cloud
    Storage (gs://, any fsspec URL) is read from a local copy of its files (storage.fetched)."""
    url = ""
    if storage.is_remote(str(directory)):
        url = str(directory).rstrip("/")
        directory = storage.fetched(url, outputs.OWN_NAMES)
        for name in (outputs.CONFIG, outputs.METRICS):  # no lock there: metrics.json, written last, says finished
            if not (directory / name).is_file():
                raise UserError(f"{url} has no {name}, so it is not a finished run (or it is being written); pass "
                                "--run of a finished run")  # fmt: skip
        print(f"read {url} (its files copied to {directory})", file=sys.stderr)
    directory = Path(directory)
    shown = url or directory  # where messages say the run is
    if not directory.is_dir():
        what = "is a file, not a run directory" if directory.exists() else "does not exist"
        raise UserError(f"run directory {directory} {what}; pass --run DIR of a run made by finetune gemma")
    if not (directory / outputs.CONFIG).is_file():
        raise UserError(
            f"{directory} has no {outputs.CONFIG}, so it is not a finished run; pass --run DIR of a finished run"
        )
    if not (directory / outputs.METRICS).is_file():  # written last: without it the files may be of two runs
        raise UserError(f"{directory} has no {outputs.METRICS}, so it is not a finished run (it stopped or is being "
                        f"written); finish it with `finetune gemma --resume --output {directory}`")  # fmt: skip
    try:
        cfg = config_module.from_dict(config_module.read_recipe(directory / outputs.CONFIG))
    except UserError as e:  # a key or value no run writes: the file was changed, or another version wrote it
        first = str(e).split("; known keys:")[0]
        raise UserError(f"{shown}/{outputs.CONFIG} does not hold a run's settings ({first}): it was edited or "
                        "damaged, or a newer finetune wrote it; restore it, or train the run again") from None  # fmt: skip
    trained, described = (
        (outputs.WEIGHTS, outputs.WEIGHTS_JSON) if cfg.model.full else (outputs.ADAPTER, outputs.ADAPTER_JSON)
    )
    if not (directory / trained).is_file():
        raise UserError(f"{shown} has no {trained}, so it is not a finished run; pass --run DIR of a finished run")
    try:
        if cfg.model.full:
            description = full_model.read(directory / described)
            full_model.check_against_config(description, cfg, directory / described)
        else:
            description = adapter.read(directory / described)
            adapter.check_against_config(description, cfg, directory / described)
    except UserError as e:
        if url:  # the local copy's path, said as the bucket's
            raise UserError(str(e).replace(str(directory), url)) from None
        raise
    return Run(directory, cfg, description, url)


def check_writes_text(run: Run, what: str, fmt: str = "") -> None:
    """Refuse `finetune what` (generate, export, publish) of a run whose model scores text and writes none (a
    reward model, a classifier), but its export in a format that holds its score head: transformers'
    ...ForSequenceClassification (hf), or the adapter and the head's file (lora)."""
    from finetune.methods import registry

    method = registry.get(run.config.train.method)
    if method.generates or (what == "export" and fmt in SCORING_FORMATS and method.head):
        return
    held = (
        f"`finetune export --format {' or '.join(SCORING_FORMATS)}` holds its head, so `finetune {what}"
        f"{' --format ' + fmt if fmt else ''}` is refused"
        if method.head
        else f"`finetune {what}` is refused"
    )
    raise UserError(f"{run.shown} is a {method.title} run: it scores text and writes none; {held}. Score with "
                    f"`finetune eval`, or {method.uses}")  # fmt: skip


SCORING_FORMATS = ("hf", "lora")
"""The export formats that hold a scoring run's head (check_writes_text)."""


def where(run: Run) -> str:
    """Where `run` was just loaded, as the console says it: `jax: cpu (AMD EPYC, 2 cores), float32`."""
    from finetune.model import families, presets
    from finetune.platform import backend

    device = backend.accelerator()
    precision = run.config.model.precision
    if precision == "auto":  # as load_model decides it
        overflows = families.get(presets.family_of(run.config.model.preset)).float16_overflows
        precision = backend.auto_precision(device, overflows)
    return f"{sys.modules['keras'].config.backend()}: {backend.device_name(device)}, {precision}"


def select_backend(run: Run, chosen: str | None = None) -> str:
    """The backend to use a run on: `chosen`, else the one keras is already loaded with, else the run's.

    An adapter is plain LoRA factors: one trained on any backend loads on the others.
    """
    from finetune.model import presets
    from finetune.platform import backend

    if chosen is None:
        chosen = sys.modules["keras"].config.backend() if "keras" in sys.modules else run.config.backend
    if chosen not in config_module.BACKENDS:
        raise UserError(f"unknown backend {chosen!r}; choose one of {', '.join(config_module.BACKENDS)}")
    backend.select(chosen, run.config.train.xla_mem_fraction, presets.frameworks_needed(run.config.model.preset))
    return chosen


def open_on(directory: str | Path, chosen: str | None = None) -> Run:
    """open_run, then select_backend: a run ready to be loaded, evaluated or exported."""
    run = open_run(directory)
    select_backend(run, chosen)
    return run


def load_model(run: Run):
    """(causal LM with the run's adapter, preprocessor), on the backend keras is loaded with (select_backend)."""
    from finetune.model import builder, tokens
    from finetune.training import resolve

    resolved = resolve.finished(run.config)
    model = builder.build_model(resolved.source, resolved.recipe(train=False))
    if run.full:
        if resolved.method.scores_base(run.config.train):  # `finetune eval` of a DPO run scores its reference
            builder.keep_base(model.lm)
        full_model.load(model.lm.backbone, run.directory, run.adapter)
    else:
        # Checked before anything is assigned (keras-hub's load_lora_weights checks nothing), then assigned whole:
        # DoRA's magnitudes and the experts' factors too, which keras-hub's loader leaves out.
        adapter.assign(model.lm.backbone, checked_factors(run, model.lm.backbone))
    if model.added is not None:  # --add-tokens: the tokenizer placed them where the run did, and their rows
        tokens.check_place(model.added, run.adapter.get("added_tokens"), str(run.directory / described_in(run)))
        tokens.assign_rows(model.lm.backbone, token_rows(run))
    return model.lm, model.preprocessor


def described_in(run: Run) -> str:
    """The file that describes what the run trained: adapter.json, or a --full run's model.json."""
    return outputs.WEIGHTS_JSON if run.full else outputs.ADAPTER_JSON


def token_rows(run: Run):
    """The new tokens' rows of a run trained with --add-tokens (outputs.TOKEN_ROWS, checked)."""
    if "added_tokens" not in run.adapter:
        described = described_in(run)
        raise UserError(f"{run.shown}/{described} names no added tokens, config.yaml does; "
                        f"copy {described} back from the run")  # fmt: skip
    return adapter.read_token_rows(run.directory / outputs.TOKEN_ROWS, run.adapter)


def checked_factors(run: Run, backbone) -> dict:
    """{layer index: (A, B)}, or (A, B, magnitude) under DoRA, or an expert bank's six, of the run's adapter, once adapter.json fits
    `backbone` (the run's base, with or without LoRA) and adapter.lora.h5 holds what adapter.json describes."""
    json_path = run.directory / outputs.ADAPTER_JSON
    adapted = adapter.check_against_base(run.adapter, backbone, run.config.lora.rank, json_path)
    return adapter.read_factors(run.directory / outputs.ADAPTER, adapted, run.config.lora.rank, run.adapter)


def evaluate_run(run: Run, data_path: str | None = None, generate: int = 0) -> dict:
    """Held-out metrics of the adapted model, on the run's held-out records (its split of --data, or its
    --eval-data) or on all of `data_path`.

    generate: int. Also answer the first this many of those records' prompts, greedily, and score the answers
        against their responses with ROUGE-L (`rougeL`).
    """
    from finetune.methods import prepare, registry
    from finetune.training import scoring

    cfg = run.config
    if data_path is None and cfg.eval.data is None and cfg.data.eval_fraction == 0:
        raise UserError(
            f"{run.shown} held no records out (--eval-fraction 0), so it has none of its own to evaluate; "
            "pass --data FILE to evaluate on a file"
        )
    method = registry.get(cfg.train.method)
    if generate:
        check_writes_text(run, "eval --generate")  # a classifier or reward model writes no answers to score
        if method.prompted:
            raise UserError(f"{run.shown} is a {method.title} run: its prompts have no reference answers for "
                            "--generate to score against; its held-out reward is `finetune eval`'s score")  # fmt: skip
        scoring.check_rouge()
    path = data_path or cfg.eval.data or cfg.data.path
    try:
        records, found = prepare.read(cfg, path, trained=True)
    except UserError as e:
        if data_path is not None:
            raise
        raise UserError(f"{e}\n{run.shown} held its records out of {path}; pass --data FILE to evaluate on a file "
                        "of your own") from None  # fmt: skip
    if data_path is None:
        _check_held_out_source(run, path, records)
    _check_kind(method, found, path)
    lm, preprocessor = load_model(run)
    # The records training held out, prepared as training prepared them; or every record of another file.
    other_file = path if (data_path is not None or cfg.eval.data is not None) else None
    prepared = method.prepare(records, preprocessor, cfg, every_record_of=other_file)
    result = method.evaluate(lm, cfg, prepared.held_out_rows, run.directory)
    result["examples"] = len(prepared.held_out)
    if generate:
        result.update(_rouge(lm, preprocessor, prepared, generate, cfg.train.max_new_tokens))
    return result


def _check_held_out_source(run: Run, path: str, records) -> None:
    """Refuse to score a run's held-out records from a file that changed since the run read it: its split would
    not be the records the run held out, and may hold records it trained on (a resume refuses the same)."""
    from finetune.data import formats

    key = "eval_data_fingerprint" if run.config.eval.data else "data_fingerprint"
    recorded = (outputs.read_metrics(run.directory) or {}).get(key)
    if recorded and formats.fingerprint(records) != recorded:  # a run from before metrics.json kept it: unchecked
        split = "" if run.config.eval.data else (" its held-out split of them would not be the records it held "
                                                 "out, and may hold some it trained on;")  # fmt: skip
        raise UserError(f"the records in {path} differ from those {run.shown} held out when it trained;{split} pass "
                        "--data FILE to evaluate on a file of your own")  # fmt: skip


def predict_run(run: Run, data_path: str, output: str | Path, overwrite: bool = False) -> int:
    """Write what the run makes of each record of `data_path` (a classifier: its predicted label and every
    class's probability) to `output`, one JSON line a record, in their order; returns how many.

    The output is written whole or not at all (a temporary file renamed into place), never over the data or a file
    of the run, and over another file only with `overwrite`.
    """
    import json

    from finetune.methods import prepare, registry

    output = Path(output).expanduser()
    if output.exists() and output.resolve() == Path(data_path).expanduser().resolve():
        raise UserError(f"--output {output} is the --data file; give another path, the data is never overwritten")
    if output.resolve().is_relative_to(Path(run.directory).resolve()):
        raise UserError(f"--output {output} is in the run's directory, whose files it would replace; give a path "
                        "outside it")  # fmt: skip
    if output.is_dir() or not output.parent.is_dir():
        raise UserError(f"--output {output} is a directory or in none that exists; give a file path in one")
    if output.exists() and not overwrite:
        raise UserError(f"--output {output} exists; pass --overwrite to replace it, or give a new path")
    temporary = output.with_name(f".{output.name}.partial")
    _writable(temporary)  # before the model loads
    method = registry.get(run.config.train.method)
    # Every record, one line each in order: the run's own filters (--max-records, --category) chose its data.
    records, found = prepare.read(run.config, data_path, trained=True, filtered=False)
    _check_kind(method, found, data_path)
    if not method.labelled:  # before the model loads
        method.predict(None, None, run.config, records, run.directory)
    lm, preprocessor = load_model(run)
    lines = method.predict(lm, preprocessor, run.config, records, run.directory)
    try:
        temporary.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        temporary.replace(output)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise UserError(f"could not write --output {output}: {e.strerror or e}") from None
    return len(lines)


def _check_kind(method, data_format: str, path: str) -> None:
    """Refuse records of another kind than the run's method takes (formats.kind), as its training did: a DPO run
    scored on Dolly records scored an empty rejected answer."""
    from finetune.data import formats

    if formats.kind(data_format) != method.takes:
        raise UserError(f"{path} holds {formats.kind(data_format)} ({data_format}); the run is {method.name}, "
                        f"which takes {method.takes}, as it trained on: give a file of those")  # fmt: skip


def _writable(path: Path) -> None:
    """A UserError where `path` cannot be written (a read-only or special file system), the file left as it was."""
    try:
        with open(path, "x", encoding="utf-8"):
            pass
    except FileExistsError:
        return  # a partial file of an earlier try: it is replaced
    except OSError as e:
        raise UserError(f"cannot write {path.parent}: {e.strerror or e}; give --output a path you can write") from None
    path.unlink(missing_ok=True)


def _rouge(lm, preprocessor, prepared, count: int, max_new_tokens: int) -> dict:
    """rougeL of greedy answers to the first `count` held-out prompts, against their responses."""
    from finetune.training import scoring

    held_out = [record for record, _ in prepared.held_out[:count]]
    template = prepared.template
    prompts = scoring.sample_inputs([template.sample_prompt(r) for r in held_out], held_out, preprocessor)
    answers = scoring.generate(lm, preprocessor, prompts, max_new_tokens, template.stop_tokens)
    return {
        "rougeL": scoring.rouge_l(answers, [template.sample_reference(r) for r in held_out]),
        "generated": len(held_out),
    }


@dataclass(frozen=True)
class Given:
    """What goes with every prompt of generate() beside its text."""

    pictures: tuple = ()
    """Image paths, where the prompt's `<image>` placeholders are (before its text where it has none)."""
    clip: str | None = None
    """An audio file, where the prompt's `<audio>` placeholder is (else before its text)."""
    system: str | None = None
    """A system prompt, before each prompt as the run's chat template puts a conversation's first message."""
    tools: object = None
    """Tool schemas the model may call (formats.read_tools: a JSON file's path, or the schemas), declared as the
    run's chat template declares a tool-chat record's."""
    think: bool = False
    """The template's thinking switch on (Gemma 4's <|think|> in the system turn), as a record with thinking
    (`reasoning_content`) renders it: how a run trained on such records was asked."""


def generate(run: Run, prompts: list[str], max_new_tokens: int | None = None, raw: bool = False, sampling=None,
             given: Given = Given()):  # fmt: skip
    """Completions, greedy unless `sampling` (config.Sampling) asks to sample; each prompt is put in the run's
    template unless `raw`; with `given`'s pictures or clip, system prompt and tools."""
    pictures, clip = given.pictures, given.clip
    from finetune.data import audio, images, templates
    from finetune.data.formats import Record
    from finetune.methods import prepare
    from finetune.training import scoring

    check_writes_text(run, "generate")
    if max_new_tokens is not None:  # the CLI checks it first; the Python API's caller here
        config_module.check("train.max_new_tokens", max_new_tokens, name="--max-new-tokens")
    cfg = run.config
    template = templates.get(cfg.data.template)
    framed = _framing(given, template, raw)  # before the files are read: a refusal of the flags comes first
    pictures = [images.check(Path(p).expanduser(), "--image", "") for p in pictures]
    for placeholder, given, flag in ((images.PLACEHOLDER, pictures, "--image"), (audio.PLACEHOLDER, clip, "--audio")):
        if not given and any(placeholder in p for p in prompts):  # it would be read as text, the marker's pieces
            raise UserError(f"the prompt has {placeholder}, where a picture or clip goes, and no {flag} gives it: "
                            f"pass {flag} FILE, or leave {placeholder} out")  # fmt: skip
    if pictures:
        prompts = [images.with_placeholders(p, len(pictures)) for p in prompts]
    if clip is not None:
        if pictures:
            raise UserError("--image and --audio together: give one of them")
        clip = str(audio.check(Path(clip).expanduser(), "--audio", ""))
        prompts = [audio.with_placeholder(p) for p in prompts]
    if not raw:
        prompts = [template.apply(framed(p))[0] for p in prompts]
    lm, preprocessor = load_model(run)
    if pictures:
        vision = images.vision_of(preprocessor)
        if vision is None:
            raise prepare.no_vision_encoder(cfg.model.preset, "--image")
        images.limit([Record("", "", images=tuple(pictures))], vision, "--image")
        prompts = images.generation_input(prompts, [pictures] * len(prompts), vision)
    if clip is not None:
        hearing = audio.hearing_of(preprocessor)
        if hearing is None:
            raise prepare.no_audio_encoder(cfg.model.preset, "--audio")
        audio.limit([Record("", "", audios=(clip,))], hearing, "--audio")
        prompts = audio.generation_input(prompts, [clip] * len(prompts), hearing)
    tokens = cfg.train.max_new_tokens if max_new_tokens is None else max_new_tokens
    return scoring.generate(lm, preprocessor, prompts, tokens, template.stop_tokens, sampling)


def _framing(given: Given, template, raw: bool):
    """prompt -> the Record the run's template renders for it, with `given`'s system prompt and tools; refuses
    them where the template has no place for them (they would be dropped, or read as the prompt's own words)."""
    from finetune.data import formats, templates

    asked = {"system prompt": given.system, "tool declarations": given.tools, "thinking switch": given.think or None}
    asked = [words for words, value in asked.items() if value is not None]
    if asked and raw:
        raise UserError(f"--raw sends the prompt as is; put the {' and '.join(asked)} in its text, or drop --raw")
    if given.system is not None and template.name not in templates.CHAT:
        raise UserError(f"--system needs a chat template, and the run's is {template.name}; put the instructions in "
                        "the prompt")  # fmt: skip
    if given.system is not None and not given.system.strip():
        raise UserError("--system is empty; give the system prompt's text, or leave it out")
    tools = formats.read_tools(given.tools) if given.tools is not None else ()
    if tools and not template.tools:
        raise UserError(f"--tools needs a template that declares tools (gemma4-chat), and the run's is "
                        f"{template.name}: it trained without tool turns")  # fmt: skip
    if given.think and not template.tools:
        raise UserError(f"--think turns on a template's thinking switch (gemma4-chat's), and the run's template is "
                        f"{template.name}, which has none")  # fmt: skip
    system = ({"role": "system", "content": given.system},) if given.system is not None else ()
    # the answer's thinking turns the switch on, as a record's does (templates.Template.apply)
    answer = {"role": "assistant", "content": "-", **({"reasoning_content": "-"} if given.think else {})}

    def framed(prompt: str):
        if not system and not tools and not given.think:
            return formats.Record(instruction=prompt, response="-")
        messages = (*system, {"role": "user", "content": prompt}, answer)
        return formats.Record(instruction=prompt, response="-", messages=messages, tools=tools)

    return framed


def list_runs(directory: str | Path) -> list[dict]:
    """A row per run in `directory` (or for `directory` itself): its path, state, step and eval loss. A directory
    on Cloud Storage (gs://, any fsspec URL) is read through local stand-ins of its runs (storage.listed)."""
    if storage.is_remote(str(directory)):
        return _remote_rows(str(directory))
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory; pass a run directory or a directory of runs")
    try:
        candidates = [directory] + sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot list {directory} ({e.strerror or e}); check its permissions") from None
    return [row for row in map(_described, candidates) if row is not None]


def _remote_rows(url: str) -> list[dict]:
    """list_runs of a directory on Cloud Storage. A run there holds no lock (a job elsewhere writes it): one whose
    status says running is listed as running, its note saying that its job's own state tells whether it still is."""
    from finetune.training import checkpoint

    rows = []
    with storage.listed(url, (outputs.STATUS, outputs.METRICS, outputs.MARKER), checkpoint.DIRECTORY,
                        checkpoint.MANIFEST) as found:  # fmt: skip
        for remote, local in found:
            row = _described(local)
            if row is None:
                continue
            row["run"] = remote
            if row["state"] in ("checkpointed", "failed") and _status_of(local) == "running":
                last = f"; last checkpoint step {row['step']}" if row["state"] == "checkpointed" else ""
                row["state"], row["note"] = "running", f"or ended without a word: its job's state says which{last}"
            rows.append(row)
    return rows


def _status_of(directory: Path) -> str | None:
    try:
        return (outputs.checked_status(directory) or {}).get("state")
    except documents.DocumentError:
        return None


def _described(path: Path) -> dict | None:
    """describe(path); a directory that cannot be read is listed as broken, not the end of the listing."""
    try:
        return describe(path)
    except OSError as e:
        return {"run": str(path), "state": f"broken: cannot be read ({e.strerror or e})", "step": "",
                "eval_loss": "", "note": ""}  # fmt: skip


def describe(path: Path) -> dict | None:
    """What state the run in `path` is in; None if `path` holds no run.

    A run whose status.json, metrics.json or finetune-run.json is not what a run writes (edited by hand, cut
    short by a full disk) is listed as broken, naming the file and the field, beside the others.
    """
    from finetune.training import checkpoint

    listed = checkpoint.find(path)
    if not (listed or any((path / name).exists() for name in (outputs.STATUS, outputs.METRICS))):
        return None  # a claim alone (finetune-run.json) is not a run yet
    # The checkpoint --resume would load: the newest whole one, checksums read, as resume reads them.
    whole = checkpoint.latest(path) if listed else None
    found = [whole] if whole is not None else []
    damaged = ""
    if whole is None and (listed or checkpoint.problems(path)):
        damaged = "no checkpoint can be loaded (damaged): --resume cannot continue it; --overwrite starts again"
    elif whole is not None and whole.step != listed[-1].step:
        damaged = "a later checkpoint is damaged"
    row = {"run": str(path), "state": "", "step": found[-1].step if found else "", "eval_loss": "", "note": ""}
    if outputs.is_locked(path):
        row["state"] = "running"
        return row
    try:
        outputs.checked_marker(path)
        status = outputs.checked_status(path) or {}
        metrics = outputs.checked_metrics(path)
    except documents.DocumentError as e:
        row["state"] = f"broken: {e.what}"
        row["note"] = f"last checkpoint step {found[-1].step}" if found else ""
        return row
    if metrics is not None:
        loss = metrics.get("eval_loss")  # None: the run held nothing out
        row.update(state="finished", step=metrics["steps"], eval_loss="" if loss is None else f"{loss:.4f}")
        row["note"] = guard_note(metrics)
        later = status.get("state")
        if later in ("running", "failed", "stopped"):  # a run started over it (--overwrite) that did not finish
            how = "was killed or lost" if later == "running" else later
            row["note"] = "; ".join(filter(None, [row["note"], f"a run over it (--overwrite) {how}" + (
                f" at checkpoint step {found[-1].step}, which --resume continues" if found else "")]))  # fmt: skip
        return row
    if not found:
        row["step"] = status.get("step", "")
    if status.get("state") in ("failed", "stopped"):
        row["state"] = status["state"]
        row["note"] = short_note(str(status.get("message") or ""))
    elif found:
        row["state"] = "checkpointed"
        row["note"] = "killed or lost; --resume continues it" if status.get("state") == "running" else ""
    else:
        row["state"] = "failed"
        row["note"] = "ended before its first checkpoint"
    if found:
        row["note"] = (row["note"] + f"; last checkpoint step {found[-1].step}").lstrip("; ")
    # The status' own words ("rerun ... with --resume") no longer hold where no checkpoint can be loaded.
    row["note"] = damaged if whole is None and damaged else "; ".join(filter(None, [row["note"], damaged]))
    return row


def guard_note(metrics: dict) -> str:
    """A finished run's note: what the guards (guards.py) found, in short; the summary and metrics.json say why."""
    found = []
    if metrics.get("adapter_changed") is False:
        found.append("the adapter did not change")
    if metrics.get("forward_warning"):
        found.append("held-out loss near ln(vocabulary) before training: a broken forward?")
    if metrics.get("held_out_warning"):
        found.append("held-out loss above the base's")
    return "; ".join(found)


def short_note(message: str, limit: int = 100) -> str:
    """The first line of a run's last message, as the table's note: asides in parentheses go first, then words
    from the end, so that a long one never stops mid-parenthesis ("to continue (; last checkpoint ...")."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    while len(line) > limit and (shorter := re.sub(r" ?\([^()]*\)", "", line)) != line:
        line = shorter  # the innermost asides first: finetune.run(cfg, resume=True), then (in Python: ...)
    if len(line) > limit:
        line = line[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return line


def format_table(rows: list[dict]) -> str:
    columns = ["run", "state", "step", "eval_loss", "note"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
