"""`finetune plan`: what a run would hold in each device's memory, worked out before anything loads.

Pure Python and offline: the architecture comes from archs.py (or a local
preset's config.json), each kernel's layout from layouts.place, and the
bytes from the run's config. No keras, no weights, no network, so it answers
in a fraction of a second and on a laptop for a pod.

The counts are estimates of what the training step keeps alive at its peak.
On a CPU they include the frameworks' own resident memory (measured); on an
accelerator its runtime's workspace and the CUDA context are left to the
headroom, as are XLA's temporaries and, under mixed_bfloat16, the bfloat16
copies of the kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config import Config
from finetune.methods import registry
from finetune.model import archs, checkpoints, families, layouts, presets
from finetune.platform.backend import DEFAULT_BATCH_SIZE, full_weights_precision
from finetune.platform.errors import UserError

GiB = 2**30
# A plan that needs more than this share of the usable memory is called tight: XLA's and cuDNN's
# workspaces, and fragmentation, take a few percent that no count here sees.
HEADROOM = 0.10


@dataclass(frozen=True)
class Device:
    memory: int
    """Bytes of accelerator memory one device (a GPU, a TPU core or chip) offers, as its runtime reports it."""
    bfloat16: bool
    """Whether precision `auto` picks bfloat16 on it (on a GPU or TPU; a CPU's is backend.cpu_precision's)."""
    what: str
    kind: str = "gpu"
    """gpu, tpu or cpu: auto picks float16 on a GPU without bf16, float32 on such a CPU."""


# Memory as nvidia-smi or the TPU runtime reports it, which is a little under the marketing figure.
DEVICES = {
    "t4": Device(15 * GiB, False, "NVIDIA T4, 16 GB (Kaggle, Colab)"),
    "p100": Device(16 * GiB, False, "NVIDIA P100, 16 GB (Kaggle)"),
    "v100": Device(16 * GiB, False, "NVIDIA V100, 16 GB"),
    "l4": Device(22 * GiB + 512 * 2**20, True, "NVIDIA L4, 24 GB"),
    "a10g": Device(22 * GiB + 512 * 2**20, True, "NVIDIA A10G, 24 GB"),
    "a100-40g": Device(40 * GiB, True, "NVIDIA A100, 40 GB"),
    "a100-80g": Device(80 * GiB, True, "NVIDIA A100, 80 GB"),
    "h100": Device(79 * GiB + 648 * 2**20, True, "NVIDIA H100, 80 GB"),
    "h200": Device(140 * GiB + 410 * 2**20, True, "NVIDIA H200, 141 GB"),
    "v3-8": Device(16 * GiB, True, "TPU v3, 16 GiB per core (8 cores in a v3-8)", "tpu"),
    "v4": Device(32 * GiB, True, "TPU v4, 32 GiB per chip", "tpu"),
    "v5e": Device(16 * GiB, True, "TPU v5e, 16 GiB per chip", "tpu"),
    "v5p": Device(95 * GiB, True, "TPU v5p, 95 GiB per chip", "tpu"),
    "v6e": Device(32 * GiB, True, "TPU v6e, 32 GiB per chip", "tpu"),
}
ALIASES = {"v3": "v3-8", "a100": "a100-40g", "v4-8": "v4", "v5e-8": "v5e", "v5litepod-8": "v5e", "v6e-8": "v6e"}
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
UNITS["tib"] = 2**40


def device(text: str) -> tuple[str, Device]:
    """--device-memory: a size (16GB, 15.5GiB, 512MiB), a known kind (t4, h100, v3-8), or cpu (this host's RAM)."""
    key = text.strip().lower()
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return key, DEVICES[key]
    if key == "cpu":
        from finetune.platform import backend

        memory = backend.host_memory()
        if memory is None:
            raise UserError("cannot read this host's memory (no /proc/meminfo); pass --device-memory SIZE")
        # bfloat16 unused: auto_precision asks backend.cpu_precision, whose answer depends on the framework too.
        return "cpu", Device(memory, False, "this host's memory", "cpu")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", key)
    if match and match.group(2) in UNITS and float(match.group(1)) > 0:
        size = int(float(match.group(1)) * UNITS[match.group(2)])
        return text.strip(), Device(size, True, f"{text.strip()} per device", "any")
    kinds = ", ".join([*DEVICES, "cpu"])
    raise UserError(
        f"--device-memory {text!r} is neither a size with a unit (16GB, 16GiB, 512MiB) nor a known device ({kinds})"
    )


@dataclass(frozen=True)
class Model:
    name: str
    family: str
    dims: layouts.Dims
    config: dict = field(hash=False)
    vision_params: int = 0
    encoder_params: int = 0
    """A Gemma 4 or 3n preset's image and audio encoders, which a text run does not load (archs.py)."""
    vision: dict | None = field(default=None, hash=False)
    """A Gemma 3 preset's image encoder config (Gemma3VisionEncoder's arguments, its dtype, and `max_images`, the
    preprocessor's limit); None without one."""
    audio: dict | None = field(default=None, hash=False)
    """A tiny audio preset's audio encoder and converter config (Gemma4AudioEncoder's arguments, `converter`);
    None without one."""
    audio_params: int = 0
    """That encoder's weights."""


def model_of(preset: str) -> Model:
    """The architecture a --preset names, without loading or downloading it."""
    if preset in presets.TINY:
        spec = presets.TINY[preset]
        config = presets.tiny_config(preset, presets.tiny_vocabulary_size(preset))
        if spec.audio is not None:
            model = _model(preset, spec.family, config)
            weights = (
                presets.TINY_GEMMA3N_AUDIO_PARAMS if spec.family == "gemma3n" else presets.TINY_GEMMA4_AUDIO_PARAMS
            )
            return dataclasses.replace(model, audio=spec.audio, audio_params=weights)
        if spec.vision is None:
            return _model(preset, spec.family, config)
        if spec.family == "gemma3n":
            return _model(preset, spec.family, config, presets.TINY_GEMMA3N_VISION_PARAMS,
                          vision=_mobilenet(spec.vision))  # fmt: skip
        # Built with the run's dtype policy (presets.tiny_backbone): no dtype here, so it computes as the run does.
        vision = dict(spec.vision, output_dim=config["hidden_dim"], max_images=archs.MAX_IMAGES)
        return _model(preset, spec.family, config, archs.vision_parameter_count(vision), vision=vision)
    path = Path(preset).expanduser()
    if path.is_dir():
        family, config = presets.directory_backbone(path)
        vision = _directory_vision(path, config) if family == "gemma3" else None
        try:
            vision_params = archs.vision_parameter_count(vision) if vision else 0
            if vision:
                archs.tokens_per_image(vision)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise UserError(f"{path / 'config.json'}: its vision_encoder config lacks a usable {e}") from None
        return _model(str(path), family, config, vision_params, vision=vision)
    if preset.startswith(checkpoints.PREFIX):
        return _hub_model(preset)
    # kaggle://keras/gemma/keras/gemma_2b_en/3 names the variant in its fourth part.
    parts = preset.removeprefix("kaggle://").split("/") if preset.startswith("kaggle://") else [preset]
    name = parts[3] if len(parts) > 3 else parts[0] if len(parts) == 1 else ""
    arch = archs.lookup(name) if name else None
    if arch is None:
        close = presets.near_misses(name or preset, [*archs.ARCHS, *presets.TINY])
        known = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"`finetune plan` knows {', '.join(archs.ARCHS)} (and their instruct variants), "
            f"{', '.join(presets.TINY)}, and preset directories"
        )
        raise UserError(f"no architecture table for preset {preset!r}, and it is not a local directory; {known}")
    vision = dict(arch.vision, max_images=archs.MAX_IMAGES) if arch.vision else None
    return _model(name, arch.family, arch.config, arch.vision_params, arch.encoder_params, vision)


