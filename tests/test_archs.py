"""The architecture table (archs.py): each released Gemma's weights, counted as keras-hub publishes them.

That the plan uses these counts is test_plan.py's; that the count is a real backbone's, for the tiny presets of
the newer families, is test_layouts.py's.
"""

import pytest
from conftest import PUBLISHED, ROUNDED

from finetune.model import archs

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


def test_table_counts_every_weight_keras_hub_publishes():
    assert set(PUBLISHED) | set(ROUNDED) == set(archs.ARCHS)
    for name, arch in archs.ARCHS.items():
        total = archs.parameter_count(arch.config, arch.family, arch.vision_params) + arch.encoder_params
        if name in ROUNDED:
            published, precision = ROUNDED[name]
            assert round(total / precision) * precision == published, name
        else:
            assert total == PUBLISHED[name], name
    assert archs.lookup("gemma_instruct_7b_en") is archs.ARCHS["gemma_7b_en"]
    assert archs.lookup("gemma3_instruct_1b") is archs.ARCHS["gemma3_1b"]
    assert archs.lookup("gemma4_instruct_26b_a4b") is archs.ARCHS["gemma4_26b_a4b"]
    assert archs.lookup("gemma3n_e4b_it") is archs.ARCHS["gemma3n_e4b"]
