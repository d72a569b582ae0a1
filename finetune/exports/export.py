"""finetune export: a finished run's adapter in a form another library loads.

- lora: adapter.lora.h5 and adapter.json, checked; keras-hub loads them onto the preset.
- merged: the base weights with the LoRA update added, saved with save_to_preset;
  keras_hub.models.CausalLM.from_preset loads it, with no finetune installed.
- hf: the merged model in transformers' format, with its tokenizer (or the base alone, `base`).
- peft: adapter_model.safetensors and adapter_config.json for PEFT on the transformers model.
- gguf: the merged model as model.gguf for llama.cpp and Ollama, with a Modelfile (llamacpp.py), and a picture
  model's encoder as mmproj.gguf (mmproj.py).

Every check runs before anything is written, and the files are written into a
hidden staging directory that is renamed into place at the end: a refused or
failed export leaves nothing behind. Each export lists what it wrote in
MARKER, and --overwrite replaces only such a directory, holding nothing else:
never a folder of the user's (`--output .` in their project), nor a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune.exports import llamacpp, mmproj, transformers_gguf
from finetune.platform import keras_compat, storage
from finetune.platform.errors import UserError

FORMATS = ("lora", "merged", "hf", "peft", "gguf")
ADAPTER_FORMATS = ("lora", "peft")
"""The formats of an adapter alone, which a --full run (the whole model trained) has none of."""
MARKER = "finetune-export.json"
"""Written into every export: its format, the run, and the names it holds; what --overwrite may replace."""
# keras-hub's Gemma layer names -> transformers' module names (Gemma 3n's keras-hub layers have them already).
HF_MODULES = {
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "attention_output": "self_attn.o_proj",
    "ffw_gating": "mlp.gate_proj",
    "ffw_gating_2": "mlp.up_proj",
    "ffw_linear": "mlp.down_proj",
    **{name: f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{name: f"mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")},
}
PER_HEAD = ("query", "key", "value")  # kernel (heads, hidden, head_dim): LoRA A per head, B shared


@dataclass(frozen=True)
class Request:
    """What `finetune export` is asked for.

    format: str. lora (adapter.lora.h5 and adapter.json, checked), merged (a keras-hub preset with the update
        merged in), hf (transformers' format, merged), peft (a PEFT adapter for the transformers model) or gguf
        (the merged model as model.gguf for llama.cpp and Ollama).
    output: str or Path. The directory to write.
    overwrite: bool. Replace what `output` holds; without it a non-empty `output` is refused.
    base: bool. With format hf: the run's base model alone, for the peft adapter.
    dtype: str. With format gguf: f16 (the default), bf16, q8_0 or f32 for the matrices.
    """

    format: str
    output: object
    overwrite: bool = False
    base: bool = False
    dtype: str | None = None


def export(run_dir, request: Request, backend: str | None = None) -> Path:
    """Write a finished run's adapter as `request` asks; returns the directory written.

    backend: str. The Keras backend to build the model on; by default the one keras is loaded with, else the
        run's.
    Every check runs first: a refused export raises UserError and writes nothing.
    """
    from finetune.training import runs

    target = check_request(request)
    run = runs.open_on(run_dir, backend)
    if Path(target).resolve().is_relative_to(Path(run.directory).resolve()):
        raise UserError(f"--output {target} is inside the run's directory; export to a directory outside it")
    return export_run(run, request, target)


def check_request(request: Request) -> Path:
    """The output directory, once the request makes sense and its output may be written; pure Python."""
    fmt, output, overwrite, base, dtype = (request.format, request.output, request.overwrite, request.base,
                                           request.dtype)  # fmt: skip
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if base and fmt != "hf":
        raise UserError("--base writes the base model in transformers format: use it with --format hf")
    if dtype is not None and fmt != "gguf":
        raise UserError("--dtype chooses the GGUF file's weight type: use it with --format gguf")
    if dtype in llamacpp.LLAMA_QUANTIZED:
        raise UserError(
            f"finetune writes GGUF as {', '.join(llamacpp.DTYPES)}; {dtype} is made by llama.cpp's quantizer: export "
            f"with --dtype f16, then run llama-quantize DIR/model.gguf DIR/model-{dtype}.gguf {dtype.upper()}"
        )
    if dtype is not None and dtype not in llamacpp.DTYPES:
        raise UserError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(llamacpp.DTYPES)}")
    if output is None or not str(output).strip():
        raise UserError("--output is empty (an unset shell variable?); pass the directory to export to")
    if "://" in str(output):  # Path("gs://b/x") would be a local folder named gs:
        raise UserError(
            f"export writes to a local directory, not {output}; export to one, then copy it "
            "(gcloud storage cp -r DIR gs://...)"
        )
    # publish() writes .NAME.partial-PID and .NAME.old-PID beside it (a pid has at most 7 digits).
    storage.check_output(str(output), "--output", directory=True, beside=len("..partial-4194304"), inside=64)
    target = Path(output)
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise UserError(f"output {target} already holds files; pass --overwrite to replace them or choose another")
        refuse_foreign(target)
    if fmt in ("hf", "peft"):
        _require("safetensors", "the hf and peft formats")
    if fmt == "gguf":
        _require("gguf", "the gguf format", extra="gguf")
    return target


def refuse_foreign(target: Path) -> None:
    """--overwrite swaps the whole directory: only an earlier export holding nothing but its own files may go."""
    present = sorted(entry.name for entry in target.iterdir())
    try:
        about = json.loads((target / MARKER).read_text(encoding="utf-8"))
        written, tree = about["files"], about.get("tree")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        written, tree = None, None
    if not isinstance(written, list):
        shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
        raise UserError(
            f"output {target} is not a finetune export and holds files ({shown}); choose a new or empty --output "
            "(--overwrite replaces only an earlier export)"
        )
    if not isinstance(tree, list):  # an export of an earlier finetune, which listed its top-level names alone
        if any((target / name).is_dir() and not (target / name).is_symlink() for name in written):
            raise UserError(
                f"output {target} is an export of an earlier finetune, which did not list the files in its folders, "
                "so --overwrite cannot tell them from yours; remove it yourself or choose another --output"
            )
        tree = written
    own = set(tree)
    added = [name for name in _entries(target) if name not in own]
    if added:
        raise UserError(
            f"output {target} is an earlier export, but {', '.join(added[:3])} in it is not the export's own; "
            "move it out or choose another --output"
        )


def _entries(directory: Path) -> list[str]:
    """Every file and folder under `directory`, as paths relative to it (a link is not followed)."""
    found = []
    for root, folders, files in os.walk(directory):
        base = Path(root).relative_to(directory)
        found += [(base / name).as_posix() for name in (*folders, *files)]
    return sorted(found)


def _require(package: str, what: str, extra: str = "hf") -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise UserError(f"{what} need the {package} package: pip install 'finetune[{extra}]'")


def export_run(run, request: Request, target: Path) -> Path:
    """Write the run's adapter as `request` asks into `target`; keras must already be on the run's backend."""
    import keras

    from finetune.training import runs

    runs.check_writes_text(run, "export", request.format)

    before = keras.config.dtype_policy()
    try:
        return _export_run(run, request.format, target, request.base, request.dtype)
    finally:
        keras.config.set_dtype_policy(before)  # a notebook's next model is built as it would have been


def _export_run(run, fmt: str, target: Path, base: bool, dtype: str | None) -> Path:
    import keras

    from finetune.data import images
    from finetune.methods import registry
    from finetune.model import builder, presets
    from finetune.platform import backend
    from finetune.training import full_model, outputs, resolve, runs

    cfg = run.config
    if run.full and fmt in ADAPTER_FORMATS:
        raise UserError(
            f"{run.shown} trained every weight (--full), so it has no adapter to export as {fmt}; export the "
            f"trained model with --format {', '.join(f for f in FORMATS if f not in ADAPTER_FORMATS)}"
        )
    if fmt in ("merged", "hf", "gguf") and cfg.model.quantize and base:
        # The float base alone, for the peft export: a QLoRA adapter is loaded onto the float base, quantized as it
        # loads (transformers' BitsAndBytesConfig), as the run quantized it.
        print(f"note: the base is written in float; the run trained on its {cfg.model.quantize} quantization: "
              "load it quantized for the peft adapter, as the run did")  # fmt: skip
    elif fmt in ("merged", "hf", "gguf") and cfg.model.quantize:
        raise UserError(
            f"this run trained on an {cfg.model.quantize} base, so its adapter merged into the float base is not the "
            "model it trained;\nexport it with --format peft or lora instead"
        )
    if fmt == "peft" and cfg.model.add_tokens:
        raise UserError(
            "this run added tokens (--add-tokens): a PEFT adapter loads onto the base's tokenizer and embedding, "
            "which lack them;\nexport it with --format merged, hf, gguf or lora instead"
        )
    resolved = resolve.finished(cfg)  # the process set up as the run trained: its precision and threads
    source, precision = resolved.source, resolved.precision
    if fmt in ("lora", "peft"):
        trained_base = dataclasses.replace(resolved.recipe(train=False), lora=None)
        model = builder.build_model(source, trained_base)  # the base the adapter trained on, as it trained
        lm, preprocessor = model.lm, model.preprocessor
    else:
        # merged keeps the base weights' dtype (keras-hub's from_preset cannot read a mixed policy back);
        # hf and gguf are float32, cast on writing (transformers when a user loads it, gguf to --dtype).
        variables = keras.mixed_precision.DTypePolicy(backend.POLICIES[precision][0]).variable_dtype
        keras.config.set_dtype_policy(variables if fmt == "merged" else "float32")
        recipe = resolved.recipe(train=False)
        lm, preprocessor = builder.load_base(source, cfg.model.seq_len, images=recipe.images,
                                             image_tokens=recipe.image_tokens)  # fmt: skip
    if fmt == "hf" and not base:
        check_transformers_layout(lm.backbone)
    check_encoders(lm.backbone, fmt)
    if fmt == "gguf":
        llamacpp.architecture(lm.backbone)  # refused before anything is merged or written
        if builder.encoders(lm.backbone) or llamacpp.architecture(lm.backbone) in transformers_gguf.ARCHITECTURES:
            _require("safetensors", "GGUF of this model, converted from its transformers export,", extra="gguf")
    method = registry.get(cfg.train.method)
    head = None if base or not method.head else run.directory / method.head  # a scoring run's: its own
    if head is not None:  # checked as `finetune eval` and predict check it, before anything is written
        from finetune.methods import reward

        outputs_of = max(len(method.head_labels(cfg.train)), 1)
        reward.read_head(head, (int(lm.backbone.hidden_dim), outputs_of))
    if head is not None and fmt == "hf":
        classifier_of(lm.backbone, method)
    if run.full and not base:  # the trained weights, checked, in place of the base's: nothing to merge
        full_model.load(lm.backbone, run.directory, run.adapter)
    factors = {} if base or run.full else runs.checked_factors(run, lm.backbone)
    if fmt in ("merged", "hf", "gguf") and cfg.model.add_tokens and not base:
        from finetune.model import tokens  # the new tokens become plain pieces and rows of the merged model

        where = str(run.directory / runs.described_in(run))
        lm = tokens.merged(lm, preprocessor, cfg.model.add_tokens, runs.token_rows(run),
                           run.adapter.get("added_tokens"), where)  # fmt: skip
    if fmt == "peft":
        check_peft_layers(lm.backbone, factors, cfg.model.quantize)

    def write(staging: Path) -> None:
        if fmt == "lora":
            rows = [outputs.TOKEN_ROWS] if cfg.model.add_tokens else []  # --add-tokens' rows
            for name in (outputs.ADAPTER, outputs.ADAPTER_JSON, *rows, *([method.head] if head else [])):
                shutil.copyfile(run.directory / name, staging / name)
            return
        if fmt == "peft":
            write_peft(staging, lm.backbone, factors, cfg.lora)
            shutil.copyfile(run.directory / outputs.ADAPTER_JSON, staging / outputs.ADAPTER_JSON)  # which base
            return
        merge(lm.backbone, factors, cfg.lora.scale())
        if fmt == "gguf":
            write_gguf(
                staging, run, lm.backbone, preprocessor.tokenizer, dtype or "f16", images.vision_of(preprocessor)
            )
            return
        preprocessor.sequence_length = presets.preset_sequence_length(source)
        lm.preprocessor = preprocessor
        if fmt == "merged":
            lm.save_to_preset(str(staging))
            if type(lm.backbone).__name__ == "Gemma3nBackbone":
                # keras-hub's Gemma3nCausalLM reads its tied output embedding once, when the task is built; with
                # a task.json, from_preset builds it before loading the weights, and its logits use random ones.
                # Without it, from_preset builds the task around the loaded backbone (tests/test_families.py).
                (staging / "task.json").unlink(missing_ok=True)
        else:
            write_transformers(staging, lm.backbone, preprocessor.tokenizer, images.vision_of(preprocessor))
            if head is None:
                write_chat_template(staging, cfg.data.template, preprocessor.tokenizer)
            if head is not None:
                as_sequence_classifier(staging, classifier_of(lm.backbone, method), method.head_labels(cfg.train),
                                       head, preprocessor.tokenizer)  # fmt: skip

    def write_marked(staging: Path) -> None:
        from finetune.platform.version import __version__

        write(staging)
        files = sorted([*(entry.name for entry in staging.iterdir()), MARKER])
        tree = sorted([*_entries(staging), MARKER])  # what --overwrite may replace, down to each file
        about = {"finetune": __version__, "format": fmt, "run": run.origin, "files": files, "tree": tree}
        (staging / MARKER).write_text(json.dumps(about, indent=1) + "\n", encoding="utf-8")

    try:
        publish(target, write_marked)
    except OSError as e:  # a full or failing disk: nothing was written, and the user can fix it
        raise UserError(
            f"could not write the {fmt} export to {target}: {e.strerror or e}; nothing was written.\n"
            "Free some space or pass another --output"
        ) from e
    return target


def write_gguf(directory: Path, run, backbone, tokenizer, dtype: str, vision=None) -> None:
    """model.gguf, mmproj.gguf for a model with pictures, and a Modelfile that gives Ollama the run's prompt
    template and stop tokens.

    vision: images.Vision. The preprocessor's image handling; None for a text model.
    """
    import tempfile

    from finetune.data import templates
    from finetune.data.formats import Record
    from finetune.model import builder

    name, arch = run.name, llamacpp.architecture(backbone)
    about = llamacpp.About(name, chat_template(run.config.data.template))
    projector = mmproj.FILE if builder.encoders(backbone) else None
    if arch in transformers_gguf.ARCHITECTURES or projector:
        # llama.cpp's converter reads a transformers checkpoint; so do these, from our own export of it.
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.hf-") as exported:
            write_transformers(Path(exported), backbone, tokenizer, vision)
            if arch in transformers_gguf.ARCHITECTURES:
                transformers_gguf.write(directory / llamacpp.FILE, Path(exported), arch, tokenizer, dtype, about)
            if projector:
                mmproj.write(directory / mmproj.FILE, Path(exported), dtype, name=name)
    if arch not in transformers_gguf.ARCHITECTURES:
        llamacpp.write(directory / llamacpp.FILE, backbone, tokenizer, dtype, about)
    template = templates.get(run.config.data.template)
    prompt = template.apply(Record(instruction="{{ .Prompt }}", response="-"))[0]
    if run.config.data.template in templates.CHAT:  # Ollama's system message, where the model's template puts one
        turns = (("system", "{{ .System }}"), ("user", "{{ .Prompt }}"), ("assistant", "-"))
        told = template.apply(Record(instruction="", response="", turns=turns))[0]
        prompt = f"{{{{ if .System }}}}{told}{{{{ else }}}}{prompt}{{{{ end }}}}"
    modelfile = llamacpp.modelfile(prompt, template.stop_tokens, projector)
    (directory / llamacpp.MODELFILE).write_text(modelfile, encoding="utf-8")


def publish(target: Path, write) -> None:
    """write(staging) into a hidden sibling of `target`, then swap it in; a failure leaves `target` as it was."""
    target = target.resolve()
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    made = target.parent  # the outermost folder this export creates, removed again if it fails
    while not made.parent.exists():
        made = made.parent
    made = None if made.exists() else made
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(made or staging, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def merge(backbone, factors: dict, scale: float) -> None:
    """W += scale * A @ B on each adapted kernel, as Keras' EinsumDense computes its LoRA kernel; under DoRA,
    W = m * (W + scale * A @ B) / |W + scale * A @ B|, the norm of each output's column (builder._with_lora); and
    on an expert bank, each expert's W_e += scale * A_e @ B_e for its gate, up and down projections (experts.py).

    A is (..., in, rank) and B (rank, out), so A @ B broadcasts over the leading
    axes to the kernel's shape: (heads, hidden, head_dim) for query, key and
    value, (heads, head_dim, hidden) for attention_output, (in, out) for the
    feed-forward kernels. Summed in float32, then cast to the kernel's dtype.
    """
    import numpy as np

    from finetune.model import builder, experts
    from finetune.training import adapter

    layers = adapter.layers_with_weights(backbone)
    for index, values in factors.items():
        if experts.is_bank(layers[index]):  # (A, B) of each projection, (experts, in, r) @ (experts, r, out)
            for projection, a, b in zip(experts.PROJECTIONS, values[0::2], values[1::2], strict=True):
                weight = getattr(layers[index], projection)
                weight.assign(np.asarray(weight.numpy(), dtype=np.float32) + scale * np.matmul(a, b))
            continue
        a, b, *magnitude = values
        kernel = layers[index].kernel
        merged = np.asarray(kernel.numpy(), dtype=np.float32) + scale * np.matmul(a, b)
        if magnitude:
            axes = builder.reduced_axes(layers[index])
            merged *= np.expand_dims(magnitude[0] / np.sqrt(np.square(merged).sum(axis=axes)), axes)
        kernel.assign(merged)  # cast on assign


def check_peft_layers(backbone, factors: dict, quantize: str | None) -> None:
    """Refuse a PEFT export of an adapter on the experts, which write_peft does not write: PEFT keeps those under
    target_parameters, on transformers' fused gate_up_proj, a layout not built here. The merged formats carry them,
    and lora."""
    from finetune.model import experts
    from finetune.training import adapter

    layers = adapter.layers_with_weights(backbone)
    if any(experts.is_bank(layers[index]) for index in factors):
        carried = "lora" if quantize else "merged, hf or gguf (the experts' update merged in), or lora"
        raise UserError(
            "this run's adapter is on the experts (--target experts), and finetune's peft format carries LoRA on "
            f"linear layers only; export it with --format {carried}"
        )


def check_transformers_layout(backbone) -> None:
    """Refuse what transformers' Gemma classes could not load as trained; says what works instead."""
    kind = type(backbone).__name__
    if kind == "GemmaBackbone" and (backbone.use_post_ffw_norm or backbone.final_logit_soft_cap is not None):
        raise UserError(
            "this is a Gemma 2 preset, and finetune exports Gemma 1, 3, 3n and 4 to transformers format; "
            "use --format merged or peft"
        )
    check_encoders(backbone, "hf")
    if kind == "Gemma3Backbone" and not (
        backbone.use_post_ffw_norm and backbone.use_post_attention_norm and backbone.use_query_key_norm
    ):  # transformers' Gemma 3 always has these norms; one missing here has no equivalent there
        raise UserError("this Gemma 3 model lacks the post or query/key norms transformers' Gemma 3 always has")
    if getattr(backbone, "is_embedding_model", False):
        raise UserError(f"this {kind} is an embedding model; finetune exports causal LMs; use --format merged")
    if kind not in ("GemmaBackbone", "Gemma3Backbone", "Gemma4Backbone", "Gemma3nBackbone"):
        raise UserError(f"finetune cannot export a {kind} to transformers format; use --format merged")


def check_encoders(backbone, fmt: str) -> None:
    """Refuse the formats that cannot carry a model with an image or audio encoder; say which can."""
    from finetune.model import builder

    if not builder.encoders(backbone):
        return
    kind = type(backbone).__name__
    if fmt == "gguf":
        # llama.cpp reads a picture encoder from a second file (mmproj.gguf), which finetune writes for Gemma 3's
        # SigLIP tower alone (mmproj.py); a model.gguf of the decoder alone would drop what the run learned to see.
        if kind == "Gemma3Backbone" and getattr(backbone, "audio_encoder", None) is None:
            return
        raise UserError(
            f"this {kind} sees pictures or hears audio, and finetune writes llama.cpp's encoder file (mmproj) for "
            "Gemma 3's picture encoder only; use --format merged or lora"
        )
    if fmt in ("hf", "peft") and kind != "Gemma3Backbone":
        # transformers' Gemma 4 and 3n multimodal classes lay the decoder out under other module paths; unchecked.
        raise UserError(
            f"this {kind} has an image or audio encoder; finetune exports Gemma 3's image model to transformers "
            "and PEFT, not this family's; use --format merged or lora"
        )


def write_transformers(directory: Path, backbone, tokenizer, vision=None) -> None:
    """config.json, model.safetensors and the tokenizer, for transformers' Gemma, Gemma 3, 3n or 4 causal LM.

    keras-hub's exporter writes the weights it reads from each layer's raw
    kernel, so merging first is what carries the fine-tuning. Its Gemma 1
    mapping takes only the first key/value head; we write every head. It has
    no Gemma 3n mapping: ours is its transformers importer's, reversed. A Gemma 3 with a vision encoder is
    Gemma3ForConditionalGeneration, with the image processor that scales pixels as the run's converter did.
    vision: images.Vision. The preprocessor's image handling; None for a text model.
    """
    import json

    if getattr(backbone, "vision_encoder", None) is None:
        vision = None
    hf_exporter = keras_compat.transformers_exporter()
    kind = type(backbone).__name__
    if kind in ("Gemma3Backbone", "Gemma4Backbone"):
        hf_exporter.export_backbone(backbone, str(directory), include_lm_head=True, tokenizer=tokenizer)
        hf_exporter.export_generation_config(backbone, str(directory))
        # keras-hub writes the dtype policy's name, and mixed_bfloat16 is no torch dtype: name the weights'.
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        config["torch_dtype"] = backbone.dtype_policy.variable_dtype
        if kind == "Gemma4Backbone":
            config["architectures"] = ["Gemma4ForCausalLM"]  # keras-hub names a class transformers lacks
            # keras-hub leaves out that global layers with their own key/value head count reuse K for V
            # (26b_a4b, 31b): without it, transformers builds them a value projection and K/V heads of their own.
            config["attention_k_eq_v"] = backbone.num_global_key_value_heads is not None
        if vision is not None:
            describe_pictures(config, backbone, tokenizer)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    else:
        gemma3n = kind == "Gemma3nBackbone"
        config, weights = (_gemma3n_transformers if gemma3n else _gemma_transformers)(backbone, tokenizer)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _save_safetensors(directory / "model.safetensors", weights)
    if type(tokenizer).__name__ == "Gemma3nTokenizer":
        _write_sentencepiece_tokenizer(directory, tokenizer)
    else:
        hf_exporter.export_tokenizer(tokenizer, str(directory))
    write_unigram_tokenizer(directory, tokenizer)
    if vision is not None:
        write_image_processor(directory, tokenizer, vision)


CLASSIFIERS = {
    "GemmaBackbone": "GemmaForSequenceClassification",
    "Gemma3Backbone": "Gemma3TextForSequenceClassification",
}
"""transformers' sequence classifier of each text backbone whose causal LM write_transformers writes."""


def classifier_of(backbone, method) -> str:
    """The transformers class a scoring run of `method` on `backbone` exports as; refused where it has none."""
    from finetune.model import families

    kind = type(backbone).__name__
    if kind not in CLASSIFIERS or getattr(backbone, "vision_encoder", None) is not None:
        family = families.of_backbone(backbone).title
        raise UserError(f"transformers has no sequence classifier of {family}'s text decoder, so this {method.title} "
                        "run cannot be exported with its head as --format hf; export it with --format lora (the "
                        "adapter and the head's file)")  # fmt: skip
    return CLASSIFIERS[kind]


def as_sequence_classifier(directory: Path, classifier: str, labels: list, head: Path, tokenizer) -> None:
    """Turn the causal LM write_transformers wrote into `classifier`: its config names the labels and the padding
    id (by which transformers finds each row's last token), the tied output embedding goes, and the run's head,
    `kernel` (hidden, labels), becomes `score.weight` (labels, hidden)."""
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config.update(architectures=[classifier], num_labels=len(labels), pad_token_id=tokenizer.pad_token_id,
                  id2label={str(i): name for i, name in enumerate(labels)},
                  label2id={name: i for i, name in enumerate(labels)})  # fmt: skip
    config.pop("problem_type", None)
    _write_json(directory / "config.json", config)
    files = sorted(directory.glob("*.safetensors"))
    weights = {}
    for path in files:
        weights.update(load_file(str(path)))
        path.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    weights.pop("lm_head.weight", None)
    with np.load(head) as saved:
        weights["score.weight"] = np.ascontiguousarray(saved["kernel"].T.astype(np.float32))
    _save_safetensors(directory / "model.safetensors", weights)


def describe_pictures(config: dict, backbone, tokenizer) -> None:
    """Gemma3ForConditionalGeneration's image settings in keras-hub's config.json, from the run's own tokenizer.

    keras-hub writes them inside vision_config, with the ids of Gemma 3's
    262k vocabulary and its `<image_soft_token>`; transformers reads them at
    the top. keras-hub's soft token is `<img>`, whose positions the projected
    image features take in both libraries.
    """
    vision = config["vision_config"]
    for key in ("boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image"):
        vision.pop(key, None)
    config.update(
        boi_token_index=tokenizer.token_to_id(tokenizer.start_of_image_token),
        eoi_token_index=tokenizer.token_to_id(tokenizer.end_of_image_token),
        image_token_index=tokenizer.token_to_id(tokenizer.image_placeholder),
        mm_tokens_per_image=backbone.vision_encoder.num_vision_tokens_per_image,
    )
    text = config["text_config"]  # keras-hub names the text decoder's special tokens as Gemma 3's ids, not ours
    text.update(pad_token_id=tokenizer.pad_token_id, torch_dtype=config["torch_dtype"])
    text.update({key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config})


def write_image_processor(directory: Path, tokenizer, vision) -> None:
    """preprocessor_config.json and processor_config.json for transformers' Gemma3Processor, and the image tokens
    it reads from tokenizer_config.json.

    keras-hub's converter computes pixels * scale + offset; transformers'
    (pixels / 255 - mean) / std, so std = 1 / (255 scale) and mean = -offset
    * std (SigLIP's 0.5 and 0.5 for Gemma 3's 1 / 127.5 and -1). keras-hub
    crops a picture's middle to the model's aspect ratio before resizing;
    transformers resizes the whole picture, so only pictures already square
    reach both models as the same pixels.
    """
    import numpy as np

    converter = vision.converter
    scale = np.broadcast_to(np.asarray(1.0 if converter.scale is None else converter.scale, np.float64), (3,))
    offset = np.broadcast_to(np.asarray(0.0 if converter.offset is None else converter.offset, np.float64), (3,))
    std = 1.0 / (255.0 * scale)
    height, width = vision.image_size
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": int(height), "width": int(width)},
        "resample": 2,  # PIL's bilinear, keras-hub's converter's interpolation
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": (-offset * std).tolist(),
        "image_std": std.tolist(),
        "do_pan_and_scan": False,
    }
    _write_json(directory / "preprocessor_config.json", processor)
    _write_json(directory / "processor_config.json",
                {"processor_class": "Gemma3Processor", "image_seq_length": vision.tokens_per_image})  # fmt: skip
    marks = {
        "boi_token": tokenizer.start_of_image_token,
        "eoi_token": tokenizer.end_of_image_token,
        "image_token": tokenizer.image_placeholder,
    }
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(marks, processor_class="Gemma3Processor", extra_special_tokens=marks)
    _write_json(directory / "tokenizer_config.json", config)