def _mobilenet(encoder: dict) -> dict:
    """The plan's view of a Gemma 3n image encoder (keras-hub's MobileNetV5Backbone config): a convolutional network,
    whose pictures are a square of pixels and whose soft tokens are its fusion adapter's output grid."""
    return dict(encoder="mobilenetv5", image_size=int(encoder["image_shape"][0]),
                tokens_per_image=int(encoder["msfa_output_resolution"]) ** 2, stem_size=int(encoder["stem_size"]),
                widest=max(max(row) for row in encoder["stackwise_num_filters"]), max_images=archs.MAX_IMAGES)  # fmt: skip


def _directory_vision(path: Path, config: dict) -> dict | None:
    """A saved Gemma 3 preset's image encoder config, with its dtype's name and its preprocessor's picture limit."""
    encoder = config.get("vision_encoder")
    if not isinstance(encoder, dict):
        return None
    vision = dict(encoder.get("config") or {})
    dtype = vision.get("dtype")
    if isinstance(dtype, dict):  # a serialized DTypePolicy
        dtype = (dtype.get("config") or {}).get("name")
    vision["dtype"] = dtype if isinstance(dtype, str) else "float32"
    vision["max_images"] = archs.MAX_IMAGES
    preprocessor = path / "preprocessor.json"
    if preprocessor.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            saved = json.loads(preprocessor.read_text(encoding="utf-8")).get("config", {})
            vision["max_images"] = int(saved.get("max_images_per_prompt", archs.MAX_IMAGES))
    return vision


def _hub_model(handle: str) -> Model:
    """An hf:// repository's architecture, from its config.json in the Hugging Face cache (nothing downloaded)."""
    described = checkpoints.cached_config(handle)
    if described is None:
        raise UserError(
            f"`finetune plan` reads {handle}'s config.json from the Hugging Face cache, and it is not there; "
            f"download it into the cache (hf download {handle.removeprefix('hf://')}) and plan again, or plan a preset name"
        )
    if not checkpoints.is_transformers(described):
        family = presets.family_of(handle)
        return _model(handle, family, described.get("config") or {})
    family = checkpoints.family_of(described, handle)
    return _model(handle, family, checkpoints.backbone_config(described, family))


def _model(name: str, family: str, config: dict, vision_params=0, encoder_params=0, vision=None) -> Model:
    try:
        dims = layouts.Dims.from_backbone_config(config, family)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"preset {name}: its backbone config lacks a usable {e}") from None
    return Model(name, family, dims, config, vision_params, encoder_params, vision)


@dataclass
class Group:
    name: str
    shape: tuple[int, ...]
    copies: int
    """How many variables of this shape: one per decoder block, or 1."""
    layout: str
    bytes_per_device: float
    quantized: bool = False
    """Stored in --quantize's int4 or int8 (layouts.Rule.quantized): a decoder kernel LoRA may target."""


@dataclass
class Plan:
    model: Model
    parameters: int
    data: int
    model_axis: int
    precision: str
    quantize: str | None
    batch_size: int
    seq_len: int
    lora_rank: int
    lora_targets: list[str]
    lora_parameters: int
    groups: list[Group]
    memory: dict[str, float]
    """Bytes per device: weights, lora_weights, lora_gradients, optimizer, activations, logits, total."""
    notes: list[str]
    remat: bool = False
    """Whether each decoder block is recomputed in the backward pass (--remat, or auto's choice)."""
    images: dict | None = None
    """With --images: per_example, tokens_per_image, slots (the pictures each row feeds the encoder), image_size, seen
    (what a slot holds, in words: the square, or with --image-tokens its most patches)."""
    audio: dict | None = None
    """With --audio-seconds: seconds and tokens (the clip's soft tokens)."""
    full: bool = False
    """--full: every decoder weight trains (memory's gradients and optimizer count them all), no LoRA."""
    device_name: str | None = None
    usable: float | None = None
    fits: bool | None = None
    verdict: str = ""


# precision → (bytes of a frozen base weight, bytes of a computed activation). bfloat16 and float16 store
# the base as they compute (backend.POLICIES); mixed_bfloat16 keeps it in float32. LoRA factors, their
# gradients and AdamW's moments are float32 under every precision.
_BYTES = {"float32": (4, 4), "bfloat16": (2, 2), "float16": (2, 2), "mixed_bfloat16": (4, 2)}
_LORA_BYTES = 4
# What a CPU run's process holds besides the model and the step: its backend's framework (a process of ours
# imports no other: backend.leave_out_other_frameworks), Keras and keras-hub, the traced train step, the
# tokenizer and the data. Measured as a user runs it: the peak resident memory of `finetune gemma --preset tiny
# --max-steps 2`, whose model is a few MB, on 2 cores of an AMD EPYC (family 25, model 1), 2026-11-25: 999, 521
# and 706 MiB. (`finetune bench --arch tiny` rows hold about 0.2-0.3 GiB more there: 1.2, 0.8 and 1.0 GB.)
_HOST_RUNTIME = {"tensorflow": 0.98 * GiB, "torch": 0.51 * GiB, "jax": 0.69 * GiB}
# TensorFlow, kept on JAX and PyTorch for keras-hub's Gemma 3, 3n and 4 preprocessors (presets.frameworks_needed):
# tiny-gemma3 peaked 581 MiB above tiny on JAX and 588 on PyTorch, the same run otherwise (same machine and day).
_TENSORFLOW_FOR_PREPROCESSING = 0.57 * GiB
_DIM_NAMES = {"V": "vocabulary", "D": "hidden", "H": "heads", "K": "kv heads", "h": "head dim", "F": "ffw",
              "E": "experts", "I": "expert ffw", "N": "per-layer inputs"}  # fmt: skip


def auto_precision(target: tuple[str, Device] | None, framework: str = "", family: str = "gemma") -> str:
    """What precision `auto` becomes on the device under `framework` for `family`: backend.precision_rule, offline.

    Without a device (`finetune plan` with no --device-memory) the plan assumes a bf16 accelerator.
    """
    return auto_precision_why(target, framework, family)[0]


