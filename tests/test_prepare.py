"""Records to rows through a method (SFT's here), one way for training, `finetune eval` and the bench; the held-out
split below every method."""

import pytest
from conftest import make_records

from finetune.config import Config
from finetune.data.formats import Record
from finetune.methods import registry
from finetune.model import presets
from finetune.platform.errors import UserError

SFT = registry.get("sft")
pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


@pytest.fixture(scope="module")
def tokenizer():
    return presets.tiny_tokenizer()


def config(**train) -> Config:
    cfg = Config()
    cfg.model.seq_len, cfg.data.template, cfg.data.eval_fraction = 64, "dolly", 0.25
    for key, value in {"batch_size": 2, "seed": 3, **train}.items():
        setattr(cfg.train, key, value)
    return cfg


def records(n: int) -> list[Record]:
    return [Record(**r) for r in make_records(n)]


def test_eval_scores_exactly_the_records_training_held_out(tokenizer):
    cfg = config()
    trained = SFT.prepare(records(24), tokenizer, cfg, packed=True)
    scored = SFT.prepare(records(24), tokenizer, cfg)  # as `finetune eval` calls it
    assert [r for r, _ in scored.held_out] == [r for r, _ in trained.held_out] and len(trained.held_out) == 6
    assert not {r.instruction for r, _ in trained.train} & {r.instruction for r, _ in trained.held_out}
    assert (scored.held_out_rows["token_ids"] == trained.held_out_rows["token_ids"]).all()
    assert scored.rows is None and trained.rows["token_ids"].shape[1] == 64
    assert (
        len(SFT.prepare(records(24), tokenizer, cfg, every_record_of="other.jsonl").held_out) == 24
    )  # another file: all of it


def test_auto_batch_size_is_probed_on_the_usable_examples(tokenizer):
    seen = {}

    def probe(batch_of, rows):
        x, _, _ = batch_of(8, ("token_ids", "padding_mask"))
        seen.update(trial=len(x["token_ids"]), rows=rows)
        return 4, "the probe's reason"

    prepared = SFT.prepare(records(80), tokenizer, config(batch_size="auto"), packed=False, probe=probe)
    assert seen == {"trial": 8, "rows": 80} and prepared.batch_size == 4  # unpacked: a row per example
    assert len(prepared.held_out) == 20 and not prepared.packed
    assert prepared.batch_size_why == "the probe's reason"


def test_too_few_training_records_for_a_batch_are_refused(tokenizer):
    with pytest.raises(UserError, match="fewer than one batch of 8"):
        SFT.prepare(records(9), tokenizer, config(batch_size=8), packed=False)  # 2 held out, 7 left


def test_the_held_out_split_does_not_depend_on_the_batch_size(tokenizer):
    """64 records held out 4 at --batch-size 4 and 3 at --batch-size 1 --grad-accum 4: runs compared by their
    held-out loss were scored on different records, and trained on different ones."""
    cfg = config(batch_size=4)
    cfg.data.eval_fraction = 0.05
    four = SFT.prepare(records(64), tokenizer, cfg, packed=False)
    cfg = config(batch_size=1, grad_accum=4)
    cfg.data.eval_fraction = 0.05
    one = SFT.prepare(records(64), tokenizer, cfg, packed=False)
    assert [r for r, _ in four.held_out] == [r for r, _ in one.held_out] and len(one.held_out) == 3
    assert [r for r, _ in four.train] == [r for r, _ in one.train]


@pytest.mark.one_backend  # files and Python
def test_predict_reads_every_record_whatever_the_run_s_filters(tmp_path):
    """`finetune predict` writes a line for each record of its file, in order: a run trained with --max-records
    60 wrote 60 lines for a file of 96."""
    from conftest import write_jsonl

    from finetune import config
    from finetune.methods import prepare

    data = write_jsonl(tmp_path / "d.jsonl", make_records(7))
    cfg = config.load(None, {"data.max_records": 3, "data.path": str(data)})
    assert len(prepare.read(cfg, str(data), trained=True)[0]) == 3
    assert len(prepare.read(cfg, str(data), trained=True, filtered=False)[0]) == 7
