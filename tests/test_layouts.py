"""Layout rules (layouts.py): which mesh axis each Gemma weight is split on, checked against real keras-hub
variables; pure Python, on every backend. test_distribution.py applies them on simulated devices.
"""

import pytest

from finetune.model import layouts
from finetune.platform.errors import UserError

GEMMA_2B = layouts.Dims(256000, 18, 8, 1, 2048, 256, 16384)


def test_one_kv_head_shards_key_and_value_on_the_hidden_axis():
    placed = {p.rule.group: p for p in layouts.place(GEMMA_2B, 4)}
    assert placed["query"].axes == ("model", None, None)  # 8 heads over 4
    assert placed["key"].axes == placed["value"].axes == (None, "model", None)  # 1 head: hidden 2048 over 4
    assert placed["ffw_gating"].axes == (None, "model") and placed["ffw_linear"].axes == ("model", None)
    assert placed["lora_a_attention"].axes == (None, None, None)


def test_an_indivisible_kernel_is_refused_with_its_name_and_sizes():
    odd = layouts.Dims(vocabulary_size=1024, num_layers=2, num_query_heads=3, num_key_value_heads=1,
                       hidden_dim=96, head_dim=32, ffw_dim=256)  # fmt: skip
    with pytest.raises(UserError, match=r"cannot shard query .*\(3, 96, 32\).* model axis of 64"):
        layouts.place(odd, 64)


def test_model_axis_of_one_replicates_everything():
    assert all(set(p.axes) <= {None} for p in layouts.place(GEMMA_2B, 1))


@pytest.mark.parametrize(
    "text, parallel, devices, expected",
    [(None, "data", 8, (8, 1)), (None, "model", 8, (1, 8)), ("2x4", "model", 8, (2, 4)), ("8x1", "data", 8, (8, 1))],
)
def test_mesh(text, parallel, devices, expected):
    assert layouts.parse_mesh(text, parallel, devices) == expected


@pytest.mark.parametrize(
    "text, parallel, message",
    [("2x2", "model", "needs 4 devices, and this job sees 8"), ("2by4", "model", "is not DATAxMODEL"),
     ("2x4", "data", "replicates the model")],
)  # fmt: skip
def test_bad_mesh(text, parallel, message):
    with pytest.raises(UserError, match=message):
        layouts.parse_mesh(text, parallel, 8)


def _variable_paths(backbone) -> list[str]:
    return [v.path for v in backbone.weights]


def _check_rules_against(backbone, config, family):
    placements = layouts.place(layouts.Dims.from_backbone_config(config, family), 2)
    matched = {}
    for variable in backbone.weights:
        axes = layouts.layout_of(variable.path, placements)  # raises on a path two rules match
        if axes is not None:
            assert len(axes) == len(variable.shape), variable.path
            matched.setdefault(next(p.rule.group for p in placements if p.axes is axes), []).append(variable)
    assert set(matched) == {p.rule.group for p in placements}
    # Each sharded kernel's shape is the one the rule computes from the config, and so is the count of them.
    for placement in placements:
        if placement.shape:
            group = matched[placement.rule.group]
            assert {tuple(v.shape) for v in group} == {placement.shape}, placement.rule.group
            assert len(group) == placement.copies, placement.rule.group


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_every_rule_matches_real_variables_and_no_path_matches_two(family):
    """The rules are keyed on keras-hub's variable paths: check them against real Gemma 1 and Gemma 3 models."""
    import keras_hub
    from conftest import float32_policy

    targets = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
    dims = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
                intermediate_dim=64, head_dim=8)  # fmt: skip
    with float32_policy():
        if family == "gemma":
            backbone = keras_hub.models.GemmaBackbone(**dims)
        else:
            backbone = keras_hub.models.Gemma3Backbone(image_size=None, vision_encoder=None, **dims)
        backbone.enable_lora(2, target_layer_names=targets)
    _check_rules_against(backbone, dims, family)


@pytest.mark.parametrize("preset", ["tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma3n"])
def test_newer_families_rules_match_their_variables_and_count_every_weight(preset):
    """Gemma 4 and 3n's rules are made from the config, one per kind of block: each matches exactly its
    variables, with their shapes and count, and the table's count (archs.parameter_count) is the backbone's."""
    from conftest import float32_policy

    from finetune.model import archs, builder, experts, families, presets

    family = presets.TINY[preset].family
    config = presets.tiny_config(preset, presets.tiny_vocabulary_size(preset))
    with float32_policy():
        backbone = presets.tiny_backbone(presets.tiny_vocabulary_size(preset), name=preset)
        assert archs.parameter_count(config, family) == backbone.count_params()
        backbone.enable_lora(2, target_layer_names=builder.lora_layer_names(backbone, list(families.TARGETS)))
        for bank in experts.banks(backbone):  # the MoE's experts take LoRA factors of their own (lora_experts)
            experts.enable_lora(bank, 2)
    _check_rules_against(backbone, config, family)