def chat_template(template: str) -> str | None:
    """The Jinja source of a chat run's template (data/chat_templates), the model's own; None for a text template
    (dolly, alpaca, none): it has no conversation."""
    from finetune.data import chat, templates

    return chat.source(templates.TEMPLATES[template].renderer.file) if template in templates.CHAT else None


def write_chat_template(directory: Path, template: str, tokenizer) -> None:
    """A chat run's template in the transformers export: the model's own chat template, which the run rendered
    its records with (data/chat_templates), as tokenizer_config.json's chat_template, for apply_chat_template and
    the servers that read it; and the model's turn end among generation_config.json's stop ids, where generation
    stops as `finetune generate` does. Nothing for a text template (dolly, alpaca, none): it has no conversation."""
    from finetune.data import templates

    if template not in templates.CHAT:
        return
    used = templates.TEMPLATES[template]
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = chat_template(template)
    _write_json(directory / "tokenizer_config.json", config)
    generation = directory / "generation_config.json"  # Gemma 1's export has none: its ids, as transformers' own
    found = json.loads(generation.read_text(encoding="utf-8")) if generation.is_file() else {
        "bos_token_id": tokenizer.start_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    given = found.get("eos_token_id")
    stops = [given] if isinstance(given, int) else list(given or [])
    stops += [i for i in templates.stop_ids(tokenizer, used.stop_tokens) if i not in stops]
    found["eos_token_id"] = stops
    _write_json(generation, found)


def _write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def _write_sentencepiece_tokenizer(directory: Path, tokenizer) -> None:
    """tokenizer.model and a GemmaTokenizer tokenizer_config.json (keras-hub exports no Gemma 3n tokenizer)."""
    import json

    (directory / "tokenizer.model").write_bytes(tokenizer.proto)
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, **special}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_unigram_tokenizer(directory: Path, tokenizer) -> None:
    """tokenizer.json for a unigram SentencePiece model, such as tiny's; Gemma's own BPE ones are left as they are.

    transformers' GemmaTokenizer rebuilds a BPE tokenizer from tokenizer.model
    whatever its type, which splits a unigram vocabulary's text differently.
    A tokenizers Unigram model with SentencePiece's scores, whitespace
    handling and digit splitting gives the same ids, and AutoTokenizer reads
    it as it is when the config names no Gemma class.
    """
    import json

    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((directory / "tokenizer.model").read_bytes())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        return
    spec, vocabulary = proto.trainer_spec, [(piece.piece, piece.score) for piece in proto.pieces]
    unigram = Tokenizer(models.Unigram(vocabulary, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback))
    prepend = "first" if proto.normalizer_spec.add_dummy_prefix else "never"
    splits = [pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=spec.split_by_whitespace)]
    if spec.split_digits:
        splits.append(pre_tokenizers.Digits(individual_digits=True))
    unigram.pre_tokenizer = pre_tokenizers.Sequence(splits)
    unigram.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    control = sentencepiece_model_pb2.ModelProto.SentencePiece
    special = [p.piece for p in proto.pieces if p.type == control.CONTROL]
    unigram.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in special])
    # A user-defined piece (--add-tokens' among them) is matched whole, as SentencePiece matches it, and is text:
    # marked special, a decoder that skips special tokens (pipelines', vLLM's default) dropped it from the answer.
    defined = [p.piece for p in proto.pieces if p.type == control.USER_DEFINED]
    unigram.add_tokens([AddedToken(piece, special=False, normalized=False) for piece in defined])
    bos = tokenizer.start_token  # keras-hub's Gemma preprocessor starts every sequence with it
    unigram.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    unigram.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _gemma_transformers(backbone, tokenizer) -> tuple[dict, dict]:
    """Gemma 1: transformers' config and {name: float32 array} for every weight."""
    import numpy as np

    gemma = keras_compat.transformers_gemma_exporter()
    config = gemma.get_gemma_config(backbone)
    config.update(
        architectures=["GemmaForCausalLM"],
        hidden_act="gelu_pytorch_tanh",  # keras-hub's Gemma uses gelu(approximate=True)
        rms_norm_eps=backbone.layer_norm_epsilon,
        torch_dtype="float32",
        bos_token_id=tokenizer.token_to_id(tokenizer.start_token),
        eos_token_id=tokenizer.token_to_id(tokenizer.end_token),
        pad_token_id=tokenizer.pad_token_id,
    )
    weights = {name: _numpy(value) for name, value in gemma.get_gemma_weights_map(backbone).items()}
    for i in range(backbone.num_layers):
        attention = backbone.get_layer(f"decoder_block_{i}").attention
        for layer, name in ((attention.key_dense, "k_proj"), (attention.value_dense, "v_proj")):
            weights[f"model.layers.{i}.self_attn.{name}.weight"] = per_head_rows(_numpy(layer.kernel))
    return config, {name: np.asarray(value, dtype=np.float32) for name, value in weights.items()}


