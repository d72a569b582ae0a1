import os

import keras
import pytest
from conftest import BACKEND

from finetune import backend
from finetune.errors import UserError


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


def test_runtime_tweaks_on_a_cpu():
    policy = keras.config.dtype_policy().name
    try:
        tweaks = backend.apply_runtime_tweaks("auto")
        assert tweaks["device"] == "cpu" and tweaks["dtype_policy"] == "float32"
        assert backend.apply_runtime_tweaks("mixed_bfloat16")["dtype_policy"] == "mixed_bfloat16"
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        keras.config.set_dtype_policy(policy)


def test_out_of_memory_errors_are_recognised_on_every_backend():
    assert backend.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert backend.is_out_of_memory(Exception("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert not backend.is_out_of_memory(ValueError("shapes do not match"))


def test_default_batch_sizes_follow_the_measured_fit():
    assert backend.DEFAULT_BATCH_SIZE == {"jax": 4, "torch": 2, "tensorflow": 2}
    assert backend.peak_memory_mb() > 0