def auto_precision_why(target: tuple[str, Device] | None, framework: str, family: str) -> tuple[str, str]:
    """(auto_precision, why), as a run on that device decides it (resolve.py)."""
    from finetune.platform import backend

    if target is None:
        return "bfloat16", "name a device to decide"
    overflows = families.get(family).float16_overflows
    return backend.precision_rule(target[1].kind, target[1].bfloat16, framework, overflows)


def make(cfg: Config, devices: int | None = None, target: tuple[str, Device] | None = None) -> Plan:
    """The per-device memory plan of the run `cfg` describes on `devices` devices of kind `target`.

    --remat auto is decided here as a run decides it: on when the plan without it does not fit the device.
    """
    if cfg.model.remat != "auto":
        return _make(cfg, devices, target, remat=cfg.model.remat == "on")
    without = _make(cfg, devices, target, remat=False)
    if target is None or without.fits:
        without.notes.append("remat auto: off" + (f" (fits {target[0]} without it)" if target else ""))
        return without
    planned = _make(cfg, devices, target, remat=True)
    planned.notes.append(f"remat auto: on; without it the run needs {_size(without.memory['total'])}")
    return planned


def remat_for(cfg: Config, device: str, memory: int | None) -> tuple[bool, str]:
    """What a run's --remat becomes, and why: auto asks the plan whether the run fits `memory` without it.

    cfg: the run's config with its precision decided (resolve.py); device: cpu, gpu or tpu; memory: bytes of
    one device, None where the framework does not say (then auto is off).
    """
    if cfg.model.remat != "auto":
        return cfg.model.remat == "on", "set"
    if memory is None:
        return False, f"auto: the {device}'s memory is unknown (pass --remat on if the run runs out of it)"
    # `memory` is what the framework reports, the fraction already applied
    whole = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, xla_mem_fraction=1.0))
    kind = Device(memory, cfg.model.precision == "bfloat16", f"this {device}", device)
    devices = None if cfg.distribution.parallel == "none" else _device_count(cfg)
    try:
        planned = make(whole, devices, (device, kind))
    except UserError as e:  # no architecture table for this preset: train as it is
        return False, f"auto: no plan ({e})"
    return planned.remat, "auto: " + next(n for n in planned.notes if n.startswith("remat auto")).removeprefix(
        "remat auto: "
    )


def _device_count(cfg: Config) -> int | None:
    """The devices a distributed run spreads over, when no --mesh names them (keras is loaded by then)."""
    if cfg.distribution.mesh:
        return None
    import keras

    return len(keras.distribution.list_devices())


def _make(cfg: Config, devices: int | None, target: tuple[str, Device] | None, remat: bool) -> Plan:
    model = model_of(cfg.model.preset)
    why = families.get(model.family).no_quantize if cfg.model.quantize else None
    if why:  # the plan promises nothing a run refuses (builder.build refuses it the same way)
        raise UserError(f"--quantize {cfg.model.quantize} is not for {families.get(model.family).title} yet: {why}")
    families.get(model.family).check_image_tokens(cfg.data.image_tokens)
    data, model_size = _mesh(cfg, devices)
    placements = layouts.place(model.dims, model_size)  # a UserError naming the kernel when indivisible
    notes: list[str] = []
    precision = cfg.model.precision
    if precision == "auto":
        precision, why = auto_precision_why(target, cfg.backend, model.family)
        if cfg.model.full:  # as resolve decides it: every trained weight stays float32
            precision, why = full_weights_precision(precision, why)
        if target is None:
            notes.append(f"precision auto is {precision} ({why})")
        elif precision == "float32" and families.get(model.family).float16_overflows:
            notes.append(f"precision auto is {precision} on {target[0]} ({why.removeprefix('auto: ')})")
        else:
            notes.append(f"precision auto is {precision} on {target[0]}")
    elif precision == "float16" and families.get(model.family).float16_overflows:
        notes.append(f"warning: --precision float16: {families.get(model.family).float16_overflows}")
    batch = cfg.train.batch_size
    if batch is None:  # the run's own choice, made to split over the data axis as the run makes it
        batch, fitted = layouts.fit_default_batch(DEFAULT_BATCH_SIZE[cfg.backend], data)
        notes += [fitted] if fitted else []
    kernels = [p for p in placements if p.shape]
    groups = _weight_groups(model, kernels, precision, cfg.model.quantize, model_size)
    summed = cfg.train.grad_accum > 1  # --grad-accum keeps a sum of the micro-batches' gradients, a row of its own
    accumulated = 2 + summed  # AdamW's two moments, and the sum: the new token rows' bytes below
    if cfg.model.full:
        # Every decoder weight trains (its encoders stay frozen), in float32 (the precision keeps it so): a
        # gradient and AdamW's moments for each, sharded as the weight is (data parallel replicates them).
        lora = 0
        trained = sum(g.bytes_per_device for g in groups if g.name not in _ENCODERS)
        memory = {"weights": sum(g.bytes_per_device for g in groups), "gradients": trained,
                  "optimizer": 2 * trained}  # fmt: skip
    else:
        lora = _lora_parameters(model, kernels, cfg.lora.targets, cfg.lora.rank, cfg.lora.dora)
        memory = {
            "weights": sum(g.bytes_per_device for g in groups),
            # LoRA factors are replicated (layouts.RULES), their gradients too, and AdamW keeps two moments each,
            # and with --grad-accum a sum of the gradients. Activations below are one micro-batch's.
            "lora_weights": lora * _LORA_BYTES,
            "lora_gradients": lora * _LORA_BYTES,
            "optimizer": 2 * lora * _LORA_BYTES,
        }
        added = len(cfg.model.add_tokens or ()) * model.dims.hidden_dim  # --add-tokens: their rows train too
        if added:
            memory["new_token_rows"] = (2 + accumulated) * added * _LORA_BYTES  # weights, gradients, moments
            notes.append(f"--add-tokens: {len(cfg.model.add_tokens)} new embedding rows ({added:,} weights) train "
                         "beside LoRA, in float32")  # fmt: skip
    if summed:  # the size of the gradients it sums
        memory["gradient_sum"] = memory["gradients" if cfg.model.full else "lora_gradients"]
    per_device = _batch_per_device(batch, data, notes)  # one row per device for auto, then _largest_batch
    seq_len = cfg.model.seq_len
    per_sequence = _activations_per_sequence(model, kernels, seq_len, precision, model_size)
    if remat:  # each block keeps its input; one block's activations exist at a time, in its backward
        kept = model.dims.num_layers * seq_len * model.dims.hidden_dim * _BYTES[precision][1]
        per_sequence = kept + per_sequence / model.dims.num_layers
    routed = _routed_experts(cfg, target, data * model_size)
    experts, note = _expert_activations_per_sequence(model, kernels, seq_len, precision, model_size, routed)
    notes += [note] if note else []
    # The batch counts the method's examples (a preference pair is two sequences, chosen and rejected), or rows
    # of seq_len where they are packed.
    method = registry.get(cfg.train.method)
    packed = _packed(cfg, model, method)
    sequences = method.sequences_per_entry(packed, cfg.train)
    note = method.plan_note(cfg, packed)
    if note:
        notes.append(note)
    memory["activations"] = (
        sequences * per_device * (per_sequence + (experts / model.dims.num_layers if remat else experts))
    )
    memory["dequantized_kernel"] = _dequantized_kernel(groups, cfg.model.quantize, _BYTES[precision][1])
    memory["logits"] = _logits(model, kernels, precision, model_size, cfg.backend)
    transient = method.plan_transient(cfg, model.dims, _BYTES[precision][1], per_device, cfg.backend)
    beyond = sum(transient.values()) - memory["activations"] - memory["logits"]
    if beyond > 0:  # held at a time of its own: what exceeds the step's own peak
        memory["rollout"] = beyond
        parts = ", ".join(f"{name.replace('_', ' ')} {_size(value)}" for name, value in transient.items())
        notes.append(f"the rollout's sampling ({parts}) exceeds the step's activations and logits: its peak is "
                     "the run's")  # fmt: skip
    # Each sequence's row carries its pictures and clips: a pair's two rows each hold its prompt's.
    heard = _audio(model, cfg, precision, notes)
    if heard:
        memory["audio_frames"] = sequences * per_device * heard.pop("frames_per_row")
        memory["audio_forward"] = sequences * per_device * heard.pop("forward_per_row")
    pictured = _pictures(model, cfg, precision, notes)
    if pictured:
        memory["image_pixels"] = sequences * per_device * pictured.pop("pixels_per_row")
        memory["vision_forward"] = sequences * per_device * pictured.pop("forward_per_row")
    if target is not None and target[1].kind == "cpu":
        memory["runtime"] = _HOST_RUNTIME[cfg.backend]
        if cfg.backend != "tensorflow" and "tensorflow" in presets.frameworks_needed(cfg.model.preset):
            memory["tensorflow_preprocessing"] = _TENSORFLOW_FOR_PREPROCESSING
        # Measured, cause not yet found: TensorFlow's step on a CPU peaks about one token embedding's bytes
        # above what the rest counts (gemma-2b dims 1.0 GiB, gemma-7b int4 1.9 GiB; BENCHMARKS.md). Neither a
        # transposed copy for the logits nor the embedding lookup makes it.
        if cfg.backend == "tensorflow":
            memory["tensorflow_step"] = sum(g.bytes_per_device for g in groups if g.name == "embedding")
    memory["total"] = _total(memory)
    plan = Plan(
        model=model,
        parameters=_parameters(model, notes),
        data=data,
        model_axis=model_size,
        precision=precision,
        quantize=cfg.model.quantize,
        batch_size=per_device * data if cfg.train.batch_size == "auto" else batch,
        seq_len=cfg.model.seq_len,
        lora_rank=cfg.lora.rank,
        lora_targets=list(cfg.lora.targets),
        lora_parameters=lora,
        groups=groups,
        memory=memory,
        notes=notes + [p.rule.group + ": " + p.note for p in kernels if p.note.startswith("dimension")],
        remat=remat,
        images=pictured,
        audio=heard,
        full=cfg.model.full,
    )
    if target is not None:
        _judge(plan, target, cfg)
        if cfg.model.full and not plan.fits:
            plan.verdict += f"; {_lora_instead(cfg, devices, target)}"
        if cfg.train.batch_size == "auto":
            _largest_batch(plan)
    elif cfg.train.batch_size == "auto":
        plan.notes.append("batch auto: planned at one sequence per device; --device-memory finds the largest that fits")
    return plan


