"""Choose the Keras backend and apply its tweaks, recording each one.

`select()` must run before keras is first imported: Keras reads KERAS_BACKEND
once, at import. `apply_runtime_tweaks()` runs after, when the framework can
say what hardware it sees. Both return what they did, for config.yaml.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import os
import resource
import sys
import time
import types
from pathlib import Path

from finetune.platform import keras_compat
from finetune.platform.errors import UserError

# The seed article's measurement: gemma_2b at seq_len 512 on a 24 GB card fits
# batch 4 under JAX but only 2 under PyTorch; TensorFlow is given the safe 2.
DEFAULT_BATCH_SIZE = {"jax": 4, "torch": 2, "tensorflow": 2}

# --precision -> (Keras dtype policy of the frozen base, of the layers LoRA adapts). The base is stored in
# the compute dtype, as PEFT keeps a bfloat16 model: half the bytes of float32, and no cast of every
# kernel on every step. An adapted layer's policy is mixed, so its LoRA factors (and their gradients
# and AdamW moments) are float32 while its kernel stays as the base stores it.
POLICIES = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "mixed_bfloat16"),
    "float16": ("float16", "mixed_float16"),
    # Keras' own mixed precision: every weight float32, computed in bfloat16 (twice the base's bytes).
    "mixed_bfloat16": ("mixed_bfloat16", "mixed_bfloat16"),
}


# objective.py projects the loss positions onto the vocabulary this many bytes of float32 logits at a time:
# 128 positions of Gemma's 256k vocabulary. A chunk holds about two and a half times this at once (logits,
# softmax, its compute-dtype copy). On a 2-core CPU a (64 x 2048) x (2048 x 256k) bf16 matmul ran at 367
# GFLOP/s and its transpose at 272, against 399 and 341 at 128 rows: smaller chunks cost speed.
LOSS_CHUNK_BYTES = 128 * 2**20
LOSS_CHUNK_MAX = 256  # positions: small enough that skipping an all-padding chunk saves work at small vocabularies


def loss_chunk(vocabulary_size: int) -> int:
    """Positions projected together: as many as LOSS_CHUNK_BYTES of float32 logits, 16 to 256, a multiple of 16."""
    fit = LOSS_CHUNK_BYTES // (4 * vocabulary_size)
    return max(16, min(LOSS_CHUNK_MAX, fit // 16 * 16))


# Modules keras and keras-hub import at their own import, for features a run may never use: ROUGE's scorer (keras-hub's
# metrics; it imports nltk and scipy.stats) and pyplot (keras' image gallery). They were 2 s of the 6 s a `finetune`
# command took to import keras and keras-hub on JAX (2 cores, Intel Xeon): 1.3 s ROUGE's, which only `eval
# --generate` uses, and the rest pyplot's, which a training run's loss plot imports at its end. In a process of our
# own each is a stand-in until first used (scoring.rouge_l, keras-hub's RougeL, the loss plot), which imports it.
DEFERRED_IMPORTS = ("rouge_score.rouge_scorer", "matplotlib.pyplot")


class _Deferred(types.ModuleType):
    """Stands in for a module not imported yet, in sys.modules and as its package's attribute, with the module's
    spec and file (what `import`, importlib.util.find_spec and inspect.getmodule read of every module); the first
    other attribute asked of it imports the module, which then replaces it, and is read through it after."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__ = spec, spec.loader, spec.origin

    def __getattr__(self, attribute):
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attribute)


def defer_imports_keras_makes() -> list[str]:
    """Put a stand-in for each of DEFERRED_IMPORTS not imported yet, before keras is; returns their names."""
    if "keras" in sys.modules:
        return []
    deferred = []
    for name in DEFERRED_IMPORTS:
        parent, _, child = name.rpartition(".")
        if name in sys.modules or importlib.util.find_spec(parent) is None:
            continue
        spec = importlib.util.find_spec(name)  # imports the package, not the module
        if spec is None or hasattr(sys.modules[parent], child):
            continue
        sys.modules[name] = stand_in = _Deferred(spec)
        setattr(sys.modules[parent], child, stand_in)
        deferred.append(name)
    return deferred


