"""The architecture table that lets `finetune plan` work offline."""

from finetune import archs

# keras-hub's published `params` for each preset (keras_hub/src/models/gemma*/gemma*_presets.py).
PUBLISHED = {
    "gemma_2b_en": 2_506_172_416,
    "gemma_7b_en": 8_537_680_896,
    "gemma2_2b_en": 2_614_341_888,
    "gemma2_9b_en": 9_241_705_984,
    "gemma2_27b_en": 27_227_128_320,
    "gemma3_1b": 999_885_952,
    "gemma3_4b_text": 3_880_099_328,
    "gemma3_12b_text": 11_765_788_416,
    "gemma3_27b_text": 27_009_002_240,
    "gemma3_4b": 4_299_915_632,
    "gemma3_12b": 12_187_079_280,
    "gemma3_27b": 27_432_062_576,
}


def test_table_counts_every_weight_keras_hub_publishes():
    assert set(PUBLISHED) == set(archs.ARCHS)
    for name, arch in archs.ARCHS.items():
        assert archs.parameter_count(arch.config, arch.family, arch.vision_params) == PUBLISHED[name], name
    assert archs.lookup("gemma_instruct_7b_en") is archs.ARCHS["gemma_7b_en"]
    assert archs.lookup("gemma3_instruct_1b") is archs.ARCHS["gemma3_1b"]