_ENCODERS = ("vision encoder", "audio encoder")
"""The weight groups a --full run leaves frozen (builder.train_every_weight)."""


def _lora_instead(cfg: Config, devices: int | None, target: tuple[str, Device]) -> str:
    """A --full plan that does not fit: what the same run needs with LoRA (the run's default rank and targets)."""
    lora = make(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, full=False)), devices, target)
    fits = "fits" if lora.fits else "does not fit either"
    return (f"drop --full: LoRA r{lora.lora_rank} on {','.join(lora.lora_targets)} needs "
            f"{_size(lora.memory['total'])} ({fits})")  # fmt: skip


def check_full_fits(cfg: Config, device: str, memory: int | None) -> None:
    """Refuse a --full run the plan says cannot fit one device's `memory` (with --remat auto's choice), with the
    reason and what LoRA needs instead; nothing to say where the memory is unknown or the preset has no plan.

    cfg: the run's config with its precision decided (resolve.py); device: cpu, gpu or tpu.
    """
    if not cfg.model.full or memory is None:
        return
    whole = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, xla_mem_fraction=1.0))
    kind = Device(memory, cfg.model.precision == "mixed_bfloat16", f"this {device}", device)
    devices = None if cfg.distribution.parallel == "none" else _device_count(cfg)
    try:
        planned = make(whole, devices, (device, kind))
    except UserError:  # no architecture table for this preset: train as it is
        return
    if planned.fits is False and planned.memory["total"] > memory:
        raise UserError(f"--full {planned.verdict.removeprefix('does not fit: ')}")


def _packed(cfg: Config, model: Model, method) -> bool:
    """Whether the run would pack its rows, as resolve.packing decides on the built model: not with --packing off,
    nor for a method whose rows cannot pack, nor on pictures, audio or a model with an encoder (keras-hub's own
    mask); every text decoder finetune builds takes the per-example mask."""
    if cfg.data.packing == "off" or method.unpacked_why() is not None:
        return False
    return model.vision is None and model.audio is None and not cfg.data.images and not cfg.data.audio_seconds


# What the decoder's pass holds at its peak, the start of the backward; the rest is held throughout.
_DECODER_PASS = ("activations", "logits", "dequantized_kernel")