def _gemma3n_transformers(backbone, tokenizer) -> tuple[dict, dict]:
    """Gemma 3n's text decoder: Gemma3nForCausalLM's config and {name: float32 array} for every weight."""
    import numpy as np

    text = backbone.language_model
    theta_local = float(backbone.rope_local_base_freq)
    config = {
        "architectures": ["Gemma3nForCausalLM"],
        "model_type": "gemma3n_text",
        "vocab_size": backbone.text_vocab_size,
        "vocab_size_per_layer_input": backbone.vocab_size_per_layer_input,
        "hidden_size": backbone.text_hidden_size,
        "hidden_size_per_layer_input": backbone.hidden_size_per_layer_input,
        "intermediate_size": list(backbone.intermediate_size),
        "num_hidden_layers": backbone.num_hidden_layers,
        "num_attention_heads": backbone.num_attention_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": backbone.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",  # keras-hub's gelu_approximate
        "max_position_embeddings": backbone.max_position_embeddings,
        "rms_norm_eps": backbone.rms_norm_eps,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": float(backbone.rope_theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": theta_local},
        },
        "attention_bias": backbone.attention_bias,
        "sliding_window": backbone.sliding_window,
        "layer_types": list(backbone.layer_types),
        "final_logit_softcapping": backbone.final_logit_soft_cap,
        "altup_active_idx": backbone.altup_active_idx,
        # keras-hub never clips; transformers clips the AltUp coefficients to this only while it trains.
        "altup_coef_clip": 120.0 if backbone.altup_coef_clip is None else backbone.altup_coef_clip,
        "altup_correct_scale": backbone.altup_correct_scale,
        "altup_num_inputs": backbone.altup_num_inputs,
        "num_kv_shared_layers": backbone.num_kv_shared_layers,
        "laurel_rank": backbone.laurel_rank,
        "activation_sparsity_pattern": list(text.activation_sparsity_pattern),
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.token_to_id(tokenizer.start_token),
        "eos_token_id": tokenizer.token_to_id(tokenizer.end_token),
    }
    weights = {
        "model.embed_tokens.weight": text.embed_tokens.embedding.embeddings,
        "model.norm.weight": text.final_normalization.scale,
        "model.embed_tokens_per_layer.weight": text.embed_tokens_per_layer.embedding.embeddings,
        "model.per_layer_model_projection.weight": text.per_layer_model_projection.kernel,
        "model.per_layer_projection_norm.weight": text.per_layer_projection_norm.scale,
    }
    for i, dense in enumerate(text.altup_projections):
        weights[f"model.altup_projections.{i}.weight"] = dense.kernel
    for i, dense in enumerate(text.altup_unembed_projections):
        weights[f"model.altup_unembed_projections.{i}.weight"] = dense.kernel
    for i, block in enumerate(text.transformer_layers):
        prefix, attention, altup, laurel = f"model.layers.{i}", block.attention, block.altup, block.laurel
        named = {
            "self_attn.q_proj": attention.q_proj.kernel,
            "self_attn.k_proj": attention.k_proj.kernel,
            "self_attn.v_proj": attention.v_proj.kernel,
            "self_attn.o_proj": attention.o_proj.kernel,
            "self_attn.q_norm": attention.q_norm.scale,
            "self_attn.k_norm": attention.k_norm.scale,
            "mlp.gate_proj": block.mlp.gate_proj.kernel,
            "mlp.up_proj": block.mlp.up_proj.kernel,
            "mlp.down_proj": block.mlp.down_proj.kernel,
            "input_layernorm": block.input_layernorm.scale,
            "post_attention_layernorm": block.post_attention_layernorm.scale,
            "pre_feedforward_layernorm": block.pre_feedforward_layernorm.scale,
            "post_feedforward_layernorm": block.post_feedforward_layernorm.scale,
            "altup.correction_coefs": altup.correction_coefs.kernel,
            "altup.prediction_coefs": altup.prediction_coefs.kernel,
            "altup.modality_router": altup.modality_router.kernel,
            "altup.router_norm": altup.router_norm.scale,
            "laurel.linear_left": laurel.linear_left.kernel,
            "laurel.linear_right": laurel.linear_right.kernel,
            "laurel.post_laurel_norm": laurel.post_laurel_norm.scale,
            "per_layer_input_gate": block.per_layer_input_gate.kernel,
            "per_layer_projection": block.per_layer_projection.kernel,
            "post_per_layer_input_norm": block.post_per_layer_input_norm.scale,
        }
        if altup.altup_correct_scale:
            weights[f"{prefix}.altup.correct_output_scale"] = altup.correct_output_scale
        weights.update({f"{prefix}.{name}.weight": value for name, value in named.items()})
    out = {}
    for name, value in weights.items():
        array = np.asarray(_numpy(value), dtype=np.float32)
        # A Dense kernel is (in, out); transformers' Linear weight is (out, in). Embeddings and scales stay.
        out[name] = array.T if array.ndim == 2 and "embed_tokens" not in name else array
    return config, out