# Set by the processes finetune owns (the CLI, a bench row), never by the Python API: a notebook that goes on to
# import another framework for its own work must be able to, and gets pyplot and ROUGE's scorer as they are, not
# DEFERRED_IMPORTS' stand-ins.
LEAVE_OUT_OTHER_FRAMEWORKS = False

# The modules of each framework that another backend's process would import for nothing.
_FRAMEWORK_MODULES = {"tensorflow": ("tensorflow", "tensorflow_text"), "jax": ("jax", "jaxlib")}


def leave_out_other_frameworks(backend: str, needed: tuple[str, ...] = ()) -> list[str]:
    """Keep the frameworks that are neither `backend` nor `needed` out of this process; returns those kept out.

    keras-hub imports TensorFlow whenever it is installed, and tokenizes without
    it (the sentencepiece package); keras imports JAX for its Orbax callback. In
    a process that trains on another backend they are resident memory and nothing
    else: after `import keras, keras_hub` on PyTorch, 562 MiB with both, 457
    without JAX, and about 590 MiB more with TensorFlow; on TensorFlow, 898 MiB
    with JAX and 792 without. The TensorBoard log is written without TensorFlow
    (events.py), and gs:// is read through fsspec. Only a framework not yet
    imported is kept out; `import` of it then raises ImportError, which keras,
    keras-hub and datasets all take as "not installed".

    needed: frameworks the run's model needs whatever its backend (TensorFlow for
    keras-hub's Gemma 3, 3n and 4 preprocessors: presets.frameworks_needed).
    """
    left_out = []
    for framework, modules in _FRAMEWORK_MODULES.items():
        if framework in (backend, *needed) or any(sys.modules.get(m) is not None for m in modules):
            continue
        for name in modules:
            sys.modules[name] = None
        left_out.append(framework)
    return left_out


