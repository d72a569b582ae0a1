"""The mmproj writer (mmproj.py): transformers' names of Gemma 3's picture encoder to llama.cpp's clip names, and
the types its converter gives them. A run's mmproj.gguf, read back and compared with the transformers export, is
checked in test_export.py on a tiny-gemma3-vision run."""

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf format needs pip install 'finetune[gguf]'")
pytestmark = pytest.mark.backend_neutral  # numpy and gguf only


def test_transformers_names_become_llama_cpp_s_clip_names_and_the_projector_norm_is_shifted():
    from finetune.exports import mmproj

    weights = {
        "model.vision_tower.encoder.layers.1.self_attn.out_proj.weight": np.ones((4, 4)),
        "model.vision_tower.embeddings.patch_embedding.weight": np.ones((4, 3, 2, 2)),
        "model.multi_modal_projector.mm_input_projection_weight": np.ones((4, 8)),
        "model.multi_modal_projector.mm_soft_emb_norm.weight": np.full(4, 0.25),
        "model.language_model.layers.0.mlp.up_proj.weight": np.ones((8, 8)),  # the decoder's: not here
    }
    out = mmproj.tensors(weights, blocks=2)
    assert sorted(out) == ["mm.input_projection.weight", "mm.soft_emb_norm.weight", "v.blk.1.attn_out.weight",
                           "v.patch_embd.weight"]  # fmt: skip
    np.testing.assert_array_equal(out["mm.soft_emb_norm.weight"], np.full(4, 1.25))
    assert out["mm.input_projection.weight"].shape == (4, 8)  # kept as transformers holds it; llama.cpp transposes
    with pytest.raises(ValueError, match="no name for vision_tower.vision_model.encoder.layers.0.mystery"):
        mmproj.tensors({"model.vision_tower.encoder.layers.0.mystery.weight": np.ones((2, 2))}, blocks=2)


@pytest.mark.parametrize(
    "name, shape, dtype, expected",
    [
        ("v.blk.0.attn_q.weight", (64, 64), "q8_0", "Q8_0"),
        ("v.blk.0.attn_q.weight", (64, 64), "f32", "F32"),
        ("v.blk.0.attn_q.bias", (64,), "f16", "F32"),
        ("v.patch_embd.weight", (64, 3, 4, 4), "f16", "F32"),  # the converter keeps the embeddings f32
        ("v.position_embd.weight", (64, 64), "bf16", "F32"),
        ("mm.input_projection.weight", (64, 64), "q8_0", "F16"),  # and the projection f16, whatever --dtype
        ("v.blk.0.ffn_down.weight", (64, 48), "q8_0", "F16"),  # rows of 48: not whole blocks of 32
    ],
)
def test_each_clip_tensor_takes_the_type_llama_cpp_s_converter_gives_it(name, shape, dtype, expected):
    from finetune.exports import mmproj

    assert mmproj.tensor_type(name, np.zeros(shape), dtype).name == expected
