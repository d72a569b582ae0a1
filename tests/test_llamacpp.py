"""The GGUF writer (llamacpp.py): which Gemma models llama.cpp computes as keras-hub does, and the refusal of the rest.

The GGUF files a run exports (their tensors, metadata, and logits computed as llama.cpp does) are checked in
test_export.py, on its trained runs.
"""

import pytest
from conftest import float32_policy

import finetune


def test_gguf_refuses_what_llama_cpp_would_compute_differently():
    import keras_hub

    from finetune.exports import llamacpp

    shape = dict(vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
                 intermediate_dim=32, head_dim=8)  # fmt: skip
    with float32_policy():
        gemma2 = keras_hub.models.GemmaBackbone(
            **shape, use_post_ffw_norm=True, use_post_attention_norm=True, final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0, use_sliding_window_attention=True,
        )  # fmt: skip
        assert llamacpp.architecture(gemma2) == "gemma2"
        uncapped = keras_hub.models.GemmaBackbone(**shape, use_post_ffw_norm=True, use_post_attention_norm=True)
        with pytest.raises(finetune.UserError, match="lacks post norms, soft caps or sliding windows"):
            llamacpp.architecture(uncapped)
        scaled = keras_hub.models.GemmaBackbone(**dict(shape, head_dim=4), query_head_dim_normalize=False)
        with pytest.raises(finetune.UserError, match="scales queries by hidden size / heads"):
            llamacpp.architecture(scaled)
        embedding = keras_hub.models.Gemma3Backbone(
            **shape, image_size=None, is_embedding_model=True, pooling_intermediate_dim=8, embedding_dim=8
        )
        with pytest.raises(finetune.UserError, match="this Gemma 3 model is an embedding model"):
            llamacpp.architecture(embedding)
    # The family is told by the backbone's class, before any of its settings is read (a Gemma 4 takes 12 s to build).
    other = type("PaliGemmaBackbone", (), {})()
    with pytest.raises(finetune.UserError, match="cannot write a PaliGemmaBackbone as GGUF: finetune writes GGUF for"):
        llamacpp.architecture(other)
    assert llamacpp.architecture(type("Gemma4Backbone", (), {})()) == "gemma4"
    embedding = type("Gemma4Backbone", (), {"is_embedding_model": True})()
    with pytest.raises(finetune.UserError, match="this Gemma 4 model is an embedding model"):
        llamacpp.architecture(embedding)
    two_streams = type("Gemma3nBackbone", (), {"language_model": type("Text", (), {"altup_num_inputs": 2})()})()
    with pytest.raises(
        finetune.UserError, match="llama.cpp's gemma3n computes 4 AltUp streams and this Gemma 3n has 2"
    ):
        llamacpp.architecture(two_streams)
