import os
import subprocess
import sys

import keras
import pytest
from conftest import BACKEND

from finetune.platform import backend
from finetune.platform.errors import UserError


def test_select_records_the_backend_and_its_environment(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    tweaks = backend.select(BACKEND, xla_mem_fraction=0.9)
    assert os.environ["KERAS_BACKEND"] == BACKEND and tweaks["KERAS_BACKEND"] == BACKEND
    if BACKEND == "jax":
        assert tweaks["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    else:
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in tweaks


def test_another_backend_after_keras_is_loaded_is_a_user_error():
    other = next(b for b in ("jax", "torch", "tensorflow") if b != keras.config.backend())
    with pytest.raises(UserError, match="restart the kernel"):
        backend.select(other)


@pytest.mark.parametrize(
    "flags, framework, expected",
    [
        ({"avx2", "fma"}, "torch", "float32"),  # no 16-bit units: emulated
        ({"avx512f", "avx512_bf16"}, "torch", "bfloat16"),  # AMD Zen 4
        ({"avx512f", "avx512_bf16", "avx512_fp16"}, "tensorflow", "float16"),  # Intel without AMX: bf16 at half rate
        ({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}, "torch", "bfloat16"),  # AMX
        ({"avx512_bf16", "avx512_fp16", "amx_bf16"}, "jax", "float32"),  # XLA's CPU backend: float32 everywhere
    ],
)
def test_auto_takes_the_cpu_s_fastest_dtype(monkeypatch, flags, framework, expected):
    monkeypatch.setattr(backend, "cpu_flags", lambda: flags)
    assert backend.cpu_precision(framework) == expected


def test_runtime_tweaks_on_a_cpu():
    policy = keras.config.dtype_policy().name
    try:
        tweaks = backend.apply_runtime_tweaks("auto")
        assert tweaks["device"] == "cpu" and tweaks["dtype_policy"] == backend.cpu_precision(keras.config.backend())
        assert backend.apply_runtime_tweaks("mixed_bfloat16")["dtype_policy"] == "mixed_bfloat16"
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        # A bf16 base: the global policy is the adapter's, float32 variables computed in bf16.
        assert backend.apply_runtime_tweaks("bfloat16")["dtype_policy"] == "bfloat16"
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        keras.config.set_dtype_policy(policy)


def test_torch_threads_are_the_idle_physical_cores_unless_set(monkeypatch):
    cores = backend.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert backend.torch_threads(3) == (3, "set by train.threads")
    monkeypatch.setattr(backend, "idle_cores", lambda: 1)
    assert backend.torch_threads(None) == (1, f"1 of {cores} physical cores idle at start")
    monkeypatch.setattr(backend, "idle_cores", lambda: None)
    assert backend.torch_threads(None)[0] == cores


def test_idle_cores_counts_a_busy_core(monkeypatch):
    # /proc/stat over the interval: 1000 jiffies, of which 500 idle -> half the cores idle.
    times = iter([(1000, 200), (2000, 700)])
    monkeypatch.setattr(backend, "_cpu_times", lambda: next(times))
    monkeypatch.setattr(backend, "physical_cores", lambda: 4)
    assert backend.idle_cores(interval=0) == 2
    times = iter([(1000, 200), (2000, 200)])  # every core busy: still one thread
    assert backend.idle_cores(interval=0) == 1


def test_idle_cores_counts_this_process_s_own_work_as_idle(monkeypatch):
    """The run's own threads (its imports', a bench worker's start) hold no core from it: only other processes do.
    Counted busy, a bench's PyTorch row took 1 thread of 2 on a quiet machine."""
    # 1000 jiffies over the interval, 500 idle, and 500 of them this process's: every core is free for it.
    stat = iter([[100, 0, 0, 200, 0, 0, 0, 700], [600, 0, 0, 700, 0, 0, 0, 700]])
    own = iter([0, 500])
    monkeypatch.setattr(backend, "_proc_stat", lambda: next(stat))
    monkeypatch.setattr(backend, "_own_jiffies", lambda: next(own))
    monkeypatch.setattr(backend, "physical_cores", lambda: 2)
    assert backend.idle_cores(interval=0) == 2
    stat = iter([[100, 0, 0, 200, 0, 0, 0, 700], [600, 0, 0, 700, 0, 0, 0, 700]])
    own = iter([0, 0])  # the same 500 busy jiffies, another process's: one core left
    assert backend.idle_cores(interval=0) == 1


def test_out_of_memory_errors_are_recognised_on_every_backend():
    assert backend.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert backend.is_out_of_memory(Exception("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert not backend.is_out_of_memory(ValueError("shapes do not match"))
    # PyTorch's CPU allocator, under keras' error naming the layer (`finetune generate --max-new-tokens 100000`).
    try:
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 80028802592 bytes")
        except RuntimeError as inner:
            raise RuntimeError("Exception encountered when calling CachedGemmaAttention.call().") from inner
    except RuntimeError as wrapped:
        assert backend.is_out_of_memory(wrapped)
    assert backend.is_out_of_memory(MemoryError()) and not backend.is_out_of_memory(ValueError("memory layout"))


def test_default_batch_sizes_follow_the_measured_fit():
    assert backend.DEFAULT_BATCH_SIZE == {"jax": 4, "torch": 2, "tensorflow": 2}
    assert backend.peak_memory_mb() > 0


@pytest.mark.parametrize("limit, expected", [("max", None), ("1073741824", 2**30), ("0", None), ("garbage", None)])
def test_host_memory_is_the_containers_limit_where_that_is_lower(monkeypatch, limit, expected):
    real = backend.Path.read_text

    def read_text(path, *args, **kwargs):
        if str(path).startswith("/sys/fs/cgroup/"):
            return limit + "\n"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(backend.Path, "read_text", read_text)
    total = backend.host_memory()
    with open("/proc/meminfo", encoding="utf-8") as f:
        meminfo = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert total == (expected or meminfo)


def test_host_memory_off_linux_is_unknown_and_plan_asks_for_a_size(monkeypatch):
    from finetune.training import plan

    def unreadable(*args, **kwargs):
        raise OSError("no such file")

    monkeypatch.setattr("builtins.open", unreadable)
    monkeypatch.setattr(backend.Path, "read_text", unreadable)
    assert backend.host_memory() is None
    with pytest.raises(UserError, match="--device-memory"):
        plan.device("cpu")


@pytest.mark.parametrize("needed, left_out", [((), ["tensorflow"]), (("tensorflow",), [])])
def test_a_process_of_ours_keeps_only_the_frameworks_its_run_needs(needed, left_out):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from finetune.platform import backend\n"
        f"print(backend.leave_out_other_frameworks('jax', {needed!r}), 'tensorflow' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # A framework left out is a None in sys.modules, which `import` takes as not installed.
    assert done.stdout.split() == [str(left_out), str(bool(left_out))], done.stdout + done.stderr


HEAP = """
import ctypes, sys
from finetune.platform import backend

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))  # a freed mapped block raises glibc's mapping threshold: smaller blocks stay in the heap
blocks = [libc.malloc(8 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
for block in blocks[:-1]:  # the last one stays, so the heap cannot shrink from its top
    libc.free(block)
before = resident()
released = backend.release_freed_host_memory()
print(released, before - resident())
"""


@pytest.mark.one_backend
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_freed_heap_pages_go_back_to_the_os():
    done = subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    released, returned = done.stdout.split()
    assert released == "True" and int(returned) > 400 << 20  # most of the 504 MiB freed in the heap


DEFERRED = """
import sys
from finetune.platform import backend
backend.LEAVE_OUT_OTHER_FRAMEWORKS = sys.argv[2] == "ours"
backend.select(sys.argv[1])
import keras, keras_hub
from keras_hub.src.metrics import rouge_base
from keras.src.visualization import plot_image_gallery
from finetune.training import scoring
print(type(rouge_base.rouge_scorer).__name__, type(plot_image_gallery.plt).__name__,
      "nltk" in sys.modules, "matplotlib.figure" in sys.modules)
print(round(scoring.rouge_l(["the cat sat"], ["the cat sat down"]), 4), "nltk" in sys.modules)
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
figure = plt.figure()
print(type(figure).__name__, type(sys.modules["matplotlib.pyplot"]).__name__, plot_image_gallery.plt.figure is plt.figure)
"""


@pytest.mark.one_backend  # keras' and keras-hub's imports, the same on every backend
@pytest.mark.parametrize("process", ["ours", "a notebook's"])
def test_rouge_s_scorer_and_pyplot_are_imported_at_their_first_use_in_a_process_of_ours(process):
    pytest.importorskip("rouge_score")
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, "-c", DEFERRED, BACKEND, process], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    # `finetune`'s process: neither is imported with keras and keras-hub; each is when first used. The Python API's:
    # both are imported as keras imports them. Then each scores and plots (0.8571: ROUGE-L F, 3 of 3 words
    # against 3 of 4), and keras' name for pyplot reads the module.
    deferred = process == "ours"
    assert lines[0] == (
        ["_Deferred", "_Deferred", "False", "False"] if deferred else ["module", "module", "True", "True"]
    )
    assert lines[1] == ["0.8571", "True"] and lines[2] == ["Figure", "module", "True"], done.stdout