def select(backend: str, xla_mem_fraction: float = 1.0, needed: tuple[str, ...] = ()) -> dict:
    """Set KERAS_BACKEND and the environment tweaks that must precede the import; quiet the frameworks' logs.

    needed: frameworks the run needs besides its backend's, kept in a process that leaves the others out.
    """
    from finetune.platform import quiet

    quiet.install()  # the Python API's way in: a notebook's output then holds no framework log line either
    if "keras" in sys.modules:
        import keras

        current = keras.config.backend()
        if current != backend:
            raise UserError(
                f"keras is already loaded with the {current} backend in this process, so {backend} "
                f"cannot be chosen; choose {current} instead, or restart the kernel and call finetune before "
                "importing keras"
            )

    if importlib.util.find_spec(backend) is None:
        raise UserError(f"the {backend} backend is not installed; pip install 'finetune[{backend}]'")
    os.environ["KERAS_BACKEND"] = backend
    tweaks = {"KERAS_BACKEND": backend}
    if LEAVE_OUT_OTHER_FRAMEWORKS:
        defer_imports_keras_makes()
        left_out = leave_out_other_frameworks(backend, needed)
        if left_out:
            tweaks["frameworks_left_out"] = ", ".join(left_out)
    # TensorFlow and XLA print CUDA probing noise at import; keep warnings and errors.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if backend == "jax":
        # The tutorial's 1.00 lets XLA take the whole card rather than its 75% default.
        fraction = f"{xla_mem_fraction:.2f}"
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
        tweaks["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
    return tweaks


def accelerator() -> str:
    """'gpu', 'tpu' or 'cpu': what the current backend will compute on."""
    import keras

    backend = keras.config.backend()
    if backend == "jax":
        import jax

        return jax.devices()[0].platform.replace("cuda", "gpu").replace("rocm", "gpu")
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    import tensorflow as tf

    if tf.config.list_logical_devices("TPU"):
        return "tpu"
    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"


def no_accelerator_here() -> bool:
    """Whether this machine shows no GPU or TPU, read from its device files and TPU variables without importing a
    framework (`--plan-only` plans for this machine before any loads): NVIDIA's /dev/nvidia*, ROCm's /dev/kfd,
    a TPU's /dev/accel* or /dev/vfio, TPU_NAME or TPU_ACCELERATOR_TYPE."""
    import glob

    if any(os.environ.get(name) for name in ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR")):
        return False
    return not any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*", "/dev/vfio/*"))


def device_name(device: str) -> str:
    """What the run computes on, as the console and metrics.json name it: `cpu (AMD EPYC 7B13, 2 cores)`,
    `gpu (NVIDIA H100 80GB HBM3)`, `tpu (TPU v5 lite)`; the kind alone where the framework does not say."""
    import keras

    if device == "cpu":
        model = next((value for key, value in _cpuinfo() if key == "model name"), "")
        cores = physical_cores()
        return f"cpu ({model + ', ' if model else ''}{cores} core{'s' if cores != 1 else ''})"
    backend = keras.config.backend()
    try:
        if backend == "jax":
            import jax

            kind = jax.devices()[0].device_kind
        elif backend == "torch":
            import torch

            kind = torch.cuda.get_device_name(0)
        else:
            import tensorflow as tf

            kind = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]).get(
                "device_name", ""
            )
    except (RuntimeError, IndexError, AttributeError):
        kind = ""
    return f"{device} ({kind})" if kind else device


def supports_bfloat16(device: str) -> bool:
    """bf16 pays on a TPU, a GPU of compute capability 8.0 or newer (not a T4), and a CPU where cpu_precision
    picks it."""
    import keras

    if device == "tpu":
        return True
    if device == "cpu":
        return cpu_precision(keras.config.backend()) == "bfloat16"
    if device != "gpu":
        return False

    backend = keras.config.backend()
    if backend == "torch":
        import torch

        return torch.cuda.is_bf16_supported()
    if backend == "jax":
        import jax

        capability = getattr(jax.devices()[0], "compute_capability", "8.0")
        return float(capability) >= 8.0
    import tensorflow as tf

    gpu = tf.config.list_physical_devices("GPU")[0]
    major, _ = tf.config.experimental.get_device_details(gpu).get("compute_capability", (8, 0))
    return major >= 8


def cpu_precision(framework: str) -> str:
    """The dtype --precision auto gives the base on this CPU under `framework`: its fastest matmul's.

    - JAX: float32. XLA's CPU backend has no fast 16-bit matmul (bf16 161, float16
      158 against float32 253 GFLOP/s on 2 cores of an Intel Xeon with AVX512-FP16)
      and keeps float32 copies of bf16 weights: at gemma-2b dims on a Xeon with AMX,
      JAX trained at 19 tokens/s in 13.0 GB in float32, 16 in 16.8 GB in bf16.
    - AMX: bfloat16 (PyTorch's bf16 matmul peaked at 2,149 GFLOP/s on a Xeon with AMX).
    - AVX512-FP16 without AMX: float16. There bf16 goes through AVX512-BF16 at
      about half float32's rate (PyTorch 173, TensorFlow 160 GFLOP/s against 258
      and 280) while float16 matches or passes float32 (313 and 293): float16
      trains at float32's speed in bf16's memory. The T4's dtype too.
    - AVX512-BF16 (AMD Zen 4): bfloat16 (cpu-small trained 1.37x faster on
      TensorFlow and 1.67x on PyTorch than float32, BENCHMARKS.md).
    - Otherwise float32: without 16-bit units the 16-bit matmuls are emulated.
    """
    if framework == "jax":
        return "float32"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "bfloat16"
    if "avx512_fp16" in flags:
        return "float16"
    if "avx512_bf16" in flags:
        return "bfloat16"
    return "float32"


def auto_precision(device: str, float16_overflows: str | None = None) -> str:
    """--precision auto on this process's `device` (cpu, gpu or tpu): precision_rule's precision."""
    return auto_precision_why(device, float16_overflows)[0]


def auto_precision_why(device: str, float16_overflows: str | None = None) -> tuple[str, str]:
    """(what --precision auto becomes on this process's `device`, why), for a family that `float16_overflows` (the
    family's families.Family.float16_overflows; None: Gemma 1 and 2, which float16 computes right)."""
    import keras

    bfloat16 = device != "cpu" and supports_bfloat16(device)
    return precision_rule(device, bfloat16, keras.config.backend(), float16_overflows)


def precision_rule(kind: str, bfloat16: bool, framework: str, float16_overflows: str | None) -> tuple[str, str]:
    """The one rule of --precision auto, for a run here and for the plan of a device elsewhere: (precision, why).

    kind: cpu, gpu or tpu; bfloat16: whether the accelerator computes in bf16 (ignored for a CPU, whose own
    flags decide: cpu_precision); framework: jax, torch or tensorflow; float16_overflows: why the family's
    activations pass float16's range (families.Family.float16_overflows), or None where float16 is safe. auto
    never picks float16 for such a family: where float16 would be the fast dtype (a T4, a V100, a CPU with
    AVX512-FP16 but no AMX) it picks float32, which holds them, in twice float16's memory.
    """
    if kind == "cpu":
        chosen = cpu_precision(framework)
        why = f"this CPU's fastest matmul under {framework}"
        if framework == "jax":
            why = "JAX on a CPU has no fast 16-bit matmul"
    elif bfloat16:
        chosen, why = "bfloat16", f"the {kind} computes in bf16"
    elif kind == "gpu":
        chosen, why = "float16", "the gpu has no bf16 units (T4, V100)"
    else:
        chosen, why = "float32", f"the {kind} has no 16-bit rule"
    if chosen == "float16" and float16_overflows:
        return "float32", f"auto: float16 is this device's fast dtype, but {float16_overflows}"
    return chosen, f"auto: {why}"


def full_weights_precision(precision: str, why: str) -> tuple[str, str]:
    """What --precision auto (`precision`, `why`: precision_rule's) becomes for a --full run, whose every weight
    trains: its weights stay float32, computed in bf16 where the device has it (mixed_bfloat16), never stored in
    16 bits. AdamW's steps of about lr x 1 are below bfloat16's resolution of a weight near 1 (2^-8) at a learning
    rate of 1e-4, so a bf16 weight would round most of them away; float16 has no mixed policy here."""
    if precision == "bfloat16":
        return "mixed_bfloat16", f"{why}; --full keeps its weights float32 (AdamW's steps round away in bf16)"
    if precision == "float16":
        return "float32", f"{why}; --full keeps its weights float32 (AdamW's steps round away in float16)"
    return precision, why


def routed_experts_rule(framework: str, device: str, devices: int = 1) -> tuple[bool, str]:
    """(whether a mixture-of-experts bank computes only the experts each token is routed to, as a grouped matmul
    (model/experts.py); why): the one rule, for a run here (builder.routed_experts) and for the plan of a device
    elsewhere. device: cpu, gpu or tpu; devices: how many the run spreads over."""
    dense = "keras-hub's dense dispatch computes every expert on every token"
    if framework != "jax":
        return False, f"on {framework}, {dense} (routed experts are built on JAX)"
    if device != "tpu":
        # XLA's CPU and (jaxlib 0.10) CUDA compilers have no grouped matmul: they lower ragged_dot to a product of
        # the pairs' inputs padded out to every expert's slot, k times the dense dispatch's work and memory (seen in
        # the CPU's lowering here; marin-community/marin#7012 measured the CUDA one at 23 TF/s on a B200). XLA's
        # Triton ragged dot is in review (openxla/xla#45995). On a TPU XLA has its own ragged dot; finetune has not measured it there yet.
        # tools/experts_check.py measures both dispatches on a device.
        return False, f"on a {device}, {dense} (XLA compiles a grouped matmul on a TPU only)"
    if devices > 1:
        # Sorting the pairs of a batch sharded over devices would gather it onto each, and a model axis shards the
        # bank on its experts, which the grouped matmul would gather.
        return False, f"over {devices} devices, {dense} (routed experts are built for one device)"
    return True, "routed: each token through its k experts only, one grouped matmul (jax.lax.ragged_dot) a projection"


def _cpuinfo() -> list[tuple[str, str]]:
    """(key, value) lines of /proc/cpuinfo; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in f)]
    except OSError:
        return []


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty off Linux."""
    return set(next((value.split() for key, value in _cpuinfo() if key == "flags"), []))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads counted once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cpu, package = set(), None, "0"
    for key, value in _cpuinfo():
        if key == "processor" and value.isdigit():
            cpu = int(value)
        elif key == "physical id":
            package = value
        elif key == "core id" and cpu in allowed:
            cores.add((package, value))
    return len(cores) or len(allowed) or 1


def _cpu_times() -> tuple[int, int]:
    """(every CPU's jiffies, those idle or this process's own): /proc/stat, steal and guest excluded.

    This process's own time counts as idle: what it does while it looks (the threads its imports started, the
    worker starting beside a bench's parent) is not another process holding a core. Counted busy, it made a
    bench row's PyTorch take 1 thread of 2 on a quiet machine.
    """
    fields = _proc_stat()
    return sum(fields[:8]), fields[3] + fields[4] + _own_jiffies()


def _proc_stat() -> list[int]:
    with open("/proc/stat", encoding="utf-8") as f:
        return [int(v) for v in f.readline().split()[1:]]


def _own_jiffies() -> int:
    own = os.times()
    return round((own.user + own.system) * os.sysconf("SC_CLK_TCK"))


def idle_cores(interval: float = 0.25) -> int | None:
    """Physical cores that other processes left idle over `interval` seconds; None where unknown."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(interval)
        total1, idle1 = _cpu_times()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    if total1 <= total0:
        return None
    idle_share = (idle1 - idle0) / (total1 - total0)
    return max(1, min(physical_cores(), round(idle_share * physical_cores())))


def torch_threads(requested: int | None) -> tuple[int, str]:
    """PyTorch's intra-op thread count on a CPU, and why.

    Its default is every logical CPU, busy or not. Spin-waiting OpenMP threads
    on cores another process holds made the tiny quickstart 4x slower (3.2k
    against 13.2k tokens/s with one busy core out of two); one thread per idle
    physical core kept 9.3k. So: the user's number, else the physical cores
    idle at start.
    """
    if requested is not None:
        return requested, "set by train.threads"
    cores, idle = physical_cores(), idle_cores()
    if idle is None:
        return cores, f"{cores} physical cores"
    return idle, f"{idle} of {cores} physical cores idle at start"


def set_seed(seed: int) -> None:
    """keras.utils.set_random_seed, leaving TensorFlow's own seed alone on the other backends (keras_compat)."""
    keras_compat.set_seed_leaving_tensorflow_alone(seed)


def apply_runtime_tweaks(precision: str, threads: int | None = None, lean_ops: bool = True) -> dict:
    """TF32 matmuls, PyTorch's CPU threads and the dtype policy; returns the tweaks applied.

    threads: int. PyTorch on a CPU: intra-op threads; None picks the idle physical cores.
    lean_ops: PyTorch: keras' per-op host work trimmed (keras_compat.lean_torch_ops), and the models built after
    it with less host work per step (lean_torch.py), the same tensors either way; False keeps keras' own (the
    bench's `stock` lever, which measures what they buy). Once installed in a process, they stay.
    """
    import keras

    backend = keras.config.backend()
    device = accelerator()
    tweaks: dict = {"device": device, "device_name": device_name(device)}
    if backend != "tensorflow" and sys.modules.get("tensorflow") is not None:
        tweaks["tensorflow"] = _tensorflow_off_accelerators()
    if backend == "torch":
        import torch

        torch.set_float32_matmul_precision("high")
        tweaks["torch.float32_matmul_precision"] = "high"
        keras_compat.promoted_torch_einsums()  # a correction: keras-hub's Gemma 4 audio mixes dtypes there
        if lean_ops:
            keras_compat.lean_torch_ops()
            tweaks["keras.ops"] = "lean host work" + (
                ", Python numbers filled on the device" if device != "cpu" else ""
            )
        if device == "cpu":
            count, why = torch_threads(threads)
            torch.set_num_threads(count)
            tweaks["torch.intra_op_threads"] = f"{count} ({why})"
            tweaks["threads"] = count
            # Left at torch's default: one inter-op thread against two measured no faster (tiny, 2 cores).
            tweaks["torch.inter_op_threads"] = torch.get_num_interop_threads()
            if keras_compat.keep_float16_matmuls():
                tweaks["keras.ops.matmul"] = "float16 kept float16 on the CPU"
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(True)
        tweaks["tensorflow.tensor_float_32"] = True
        keras_compat.exact_tensorflow_adds()  # a correction: builder.load_base installs it too
    elif device == "gpu":
        import jax

        jax.config.update("jax_default_matmul_precision", "tensorfloat32")
        tweaks["jax_default_matmul_precision"] = "tensorfloat32"
    if precision == "auto":
        precision = auto_precision(device)
    # The global policy is the adapter's: LoRA factors, and any layer made after the base, get it.
    keras.config.set_dtype_policy(POLICIES[precision][1])
    tweaks["dtype_policy"] = precision
    return tweaks


def _tensorflow_off_accelerators() -> str:
    """On JAX or PyTorch, TensorFlow only prepares text for keras-hub (families.Family.needs_tensorflow): keep
    it off the GPUs, where its first op would reserve most of each card's memory beside the backend's."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # its devices were set up already: by the user's own code, in a notebook
        return "kept for keras-hub's preprocessor; its devices were already set up"
    return "kept for keras-hub's preprocessor, on the CPU only"


def host_memory() -> int | None:
    """The memory this process may use, in bytes: the host's (MemTotal), or its container's limit where that
    is lower (cgroup v2 memory.max, v1 memory.limit_in_bytes: Kaggle's and Vertex AI's containers); None where
    neither can be read (not Linux)."""
    total = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            total = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")), None)
    except (OSError, ValueError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or 0 < int(text) < total):
            total = int(text)  # "max", or v1's huge number when unlimited, leaves the host's total
    return total


def device_memory(device: str) -> int | None:
    """Bytes of memory one device offers: a GPU's or TPU's as its framework reports it, the host's on a CPU;
    None where the framework does not say (TensorFlow on a GPU)."""
    import keras

    if device == "cpu":
        return host_memory()
    backend = keras.config.backend()
    try:
        if backend == "jax":
            import jax

            return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if backend == "torch":
            import torch

            return torch.cuda.get_device_properties(0).total_memory
    except (RuntimeError, AttributeError):
        pass
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an accelerator or host out-of-memory error, on any backend."""
    # Case-insensitive: XLA says "RESOURCE_EXHAUSTED: Out of memory", torch "CUDA out of memory",
    # TensorFlow raises ResourceExhaustedError.
    # PyTorch's CPU allocator says "can't allocate memory", numpy raises MemoryError; keras may wrap either in an
    # error of its own that names the layer, so the errors it was raised from are read too.
    marks = ("resource_exhausted", "resourceexhausted", "out of memory", "outofmemory", "can't allocate memory",
             "memoryerror")  # fmt: skip
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}".lower()
        if any(k in text for k in marks):
            return True
        error = error.__cause__ or error.__context__
    return False


def release_freed_host_memory() -> bool:
    """Hand the pages the C heap has freed back to the OS (glibc's malloc_trim); False where there is no glibc.

    On a CPU the device is host memory, and a step's freed activations stay resident in the heap, which the
    next step's tensors of the same sizes reuse. The vision encoder's attention scores are larger (1 GiB a
    picture at 896x896) and are mapped apart, so without this they would come on top of the last step's freed
    decoder activations: at gemma3_4b's dims with one picture, 3.5 GiB more at the peak (docs/images.md)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - musl and macOS have no malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


_LIBC = None


def peak_memory_mb() -> float:
    """Peak accelerator memory of this process, or peak resident memory on a CPU."""
    import keras

    backend = keras.config.backend()
    try:
        if backend == "jax":
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                return stats["peak_bytes_in_use"] / 2**20
        elif backend == "torch":
            import torch

            if torch.cuda.is_available():
                return torch.cuda.max_memory_allocated() / 2**20
        else:
            import tensorflow as tf

            if tf.config.list_physical_devices("GPU"):
                return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    except (RuntimeError, ValueError):
        pass
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
