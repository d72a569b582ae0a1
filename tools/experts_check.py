"""Time one Gemma 4 expert bank's training pass both ways on this JAX device: keras-hub's dense dispatch (every
expert on every token) and the routed one (finetune/model/experts.py: a grouped matmul, jax.lax.ragged_dot, over
each token's k experts), with LoRA on the experts, and print what each costs and how far apart they are.

backend.routed_experts_rule turns the routed dispatch on where XLA compiles ragged_dot as a grouped matmul: a
TPU. On a CPU, and on a GPU under jaxlib 0.10, XLA lowers it to a padded product over every expert's slot, k times
the dense dispatch's work; this measures whether the device at hand does better. One bank at gemma4_26b_a4b's
widths (128 experts, 8 a token, hidden 2816, expert ffw 704), random weights in bfloat16, LoRA rank 8; the step is
the bank's forward and its backward to the LoRA factors and the input, jitted. Each line: milliseconds a step
(median of --repeats after a warm-up), XLA's temporary bytes for the compiled step, and the routed output's and
gradients' largest difference from the dense ones, relative to their largest value.

usage: KERAS_BACKEND=jax python tools/experts_check.py [--tokens 2048] [--repeats 5] [--small]
(--small: tiny-gemma4-moe's widths, float32, for a CPU: checks the script, not the speed.)
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def bank_at(widths: dict, dtype: str, rank: int, seed: int = 0):
    """A Gemma4MoEBlock at `widths`, random weights, LoRA of `rank` on its experts with B drawn, and our call."""
    import numpy as np
    from keras_hub.src.models.gemma4.gemma4_moe import Gemma4MoEBlock

    from finetune.model import experts

    bank = Gemma4MoEBlock(widths["experts"], widths["hidden"], widths["inner"], dtype=dtype)
    bank.build((None, widths["hidden"]))
    rng = np.random.default_rng(seed)
    for name, fan_in in (
        ("gate_proj", widths["hidden"]),
        ("up_proj", widths["hidden"]),
        ("down_proj", widths["inner"]),
    ):
        weight = getattr(bank, name)
        weight.assign(rng.normal(0, fan_in**-0.5, tuple(weight.shape)).astype("float32"))
    experts.enable_lora(bank, rank)
    experts.initialise(bank, rng)
    for name in experts.FACTORS[1::2]:  # B, so that the update is not zero
        getattr(bank, name).assign(rng.normal(0, 0.02, tuple(getattr(bank, name).shape)).astype("float32"))
    bank.routed, bank.experts_per_token = False, widths["k"]
    return bank


def step_of(bank, routed: bool):
    """jit((LoRA factors, the bank's other weights), x, dispatch weights, cotangent -> (sum(output * cotangent),
    output), gradients to the factors and x). The weights are arguments, not constants baked into the program."""
    import jax
    import keras

    from finetune.model import experts

    factors = [getattr(bank, name) for name in experts.FACTORS]
    frozen = [v for v in bank.variables if v.path.split("/")[-1] not in experts.FACTORS]

    def loss(values, x, weights, cotangent, others):
        mapping = list(zip(factors, values, strict=True)) + list(zip(frozen, others, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            out = (experts.routed if routed else experts.dense)(bank, x, weights)
        return (out.astype("float32") * cotangent).sum(), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return step, [v.value for v in frozen]


def inputs(widths: dict, tokens: int, dtype: str, seed: int = 1):
    """Tokens, dispatch weights with k of E non-zero a token (as keras-hub's router makes them), a cotangent."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (tokens, widths["hidden"]), dtype)
    logits = jax.random.normal(keys[1], (tokens, widths["experts"]))
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits), widths["k"])
    weights = jnp.zeros_like(logits).at[jnp.arange(tokens)[:, None], chosen].set(top / top.sum(-1, keepdims=True))
    cotangent = jax.random.normal(keys[2], (tokens, widths["hidden"]))
    return x, weights.astype(dtype), cotangent


def measure(step, arguments, repeats: int):
    import jax

    compiled = step.lower(*arguments).compile()
    analysis = compiled.memory_analysis()
    temporary = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
    result = jax.block_until_ready(compiled(*arguments))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*arguments))
        times.append(time.perf_counter() - start)
    return result, statistics.median(times) * 1e3, temporary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens a step (batch x sequence length)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="tiny-gemma4-moe's widths in float32 (a CPU check)")
    args = parser.parse_args()
    import jax
    import numpy as np

    from finetune.model import experts

    if args.small:
        widths, dtype = dict(experts=4, k=2, hidden=32, inner=16), "float32"
    else:
        widths, dtype = dict(experts=128, k=8, hidden=2816, inner=704), "bfloat16"
    bank = bank_at(widths, dtype, args.rank)
    values = [getattr(bank, name).value for name in experts.FACTORS]
    x, weights, cotangent = inputs(widths, args.tokens, dtype)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"bank: {widths}, {dtype}, {args.tokens} tokens, LoRA rank {args.rank} on the experts")
    found = {}
    for routed in (False, True):
        name = "routed" if routed else "dense"
        try:
            step, others = step_of(bank, routed)
            found[name] = measure(step, (values, x, weights, cotangent, others), args.repeats)
        except Exception as e:  # out of memory, or a lowering this device lacks: say so, and go on
            print(f"{name:7s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        _, milliseconds, temporary = found[name]
        memory = f"{temporary / 2**30:.2f} GiB temporary" if temporary is not None else "temporary unknown"
        print(f"{name:7s} {milliseconds:9.2f} ms a step, {memory}")
    if len(found) == 2:
        ((_, dense), (_, dense_grads)), ((_, routed), (_, routed_grads)) = found["dense"][0], found["routed"][0]
        pairs = [(np.asarray(routed, "float32"), np.asarray(dense, "float32"))]
        pairs += [(np.asarray(g, "float32"), np.asarray(w, "float32"))
                  for g, w in zip(jax.tree.leaves(routed_grads), jax.tree.leaves(dense_grads), strict=True)]  # fmt: skip
        worst = max(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) for got, want in pairs)
        print(f"routed vs dense: largest difference {worst:.2e} of the largest value (output, and gradients of "
              f"the LoRA factors and the input); speed-up {found['dense'][1] / found['routed'][1]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