def per_head_rows(kernel):
    """(heads, hidden, head_dim) -> transformers' (heads * head_dim, hidden): row h * head_dim + j."""
    heads, hidden, head_dim = kernel.shape
    return kernel.transpose(0, 2, 1).reshape(heads * head_dim, hidden)


def _rank_pattern(ranks: dict, rank: int) -> dict:
    """PEFT's rank_pattern: by module name (q_proj) when every layer's agrees, else by layer and module.

    Gemma 4's global layers have fewer key/value heads than its sliding ones, so
    their k_proj ranks differ; PEFT matches a key against a module path's end.
    """
    by_kind: dict = {}
    for path, r in ranks.items():
        by_kind.setdefault(path.rsplit(".", 1)[1], set()).add(r)
    pattern = {}
    for path, r in sorted(ranks.items()):
        kind = path.rsplit(".", 1)[1]
        if len(by_kind[kind]) > 1:
            if r != rank:
                pattern[path] = r
        elif r != rank:
            pattern[kind] = r
    return pattern


def _numpy(value):
    import keras
    import numpy as np

    return np.asarray(keras.ops.convert_to_numpy(value.value if hasattr(value, "value") else value))


def _save_safetensors(path: Path, tensors: dict) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    # safetensors writes a private temporary file and renames it: give it the mode every other file gets here, so
    # that a serving process of another user or group reads it as it reads config.json beside it.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_peft(directory: Path, backbone, factors: dict, lora) -> None:
    """adapter_model.safetensors and adapter_config.json: the same update as Keras', in PEFT's layout.

    PEFT adds (lora_alpha / r) * B_p @ A_p to a (out, in) weight. Keras' LoRA on
    a per-head kernel (heads, hidden, head_dim) has A (heads, hidden, r), one
    per head, and one B (r, head_dim) shared by the heads. In transformers'
    rows (head h, dim j at h * head_dim + j) that update is exactly rank
    heads * r: A_p stacks the heads' A, B_p is block-diagonal with B on each
    block. attention_output sums over heads on its input side and the
    feed-forward kernels are plain matrices, so those stay rank r.
    The scale s (alpha / r, or alpha / sqrt(r) with rslora) is kept by giving each module of rank r_m the alpha
    s * r_m (s * sqrt(r_m)). DoRA's magnitudes go under PEFT's key, one per row of the module's weight.

    lora: config.LoraConfig. The run's rank, alpha, rslora and dora.
    """
    import json

    import numpy as np

    from finetune.training import adapter

    rank = lora.rank

    def alpha_for(r: int) -> float:  # the alpha that PEFT turns into the scale s at rank r
        return lora.scale() * (math.sqrt(r) if lora.rslora else r)

    # Gemma3ForConditionalGeneration keeps its decoder under model.language_model, beside the vision tower.
    decoder = "model.language_model" if getattr(backbone, "vision_encoder", None) is not None else "model"
    layers = adapter.layers_with_weights(backbone)
    tensors, ranks = {}, {}
    for index, (a, b, *magnitude) in sorted(factors.items()):
        layer = layers[index]
        # decoder_block_<i>/attention/query, or text_model/decoder_block_<i>/... for Gemma 3n
        block = int(next(p for p in layer.path.split("/") if p.startswith("decoder_block_")).rsplit("_", 1)[1])
        module = HF_MODULES[layer.name]
        if layer.name in PER_HEAD:
            heads = a.shape[0]
            lora_a = a.transpose(0, 2, 1).reshape(heads * rank, a.shape[1])  # (heads * r, hidden)
            lora_b = np.kron(np.eye(heads, dtype=np.float32), b.T)  # (heads * head_dim, heads * r)
        else:
            lora_a = a.reshape(-1, rank).T  # (r, in): attention_output's in is heads * head_dim
            lora_b = b.T  # (out, r)
        ranks[f"layers.{block}.{module}"] = lora_a.shape[0]
        prefix = f"base_model.model.{decoder}.layers.{block}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = lora_a.astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = lora_b.astype(np.float32)
        if magnitude:  # (heads, head_dim) or (out,): transformers' rows, head h's dim j at h * head_dim + j
            tensors[f"{prefix}.lora_magnitude_vector"] = magnitude[0].reshape(-1).astype(np.float32)
    _save_safetensors(directory / "adapter_model.safetensors", tensors)
    wider = _rank_pattern(ranks, rank)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,  # a keras-hub preset name is no transformers id; adapter.json names it
        "r": rank,
        "lora_alpha": alpha_for(rank),
        "target_modules": _target_modules(sorted({path.rsplit(".", 1)[1] for path in ranks}), decoder),
        "rank_pattern": wider,
        "alpha_pattern": {name: alpha_for(r) for name, r in wider.items()},
        "lora_dropout": float(lora.dropout),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": bool(lora.rslora),
        "use_dora": bool(lora.dora),
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _target_modules(names: list, decoder: str):
    """PEFT's target_modules: the module names, or, beside a vision tower whose attention has q_proj, k_proj and
    v_proj too, a pattern PEFT matches against the whole path, held to the decoder's layers."""
    if decoder == "model":
        return names
    return rf"(.*\.)?language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(names)})"
