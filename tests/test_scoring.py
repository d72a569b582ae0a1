from conftest import float32_policy

from finetune.model import builder, presets
from finetune.platform import backend
from finetune.training import scoring


def test_generate_returns_continuations_without_the_prompt():
    backend.set_seed(0)
    with float32_policy():  # compared with a float64 computation below
        lm, preprocessor = builder.build(presets.Source("tiny", "tiny", "gemma"), seq_len=48)
    prompts = ["Instruction:\nSay hi.\n\nResponse:\n", "Instruction:\nCount.\n\nResponse:\n"]
    outputs = scoring.generate(lm, preprocessor, prompts, max_new_tokens=5)
    assert len(outputs) == 2
    assert not any(o.startswith("Instruction:") for o in outputs)
    assert lm.preprocessor is None  # detached again, so fit sees token ids
