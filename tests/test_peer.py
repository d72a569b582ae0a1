"""The bench's hf peer (finetune/tools/peer.py): which setups it trains where, and that packing changes no loss.

The selection is checked with the probe faked (nothing here has a GPU); the numerics on a tiny Gemma on a CPU in
float32, where flex attention runs forward only.
"""

import pytest

from finetune.tools import bench, peer

torch = pytest.importorskip("torch")  # the peer's framework: a jax or tensorflow suite may lack it

pytestmark = pytest.mark.one_backend  # torch and transformers only: no Keras backend


def _installed_only(monkeypatch, *present):
    """peer's probe answers yes for `present` and for what the peer always needs."""
    always = ("torch", "transformers", "peft")
    monkeypatch.setattr(peer, "_installed", lambda module: module in (*always, *present))


FLEX = "torch.nn.attention.flex_attention"


@pytest.mark.parametrize(
    "device, present, names",
    [
        ("cuda", ("flash_attn", FLEX, "liger_kernel"), ["flash+liger", "flash", "sdpa"]),
        ("cuda", (FLEX, "liger_kernel"), ["flex+liger", "flex", "sdpa"]),
        ("cuda", (FLEX,), ["flex", "sdpa"]),
        ("cuda", ("liger_kernel",), ["sdpa+liger", "sdpa"]),
        ("cuda", (), ["sdpa"]),
        ("cpu", ("flash_attn", FLEX, "liger_kernel"), ["sdpa"]),  # all three are CUDA kernels
    ],
)
def test_the_strongest_setup_comes_first_then_without_liger_then_the_sdpa_floor(device, present, names, monkeypatch):
    _installed_only(monkeypatch, *present)
    assert [setup.name for setup in peer.setups(device)] == names
    assert [peer.Setup.named(name).name for name in names] == names


def test_flash_attention_takes_no_float32_base(monkeypatch):
    _installed_only(monkeypatch, "flash_attn", FLEX)
    assert peer.setups("cuda", half=False)[0] == peer.Setup("flex")
    with pytest.raises(peer.UserError, match="--peer flash is not installed here .*16-bit base"):
        peer.setups("cuda", half=False, choice="flash")


def test_the_bench_gives_one_hf_row_per_setup_and_the_verdict_names_the_fastest(monkeypatch):
    _installed_only(monkeypatch, FLEX, "liger_kernel")
    monkeypatch.setattr(peer, "device", lambda: "cuda")
    specs = bench.hf_specs(bench.Workload(), ["precision"])
    assert [(s.setup, s.lever) for s in specs] == [
        ("flex+liger", None),
        ("flex", None),
        ("sdpa", None),
        ("flex+liger", "precision"),
    ]
    assert [s.setup for s in bench.hf_specs(bench.Workload(peer="sdpa"), [])] == ["sdpa"]
    assert peer.Setup("flex", True).settings("bfloat16") == (
        "transformers + PEFT, padding-free on flex attention (document mask), Liger fused linear CE, bfloat16 base, "
        "loss on every token"
    )

    def row(recipe, tokens, setup=None):
        return {"backend": "torch", "recipe": recipe, "lever": None, "setup": setup, "tokens_per_s": tokens,
                "peak_memory_mb": 1000.0, "matmul_peak_gflops": 1.0, "mfu": 0.1, "compute_dtype": "bfloat16"}  # fmt: skip

    rows = [row("hf", 8000, "flex+liger"), row("hf", 3000, "sdpa"), row("finetune", 12000)]
    assert "1.50x the hf peer's tokens/s (its fastest setup, flex+liger)" in bench.verdict(rows)
    assert bench._label(rows[1]) == "hf sdpa"


def test_a_peer_setup_not_installed_is_refused_before_any_work(tmp_path, monkeypatch):
    from conftest import invoke

    def work(*args):
        raise AssertionError("the bench started work before refusing the setup")

    monkeypatch.setattr(bench, "measure_peaks", work)
    monkeypatch.setattr(bench, "run_worker", work)
    out = tmp_path / "rows.json"
    result = invoke("bench", "--arch", "tiny", "--backends", "torch", "--recipes", "hf", "--peer", "flash",
                    "--json", out)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --peer flash is not installed here (cpu): it needs the flash_attn")
    assert not out.exists()


def _examples(lengths):
    class Example:
        def __init__(self, ids):
            self.token_ids = ids

    generator = torch.Generator().manual_seed(0)
    return [Example(torch.randint(3, 300, (n,), generator=generator).tolist()) for n in lengths]


def _loss(model, inputs) -> float:
    with torch.no_grad():
        return float(model(**inputs, use_cache=False).loss)


def test_packed_rows_give_each_example_alone_s_loss():
    """The block-diagonal (sdpa) packed loss is the mean over the same tokens of each example trained alone."""
    lengths = [30, 17, 9, 24, 12, 40]
    model = peer.base(bench.ARCHS["tiny"], 300, "float32")
    (inputs, trained), = peer.batches(_examples(lengths), 64, 3)  # fmt: skip
    assert inputs["input_ids"].shape == (3, 64) and trained == sum(lengths) - len(lengths)
    alone = sum(_loss(model, peer.batches([e], 64, 1)[0][0]) * (n - 1) for e, n in zip(_examples(lengths), lengths))
    assert _loss(model, inputs) == pytest.approx(alone / trained, rel=1e-5)


def test_flex_attention_s_document_mask_gives_the_block_diagonal_loss():
    """The padding-free flex path against the sdpa floor, on the same weights and rows (forward: a CPU has no flex
    backward)."""
    if not peer._installed(FLEX):
        pytest.skip("this torch has no flex attention")
    inputs, _ = peer.batches(_examples([30, 17, 9, 24, 12, 40]), 64, 3)[0]
    losses = {}
    for name in ("sdpa", "flex"):
        model = peer.base(bench.ARCHS["tiny"], 300, "float32", peer.Setup(name).implementation)
        assert model.config._attn_implementation == peer.Setup(name).implementation
        losses[name] = _loss(model, inputs)
    assert losses["flex"] == pytest.approx(losses["sdpa"], abs=1e-5)


def test_every_step_has_one_width_and_its_own_seconds():
    """Rows are padded to seq_len (a compiled attention kernel sees one shape), the padding is an untrained
    document of its own, and each timed step's seconds are kept."""
    lengths = [60, 50, 40, 30, 20, 10, 5, 3]  # four rows of 64: two steps of two
    steps = peer.batches(_examples(lengths), 64, 2)
    assert len(steps) == 2 and {tuple(inputs["input_ids"].shape) for inputs, _ in steps} == {(2, 64)}
    assert sum(trained for _, trained in steps) == sum(lengths) - len(lengths)
    for inputs, _ in steps:
        for ids, positions, labels in zip(inputs["input_ids"], inputs["position_ids"], inputs["labels"]):
            used = int((ids != 0).sum())  # the examples' ids are 3 and up; the padding's are 0
            tail = 64 - used
            assert (positions[used:] == torch.arange(tail)).all() and (labels[used:] == -100).all()
    model = peer.build(bench.ARCHS["tiny"], 300, 4, "float32")
    done = peer.train(model, steps, warmup=1, timed=2, dtype="float32")
    assert len(done["losses"]) == 3 and len(done["step_seconds"]) == 2
    assert done["seconds"] == pytest.approx(sum(done["step_seconds"])) and min(done["step_seconds"]) > 0