def _audio(model: Model, cfg: Config, precision: str, notes: list[str]) -> dict | None:
    """--audio-seconds S: a clip's place in each sequence, and what feeding it costs per row; None without audio.

    Gemma 4 gives a clip one soft token per 4 of its 10 ms mel frames (25 a second), between <|audio> and <audio|>
    (audio.py, as keras-hub's Gemma4CausalLMPreprocessor writes it): they take their room out of --seq-len. Every
    clip is converted to the converter's whole length (its max_audio_length), the frames past the clip masked.
    Gemma 3n gives every clip a fixed count (`tokens`), with a blank line either side, and converts its own frames.
    """
    seconds = cfg.data.audio_seconds
    if not seconds:
        return None
    heard = model.audio
    if heard is None:
        why = "whose weights and pass the plan does not count yet" if model.encoder_params else "it has none"
        raise UserError(f"--audio-seconds {seconds:g}: {model.name}'s audio encoder ({why}); plan a preset that "
                        "hears: tiny-gemma4-audio, tiny-gemma3n-audio")  # fmt: skip
    fixed = heard.get("tokens")
    longest = float(heard["converter"].get("max_audio_length", 30))
    if seconds > longest:
        raise UserError(f"--audio-seconds {seconds:g}: {model.name} hears at most {longest:g} s a clip")
    tokens = fixed or max(1, (int(seconds * 100) + 3) // 4)
    spent = tokens + (4 if fixed else 2)
    if spent >= cfg.model.seq_len:
        raise UserError(f"--audio-seconds {seconds:g} takes {spent} tokens ({tokens} soft tokens and its markers), "
                        f"--seq-len {cfg.model.seq_len} leaves no room for text; raise --seq-len")  # fmt: skip
    frames = int((seconds if fixed else longest) * 100)
    compute = _BYTES[precision][1]
    notes.append(f"audio: a clip of {seconds:g} s, {tokens} soft tokens: {spent} of the {cfg.model.seq_len} tokens "
                 f"with its markers, {cfg.model.seq_len - spent} left for the text")  # fmt: skip
    # The frozen encoder's pass: its conformer blocks over a quarter of the frames, a few widths at a time, and
    # their chunked attention; small beside the decoder's at Gemma 4's sizes. An estimate from the layout.
    forward = 8 * (frames // 4) * int(heard["hidden_size"]) * compute
    return dict(seconds=seconds, tokens=tokens, frames_per_row=frames * int(heard["input_feat_size"]) * 4 * 2,
                forward_per_row=forward)  # fmt: skip


def _total(memory: dict[str, float]) -> float:
    """The peak: what is held throughout, plus the larger of the vision encoder's forward pass and the decoder's.

    The encoder runs first and lets go before the decoder starts: it is frozen and its input (the pixels) takes
    no gradient, so autodiff keeps nothing of its pass for the backward but its output, the soft tokens' embeddings.
    """
    passes = (*_DECODER_PASS, "vision_forward", "audio_forward", "total")
    held = sum(v for k, v in memory.items() if k not in passes)
    encoders = max(memory.get("vision_forward", 0.0), memory.get("audio_forward", 0.0))
    return held + max(encoders, sum(memory.get(k, 0.0) for k in _DECODER_PASS))


def _pictures(model: Model, cfg: Config, precision: str, notes: list[str]) -> dict | None:
    """--images N: the pictures' place in each sequence, and what feeding them costs per row; None for text.

    Each picture becomes tokens_per_image soft tokens between <start_of_image> and <end_of_image>, with a blank
    line either side (images.py, as keras-hub's Gemma3CausalLMPreprocessor writes it): they take their room
    out of --seq-len, and a record's text is cut to the rest. A run feeds every row as many image slots as the
    data's most pictured record holds (N), blank ones beside a row's fewer pictures, and the encoder encodes them.
    """
    count = cfg.data.images or 0
    budget = cfg.data.image_tokens
    if not count:
        return None
    vision = model.vision
    if vision is None:
        planned = "gemma3_4b, gemma3_12b, gemma3_27b, tiny-gemma3-vision, tiny-gemma4-vision or tiny-gemma3n-vision"
        if model.encoder_params:
            raise UserError(f"--images {count}: a run on pictures loads {model.name}'s image encoder, whose weights "
                            f"and pass the plan does not count yet; the plan counts {planned}")  # fmt: skip
        raise UserError(f"--images {count}: {model.name} does not see pictures (it has no vision encoder); plan a preset that "
                        f"does: {planned}")  # fmt: skip
    convolutional = vision.get("encoder") == "mobilenetv5"
    own = int(vision["tokens_per_image"]) if convolutional else archs.tokens_per_image(vision)
    most, tokens = int(vision["max_images"]), budget or own
    if count > most:
        raise UserError(f"--images {count}: {model.name} takes at most {most} pictures an example "
                        "(keras-hub's max_images_per_prompt)")  # fmt: skip
    markers = _IMAGE_MARKERS.get(model.family, _IMAGE_MARKERS["gemma3"])
    spent = count * (tokens + markers)
    if spent >= cfg.model.seq_len:
        raise UserError(
            f"--images {count} take {spent} tokens ({tokens} soft tokens and {markers} markers each), "
            f"--seq-len {cfg.model.seq_len} leaves no room for text; raise --seq-len"
        )
    size, slots = int(vision["image_size"]), count
    compute = {"float32": 4, None: _BYTES[precision][1]}.get(vision.get("dtype"), 2)
    if convolutional:
        patches, forward = size * size, _convolution_forward_per_image(vision, compute)
        pixels = slots * patches * 3 * 4  # float32, as images.pixels converts them
    else:
        # Gemma 4's converter resizes a picture to at most --image-tokens x pool² patches, and pads it to them.
        patches = budget * int(vision["pool_size"]) ** 2 if budget else archs.patches_per_image(vision)
        pixels = slots * patches * int(vision["patch_size"]) ** 2 * 3 * 4
        forward = _vision_forward_per_image(vision, compute, cfg.backend, patches)
    notes.append(f"images: {count} an example, {tokens} soft tokens each: {spent} of the {cfg.model.seq_len} "
                 f"tokens with their markers, {cfg.model.seq_len - spent} left for the text (a longer record is cut)")  # fmt: skip
    notes.append(
        f"images: the frozen vision encoder encodes {slots} image slot(s) a row, {patches} "
        f"{'pixels' if convolutional else 'patches'} each; its forward "
        "pass is let go before the decoder's, so the total counts the larger"
    )
    notes.append(f"images: a run holds each record's converted pixels in host memory twice, in its example and its "
                 f"row: {_size(2 * pixels)} a record")  # fmt: skip
    seen = f"up to {patches} patches" if budget else f"{size}x{size}"
    return dict(per_example=count, tokens_per_image=tokens, slots=slots, image_size=size, seen=seen, pixels_per_row=pixels,
                forward_per_row=slots * forward)  # fmt: skip


# The tokens around a picture's soft tokens (images.py): Gemma 3's <start_of_image>, <end_of_image> and a blank line
# either side (its tokenizer has "\n\n" as one piece); Gemma 4's <|image> and <image|> alone.
_IMAGE_MARKERS = {"gemma3": 4, "gemma3n": 4, "gemma4": 2}


def _convolution_forward_per_image(vision: dict, compute: int) -> float:
    """Bytes a frozen MobileNetV5 pass (Gemma 3n's image encoder) holds at its peak for one picture: a block's input,
    its expanded map and its output at the stem's resolution (half the picture's side), at the widest channels
    of the early stages, four times them in all. An estimate from the layout, not measured at Gemma 3n's size."""
    side = int(vision["image_size"]) // 2
    return 4 * side * side * max(int(vision["stem_size"]), int(vision["widest"])) * compute


def _vision_forward_per_image(vision: dict, compute: int, framework: str, patches: int) -> float:
    """Bytes Gemma3VisionEncoder's forward pass holds at its peak for one picture, in its compute dtype.

    Inside a block's attention: the scores, heads x patches², and their softmax, which PyTorch and TensorFlow
    make beside them, and XLA in their buffer (JAX on a CPU: XLA's compiled step held 1.0x one copy for
    tiny-gemma3-vision widened to 256 patches, tests/test_plan.py); beside them the block's input, its
    norm and q, k, v (5 x patches x width). The MLP's (patches x intermediate, twice) is the peak instead where it
    is larger. Nothing is kept from one block to the next: the encoder is frozen and the pixels take no gradient,
    so autodiff records none of its pass.
    """
    attention = (1 if framework == "jax" else 2) * int(vision["num_heads"]) * patches**2
    mlp = 2 * patches * int(vision["intermediate_dim"])
    return (max(attention, mlp) + 5 * patches * int(vision["hidden_dim"])) * compute


def _mesh(cfg: Config, devices: int | None) -> tuple[int, int]:
    parallel, mesh = cfg.distribution.parallel, cfg.distribution.mesh
    if parallel == "none":
        if devices not in (None, 1):
            raise UserError(f"--devices {devices} needs --parallel data or --parallel model; none uses one device")
        return 1, 1
    if devices is None and mesh is None:
        raise UserError(
            f"--parallel {parallel} plans over how many devices? pass --mesh DxM (or --devices N to `finetune plan`)"
        )
    if devices is not None and devices < 1:
        raise UserError(f"--devices must be at least 1, got {devices}")
    return layouts.parse_mesh(mesh, parallel, devices)


def _weight_groups(model: Model, kernels, precision: str, quantize: str | None, model_size: int) -> list[Group]:
    variable_bytes = _BYTES[precision][0]
    groups = []
    for p in kernels:
        copies = p.copies
        count = math.prod(p.shape) * copies
        quantized = bool(quantize) and p.rule.quantized  # as quantized.policies stores it
        size = count * (_quantized(quantize) if quantized else variable_bytes)
        sharded = layouts.MODEL_AXIS in p.axes
        if sharded:
            size /= model_size
            dim = p.axes.index(layouts.MODEL_AXIS)
            layout = f"model on {_DIM_NAMES[p.rule.shape_of.split(',')[dim]]}"
        else:
            layout = "replicated"
        groups.append(Group(p.rule.group, p.shape, copies, layout, size, quantized))
    norms = archs.small_weights(model.config, model.family)
    groups.append(Group("norm scales", (norms,), 1, "replicated", norms * variable_bytes))
    if model.vision_params:
        # keras-hub builds the image encoder in float32 when the model is bfloat16; it is not quantized.
        per = max(variable_bytes, 4)
        groups.append(Group("vision encoder", (model.vision_params,), 1, "replicated", model.vision_params * per))
    if model.audio_params:
        per = max(variable_bytes, 4)  # built in float32 too (presets.tiny_backbone)
        groups.append(Group("audio encoder", (model.audio_params,), 1, "replicated", model.audio_params * per))
    return groups


def _quantized(mode: str) -> float:
    """Bytes per weight of a quantized kernel (quantized.py): int4 packs two a byte, with a float32 scale and an
    int8 zero point per group of 128 input rows and output column; int8 is a byte, with a scale per column."""
    return 0.5 + 5 / 128 if mode == "int4" else 1.0


def _dequantized_kernel(groups: list[Group], quantize: str | None, compute: int) -> float:
    """A quantized base's dequantization at its largest: one decoder kernel's, unpacked (a byte a weight, int4),
    its float steps and the cast to the compute dtype (`compute` bytes a weight), about 1 + 3 x compute bytes a
    weight. One kernel at a time: each layer dequantizes when its input arrives and lets go
    (quantized.lean_projection). keras' own call kept every kernel dequantized for the backward: gemma-7b int4
    asked XLA for one 34.4 GiB buffer so."""
    if quantize is None:
        return 0.0
    weights = max((g.bytes_per_device / g.copies / _quantized(quantize) for g in groups if g.quantized), default=0.0)
    return weights * ((1 if quantize == "int4" else 0) + 3 * compute)


def _lora_parameters(model: Model, kernels, targets: list[str], rank: int, dora: bool = False) -> int:
    """LoRA weights: A is the kernel's shape with its last axis replaced by the rank, B is (rank, last axis); with
    DoRA, a magnitude for each of the kernel's outputs beside them (_outputs). An expert bank's tensors (experts,
    in, out) take A (experts, in, rank) and B (experts, rank, out) (experts.py)."""
    family = families.get(model.family)
    own_names = {layer: target for target, layer in family.layers.items()}  # Gemma 3n's q_proj is query
    if family.experts:
        own_names[family.experts] = families.EXPERTS
    adaptable = list(dict.fromkeys(p.rule.target for p in kernels if p.rule.target))
    total = 0
    adaptable_targets = [t for t in families.TARGETS if t in adaptable]
    for target in dict.fromkeys(own_names.get(t, t) for t in families.spelled_out(targets, adaptable_targets)):
        if target == families.EXPERTS and target not in adaptable:
            raise UserError(family.without_experts(model.name))
        if target not in adaptable:
            why = family.frozen_reason(family.layer_of(target))
            raise UserError(
                f"{family.title}'s {target!r} layers stay frozen: {why}; LoRA adapts {', '.join(adaptable)}"
                if why
                else f"unknown LoRA target {target!r}; {family.title}'s adaptable layers are {', '.join(adaptable)}"
            )
        for p in kernels:
            if p.rule.target == target == families.EXPERTS:  # (experts, in, out): each expert's own A and B
                experts, inputs, outputs = p.shape
                total += p.copies * experts * (inputs * rank + rank * outputs)
            elif p.rule.target == target:
                factors = math.prod(p.shape[:-1]) * rank + rank * p.shape[-1]
                total += p.copies * (factors + (_outputs(p) if dora else 0))
    return total


def _outputs(kernel) -> int:
    """A kernel's outputs: its shape without the axis it sums over, the hidden one (D) of a kernel that reads the
    residual stream (query H,D,h gives H*h), or, for one that writes it (attention_output H,h,D, ffw_linear F,D),
    its last."""
    symbols = kernel.rule.shape_of.split(",") if kernel.rule.shape_of else []
    if len(symbols) == len(kernel.shape) and "D" in symbols[:-1]:
        return math.prod(kernel.shape) // kernel.shape[symbols.index("D")]
    return kernel.shape[-1]


def _parameters(model: Model, notes: list[str]) -> int:
    """The preset's weights, as keras-hub counts them; a note when its encoders are left out of the run."""
    loaded = archs.parameter_count(model.config, model.family, model.vision_params + model.audio_params)
    if model.encoder_params:
        notes.append(
            f"its image and audio encoders ({model.encoder_params / 1e9:.2f}B weights) are not loaded: "
            f"finetune trains the {loaded / 1e9:.2f}B-weight text decoder"
        )
    return loaded + model.encoder_params


def _routed_experts(cfg: Config, target: tuple[str, Device] | None, devices: int) -> tuple[bool, str]:
    """What a run on `target` (without one, an accelerator) does with a mixture-of-experts bank, as the run decides
    it (builder.routed_experts): (whether each token computes its k experts alone, why)."""
    from finetune.platform import backend

    return backend.routed_experts_rule(cfg.backend, target[1].kind if target else "gpu", devices)


def _expert_activations_per_sequence(model: Model, kernels, seq_len: int, precision: str, model_size: int,
                                     routed: tuple[bool, str]) -> tuple[float, str]:  # fmt: skip
    """(bytes a Gemma 4 mixture-of-experts layer keeps per sequence beyond the dense FFW's, the plan's note on
    them; 0 and no note for a model without experts).

    The router picks num_experts_per_token (k) of num_experts (E) for each
    token. keras-hub's expert bank (Gemma4MoEBlock), the dense dispatch, runs
    every expert on every token as one batched matmul and zeroes the others in
    the combine, so what the backward pass keeps scales with all E experts: per
    token and expert the gate, up, activated gate and product (4·I) and the
    expert's output and its scaled and weighted copies (3·D). Sharded on the
    experts axis, each device holds its experts' share. The routed dispatch
    (JAX on one TPU, experts.routed) keeps the same per token and expert
    for the k it computes, plus each pair's gathered input (D). Both keep the
    router's probabilities (float32) and the MoE path's input norm.
    """
    config = model.config
    if not config.get("enable_moe_block"):
        return 0.0, ""
    compute = _BYTES[precision][1]
    experts, active = int(config["num_experts"]), int(config.get("num_experts_per_token") or 8)
    inner, hidden = int(config["expert_intermediate_dim"]), model.dims.hidden_dim
    split = _split(kernels, "experts gate", "E", model_size)
    shared = experts * 4 * 2 + 2 * hidden * compute
    dense = experts * (4 * inner + 3 * hidden) * compute / split
    layers_tokens = model.dims.num_layers * seq_len
    if not routed[0]:
        note = (
            f"experts: {active} of {experts} route each token, but {routed[1]}; the activations count what it computes"
        )
        return layers_tokens * (dense + shared), note
    kept = active * (4 * inner + 4 * hidden) * compute
    note = (
        f"experts: {active} of {experts} route each token, and each token computes its {active} alone (a grouped "
        f"matmul, JAX on one TPU): {experts / active:.0f}x fewer expert FLOPs than keras-hub's dense "
        f"dispatch, and {_size(seq_len * (dense - kept))} less activation memory a layer and sequence"
    )
    return layers_tokens * (kept + shared), note


def _batch_per_device(batch: int | str, data: int, notes: list[str]) -> int:
    if batch == "auto":
        return 1
    layouts.check_batch(batch, data)  # the run refuses an uneven split, so the plan does too
    return batch // data


def _split(kernels, group: str, symbol: str, model_size: int) -> int:
    """How many ways activations along `symbol` are split: the model axis size when `group`'s kernel is sharded on it."""
    placement = next(p for p in kernels if p.rule.group == group)
    names = placement.rule.shape_of.split(",")
    sharded = layouts.MODEL_AXIS in placement.axes and names[placement.axes.index(layouts.MODEL_AXIS)] == symbol
    return model_size if sharded else 1


def _activations_per_sequence(model: Model, kernels, seq_len: int, precision: str, model_size: int) -> float:
    """Bytes the backward pass keeps from one sequence's forward pass.

    Per decoder block and token, in the compute dtype: the block's input, the
    two pre-norm outputs and the attention residual (4·D, one more each for
    Gemma 2 and 3's post-norms); q, k and v as projected and q, k again after
    RoPE ((2H + 3K)·h, counted as 3H·h + 3K·h); the attention result (in the
    3H·h); and the FFW's gate, up, activated gate and product (4·F). Per block
    and sequence, H·S² attention scores as computed, masked and normalised, in
    float32 (keras-hub's softmax is float32: 3 × 4 bytes), and under bfloat16
    compute their compute-dtype logits and probabilities too (2 × 2 bytes). The
    embedding output and the final norm add 2·D per token. Heads and FFW width
    are split over the model axis when their kernels are; the hidden width is
    whole on every device.

    Checked against XLA's memory analysis of the compiled train step (JAX, CPU,
    float32, cpu-small dims, LoRA rank 4 on query and value): activations and
    logits came to 84% of its temporaries at vocabulary 4,096, batch 8 × 512
    (1,540 of 1,838 MiB), and 103% at vocabulary 65,536, batch 4 × 256 (1,033
    of 1,002 MiB). Not yet checked on a GPU or TPU, where fused attention
    would keep far less than H·S².
    """
    d = model.dims
    compute = _BYTES[precision][1]
    heads = _split(kernels, "query", "H", model_size)
    kv_heads = _split(kernels, "key", "K", model_size)
    ffw = _split(kernels, "ffw_gating", "F", model_size)
    post_norms = sum(1 for k in ("use_post_attention_norm", "use_post_ffw_norm") if model.config.get(k))
    per_token = (
        (4 + post_norms) * d.hidden_dim
        + 3 * d.num_query_heads * d.head_dim / heads
        + 3 * d.num_key_value_heads * d.head_dim / kv_heads
        + 4 * d.ffw_dim / ffw
    ) * compute
    per_score = 3 * 4 + (2 * compute if compute != 4 else 0)
    scores = d.num_query_heads * seq_len**2 * per_score / heads
    return d.num_layers * (seq_len * per_token + scores) + seq_len * 2 * d.hidden_dim * compute


def _logits(model: Model, kernels, precision: str, model_size: int, backend: str) -> float:
    """Bytes of the loss's vocabulary projection: one chunk of positions at a time (objective.py).

    XLA fuses the chunk's softmax into its float32 logits, so JAX holds one buffer of them (its compiled
    train step's temporaries on a CPU: 26 MiB beyond the activations for a 32 MiB chunk); PyTorch makes the
    softmax and its gradient in the logits' buffer and holds a copy in the compute dtype; TensorFlow holds the
    logits, their softmax and that copy. Split when the vocabulary is.
    """
    from finetune.platform.backend import loss_chunk

    vocabulary = model.dims.vocabulary_size / _split(kernels, "embedding", "V", model_size)
    per_logit = {"jax": 4, "torch": 4 + _BYTES[precision][1]}.get(backend, 4 + 4 + _BYTES[precision][1])
    return loss_chunk(model.dims.vocabulary_size) * vocabulary * per_logit


def _judge(plan: Plan, target: tuple[str, Device], cfg: Config) -> None:
    name, found = target
    usable = found.memory * (cfg.train.xla_mem_fraction if cfg.backend == "jax" and found.kind != "cpu" else 1.0)
    total = plan.memory["total"]
    plan.device_name, plan.usable = name, usable
    plan.fits = total <= usable * (1 - HEADROOM)
    if plan.fits:
        plan.verdict = f"fits: {_size(usable - total)} spare of {_size(usable)} on each {name}"
    elif total <= usable:
        plan.verdict = (
            f"tight: {_size(total)} of {_size(usable)} on each {name} leaves under {HEADROOM:.0%} for the "
            f"runtime's workspace; {_advice(plan)}"
        )
    else:
        plan.verdict = f"does not fit: {_size(total)} needed, {_size(usable)} on each {name}; {_advice(plan)}"


def _advice(plan: Plan) -> str:
    m = plan.memory
    if plan.full and m["weights"] + m["gradients"] + m["optimizer"] + m.get("gradient_sum", 0) > 0.5 * m["total"]:
        return "the trained weights, their gradients and AdamW's moments dominate (16 bytes a weight)"
    if m["weights"] > 0.5 * m["total"]:
        return "the weights dominate: shard them (--parallel model, a larger model axis) or use --quantize int4"
    if m.get("vision_forward", 0.0) > m["activations"] + m["logits"]:
        slots = plan.images["slots"] if plan.images else 0
        return f"the vision encoder's pass dominates ({slots} pictures a row): lower --batch-size, or spread the batch"
    return "the activations and logits dominate: lower --batch-size or --seq-len, or spread the batch (--parallel data)"


def _largest_batch(plan: Plan) -> None:
    """For --batch-size auto: the largest batch whose plan fits, in steps of the data axis."""
    m = plan.memory
    rows_scale = ("activations", "image_pixels", "vision_forward", "total")
    fixed = sum(v for k, v in m.items() if k not in rows_scale)  # the loss's logits too: one chunk of positions
    # planned at one row per device; a row's pictures are fed, then encoded before the decoder's pass
    per_row = m.get("image_pixels", 0.0) + max(m.get("vision_forward", 0.0), m["activations"])
    room = plan.usable * (1 - HEADROOM) - fixed
    rows = int(room // per_row) if per_row > 0 and room > 0 else 0
    plan.notes.append(
        f"batch auto: up to {rows * plan.data} sequences per step fit ({rows} per device)"
        if rows
        else "batch auto: not even one sequence per device fits"
    )


def _size(count: float) -> str:
    return f"{count / GiB:.2f} GiB" if count >= GiB / 10 else f"{count / 2**20:.1f} MiB"


def as_dict(plan: Plan) -> dict:
    """The plan for machines (`finetune plan --json`); sizes in bytes per device."""
    return {
        "preset": plan.model.name,
        "family": plan.model.family,
        "parameters": plan.parameters,
        "mesh": {"data": plan.data, "model": plan.model_axis, "devices": plan.data * plan.model_axis},
        "precision": plan.precision,
        "quantize": plan.quantize,
        "batch_size": plan.batch_size,
        "seq_len": plan.seq_len,
        "full": plan.full,
        "lora": None
        if plan.full
        else {"rank": plan.lora_rank, "targets": plan.lora_targets, "parameters": plan.lora_parameters},
        "groups": [
            {
                "group": g.name,
                "shape": list(g.shape),
                "copies": g.copies,
                "layout": g.layout,
                "bytes_per_device": round(g.bytes_per_device),
            }
            for g in plan.groups
        ],
        "bytes_per_device": {k: round(v) for k, v in plan.memory.items()},
        "remat": plan.remat,
        "images": plan.images,
        "device": plan.device_name,
        "usable_bytes": None if plan.usable is None else round(plan.usable),
        "fits": plan.fits,
        "verdict": plan.verdict,
        "notes": plan.notes,
    }


_ROWS = {
    "weights": "weights (frozen base)",
    "lora_weights": "LoRA weights",
    "lora_gradients": "LoRA gradients",
    "gradients": "gradients (every weight)",
    "optimizer": "AdamW moments",
    "gradient_sum": "gradient sum (--grad-accum)",
    "new_token_rows": "new token rows, trained",
    "activations": "activations",
    "dequantized_kernel": "one kernel dequantized",
    "logits": "logits, one chunk",
    "rollout": "rollout sampling, beyond the step",
    "image_pixels": "pictures, the batch's",
    "vision_forward": "vision encoder, forward",
    "audio_frames": "audio, log-mel frames",
    "audio_forward": "audio encoder, forward",
    "runtime": "framework runtime (host)",
    "tensorflow_step": "TensorFlow's step, measured",
    "tensorflow_preprocessing": "TensorFlow, for keras-hub's preprocessor (host)",
}


def table(plan: Plan) -> str:
    """The plan for people: the mesh, each variable group's layout and bytes, the memory per device, the verdict."""
    variable_bytes, compute_bytes = _BYTES[plan.precision]
    devices = plan.data * plan.model_axis
    rows_per_device = math.ceil(plan.batch_size / plan.data)
    lines = [
        f"{plan.model.name}: {plan.model.family}, {plan.parameters / 1e9:.2f}B parameters",
        f"mesh {plan.data}x{plan.model_axis}: {plan.data} data x {plan.model_axis} model, "
        f"{devices} device{'s' if devices > 1 else ''}",
        f"precision {plan.precision}: base stored in {_dtype(plan.precision, variable_bytes)}, computed in "
        f"{_dtype(plan.precision, compute_bytes)}"
        + ("" if plan.full else ", LoRA in float32")
        + (f"; decoder kernels quantized to {plan.quantize}" if plan.quantize else "")
        + ("; blocks recomputed in the backward (remat)" if plan.remat else ""),
        f"batch {plan.batch_size} ({rows_per_device} per device) x seq {plan.seq_len}; "
        + (
            "every weight trains (--full): its gradients and AdamW's moments in float32"
            if plan.full
            else f"LoRA rank {plan.lora_rank} on {', '.join(plan.lora_targets)} ({plan.lora_parameters:,} weights)"
        ),
        "",
    ]
    if plan.images:
        shown = plan.images
        lines[-1:-1] = [
            f"images {shown['per_example']} per example, {shown['tokens_per_image']} soft tokens each; "
            f"{shown['slots']} of {shown['seen']} a row through the vision encoder"
        ]
    if plan.audio:
        lines[-1:-1] = [f"audio {plan.audio['seconds']:g} s per example, {plan.audio['tokens']} soft tokens"]
    shapes = [_shape(g) for g in plan.groups]
    width = max(len(s) for s in shapes)
    names = max(18, *(len(g.name) for g in plan.groups))  # Gemma 4's kinds of block name their groups longer
    lines.append(f"{'group':<{names}} {'shape':<{width}}  {'layout':<22} {'per device':>11}")
    for group, shape in zip(plan.groups, shapes):
        lines.append(f"{group.name:<{names}} {shape:<{width}}  {group.layout:<22} {_size(group.bytes_per_device):>11}")
    lines += ["", "memory per device"]
    for key, label in _ROWS.items():
        if plan.full and key == "weights":
            label = "weights (trained)"
        if key in plan.memory and (plan.memory[key] or key != "dequantized_kernel"):
            lines.append(f"  {label:<28} {_size(plan.memory[key]):>11}")
    lines.append(f"  {'total':<28} {_size(plan.memory['total']):>11}")
    lines += [f"note: {n}" for n in plan.notes]
    if plan.verdict:
        lines.append(plan.verdict)
    else:
        lines.append("pass --device-memory (16GB, or a kind: t4, l4, a100-40g, h100, v3-8...) for a verdict")
    return "\n".join(lines)


def _shape(group: Group) -> str:
    shape = " x ".join(str(n) for n in group.shape)
    if len(group.shape) == 1 and group.layout == "replicated" and group.copies == 1 and group.name != "embedding":
        return f"{group.shape[0]:,} weights"
    return f"{group.copies} x {shape}" if group.copies > 1 else shape


def _dtype(precision: str, size: int) -> str:
    return "float32" if size == 4 else "float16" if precision == "float16" else "bfloat16"
