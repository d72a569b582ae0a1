import typing

import pytest

from finetune import config
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


def test_defaults_match_the_documented_command(monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND")  # set per suite; without it the default is jax
    cfg = config.load()
    assert cfg.backend == "jax"
    assert cfg.model.preset == "gemma_2b_en"
    assert cfg.lora.rank == 4
    assert cfg.lora.targets == ["query", "value"]
    assert cfg.data.eval_fraction == 0.05
    assert cfg.data.train_on_prompt is False


def test_precedence_recipe_then_set_then_flags(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lora:\n  rank: 8\ntrain:\n  epochs: 3\n  seed: 7\n")
    # The CLI passes --set pairs first, then named flags: later keys win.
    cfg = config.load(recipe, {"train.epochs": 5, "lora.rank": 16, **{"lora.rank": 2}})
    assert cfg.train.epochs == 5  # --set over recipe
    assert cfg.lora.rank == 2  # flag over --set
    assert cfg.train.seed == 7  # recipe over default


def test_unknown_key_is_refused_with_a_suggestion(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  epoch: 3\n")
    with pytest.raises(UserError, match="did you mean 'train.epochs'"):
        config.load(recipe)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.epochs", "two", "must be an integer"),
        ("lora.targets", 7, "must be a list of a string"),
        ("data.drop_context", "yes", "must be true or false"),
    ],
)
def test_wrong_types_are_refused(key, value, message):
    with pytest.raises(UserError, match=message):
        config.load(None, {key: value})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("backend", "numpy", "unknown backend"),
        ("data.template", "chatml", "unknown template"),
        ("lora.rank", 0, "rank must be at least 1"),
        ("data.eval_fraction", -0.1, r"must be in \[0, 1\)"),
        ("data.eval_fraction", 1.0, r"must be in \[0, 1\)"),
        ("eval.every", 0, "eval-every must be at least 1"),
        ("eval.early_stop", 0, "early-stop patience must be at least 1"),
        ("output.report_to", ["tensorboard", "comet"], "unknown tracker 'comet'"),
        ("train.batch_size", 0, "batch size"),
        ("train.batch_size", "big", "batch size"),
        ("model.precision", "fp8", "unknown precision"),
        ("lora.dropout", 1.0, r"LoRA dropout must be in \[0, 1\), got 1.0; try --lora-dropout 0.05"),
        ("lora.dropout", -0.1, r"LoRA dropout must be in \[0, 1\)"),
        ("lora.plus_ratio", 0.0, "LoRA\\+ ratio must be positive, got 0.0; try --lora-plus-ratio 16"),
        ("train.neftune_alpha", -1.0, "NEFTune alpha must not be negative, got -1.0; try --neftune-alpha 5"),
    ],
)
def test_out_of_range_values_are_refused(key, value, message):
    with pytest.raises(UserError, match=message):
        config.load(None, {key: value})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"eval.data": "dev.jsonl"}, "pass --eval-fraction 0 with it"),
        ({"data.eval_fraction": 0, "eval.every": 5}, "--eval-every needs held-out records"),
        ({"data.eval_fraction": 0, "eval.early_stop": 2}, "--early-stop needs held-out records"),
        ({"output.report_to": ["none", "mlflow"]}, "`none` leaves out every tracker"),
    ],
)
def test_evaluation_settings_that_rule_each_other_out(overrides, message):
    with pytest.raises(UserError, match=message):
        config.load(None, overrides)


def test_eval_data_is_relative_to_the_recipe_and_allows_eval_fraction_0(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  eval_fraction: 0\neval:\n  data: dev.jsonl\n  keep_best: true\n")
    monkeypatch.chdir("/")
    cfg = config.load(recipe)
    assert cfg.eval.data == str(tmp_path / "dev.jsonl") and cfg.data.eval_fraction == 0 and cfg.eval.keep_best


def test_set_values_are_read_as_yaml():
    assert config.load(None, dict([config.parse_set("train.learning_rate=1e-4")])).train.learning_rate == 1e-4
    assert config.parse_set("lora.targets=[query, key]") == ("lora.targets", ["query", "key"])
    assert config.parse_set("train.max_steps=null") == ("train.max_steps", None)
    with pytest.raises(UserError, match="key=value"):
        config.parse_set("train.epochs")


def test_a_list_setting_takes_words_as_its_flag_does():
    """`--set lora.targets=query,value` is split at commas as --target is; --labels and --reward, whose flags take
    each value whole, take a plain string as one item; a YAML boolean where a number is wanted says why."""
    load = lambda *pairs: config.load(None, dict(config.parse_set(pair) for pair in pairs))  # noqa: E731
    assert load("lora.targets=query, value").lora.targets == ["query", "value"]
    assert load("lora.targets=query").lora.targets == ["query"]
    assert load("model.add_tokens=<a>,<b>").model.add_tokens == ["<a>", "<b>"]
    assert load("train.method=classify", "train.labels=yes, no").train.labels == ["yes, no"]
    with pytest.raises(UserError, match="must be a list of a number"):
        load("train.reward_weights=1,2")
    with pytest.raises(UserError, match=r"got False \(YAML reads a bare on, off"):
        load("train.epochs=off")


def test_recipe_rates_without_a_dot_read_as_numbers(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  learning_rate: 5e-5\n")
    assert config.load(recipe).train.learning_rate == 5e-5


def test_integers_are_accepted_where_numbers_are_wanted():
    cfg = config.load(None, {"train.learning_rate": 1, "train.batch_size": "auto"})
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.batch_size == "auto"


def test_a_run_s_config_yaml_works_as_a_recipe(tmp_path):
    recipe = tmp_path / "config.yaml"
    recipe.write_text("lora:\n  rank: 3\nresolved:\n  preset_kind: tiny\n")
    assert config.load(recipe).lora.rank == 3


def test_the_python_api_checks_a_config_built_by_hand():
    import finetune

    cfg = config.Config()
    cfg.lora.rank = 0
    with pytest.raises(finetune.UserError, match="rank must be at least 1"):
        finetune.run(cfg)


def test_a_recipe_s_relative_paths_are_relative_to_the_recipe(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes"
    (recipes / "my-preset").mkdir(parents=True)
    recipe = recipes / "mine.yaml"
    recipe.write_text("data:\n  path: mydata.jsonl\nmodel:\n  preset: my-preset\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = config.load(str(recipe))
    assert cfg.data.path == str(recipes / "mydata.jsonl") and cfg.model.preset == str(recipes / "my-preset")
    # A path typed on the command line is relative to where it was typed, and stored absolute.
    cfg = config.load(str(recipe), {"data.path": "typed.jsonl"})
    assert cfg.data.path == str(elsewhere / "typed.jsonl")


def test_names_that_are_not_paths_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a folder named like the built-in model does not shadow it
    for data_path in ("sample", "hf:databricks/databricks-dolly-15k", "gs://bucket/d.jsonl"):
        assert config.load(None, {"data.path": data_path}).data.path == data_path
    for preset in ("tiny", "gemma_2b_en", "kaggle://keras/gemma/keras/gemma_2b_en"):
        assert config.load(None, {"model.preset": preset}).model.preset == preset


def test_bare_on_and_off_reach_word_settings_as_words(tmp_path):
    """YAML 1.1 reads a bare `off` as false: --set train.time_limit=off and `packing: off` must still mean off."""
    cfg = config.load(None, dict([config.parse_set("train.time_limit=off"), config.parse_set("data.packing=on")]))
    assert (cfg.train.time_limit, cfg.data.packing) == ("off", "on")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  packing: off\n")
    assert config.load(recipe).data.packing == "off"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"train:\n  epochs: 1\n lora: 2\n", "r.yaml:3 is not valid YAML: expected <block end>"),
        (b"train:\n\tepochs: 1\n", "r.yaml:2 is not valid YAML: found character '\\t'"),
        (b"seed: 1\ntrain:\n  epochs: " + b"7" * 5000 + b"\n", "r.yaml:3 is not valid YAML: an integer of over 4300"),
        (b"seed: 1\nnote: a\x00b\n", "r.yaml:2 is not valid YAML: unacceptable character #x0000"),
        (b"seed: 1\n---\nseed: 2\n", "r.yaml:2 is not valid YAML: expected a single document in the stream, but"),
        (b"seed: 1\nnote: caf\xe9\n", "r.yaml:2 is not valid YAML: not UTF-8 text"),
        (b"a: !!python/object:os.system x\n", "r.yaml:1 is not valid YAML: could not determine a constructor"),
        (b"lora:\n  rank: 4\n  alpha: 8\n  rank: 16\n", "r.yaml:4 is not valid YAML: key 'rank' is given twice"),
        (b"lora:\n  rank: 4\ntrain: {}\nlora:\n  alpha: 8\n", "r.yaml:4 is not valid YAML: key 'lora' is given twice"),
        (b"", "r.yaml holds no settings (it is empty, or comments alone)"),  # a recipe cut short: not the defaults
        (b"# lora:\n#   rank: 8\n", "r.yaml holds no settings (it is empty, or comments alone)"),
    ],
)
def test_a_broken_recipe_names_its_file_and_line(tmp_path, body, message):
    (tmp_path / "r.yaml").write_bytes(body)
    with pytest.raises(UserError) as refused:
        config.read_recipe(tmp_path / "r.yaml")
    assert f"recipe {tmp_path / message}" in str(refused.value) and "\n" not in str(refused.value)


def test_every_setting_is_declared_with_help_and_documented_in_its_section():
    """One declaration per option: its section's `Args:` docstring is written from it."""
    sections = typing.get_type_hints(config.Config)
    for item in config.settings(config.Config):
        assert item.help.endswith((".", ")")), item.key
        assert not item.flag or item.panel, f"{item.key}: a flag needs a help panel"
        section, _, name = item.key.rpartition(".")
        doc = sections[section].__doc__ if section else config.Config.__doc__
        assert f"    {name}: " in doc and item.help.split()[0] in doc, item.key
        assert not item.flag or f"Flag: {item.flag}." in " ".join(doc.split()), item.key


@pytest.mark.parametrize(
    "bounds, inside, outside, rule",
    [
        (config.Range(1), [1, 7], [0, -1], "must be at least 1"),
        (config.Range(0, low_open=True), [1e-9, 5], [0, -1], "must be positive"),
        (config.Range(0), [0, 3], [-1], "must not be negative"),
        (config.Range(0, 1, low_open=True, high_open=True), [0.5], [0, 1], "must be between 0 and 1 (exclusive)"),
        (config.Range(0, 1, low_open=True), [1, 0.5], [0, 1.5], "must be in (0, 1]"),
        (config.Range(0, 2**32 - 1), [0, 2**32 - 1], [-1, 2**32], "must be between 0 and 4294967295"),
    ],
)
def test_a_range_checks_and_says_its_bounds(bounds, inside, outside, rule):
    assert all(v in bounds for v in inside) and not any(v in bounds for v in outside)
    assert bounds.rule() == rule


def test_each_check_sits_with_its_field_and_names_it():
    rank = next(s for s in config.settings(config.Config) if s.key == "lora.rank")
    assert rank.problem(0) == "LoRA rank must be at least 1, got 0; try --rank 4"
    assert rank.problem(None) is None and rank.problem(4) is None
    with pytest.raises(UserError, match="^--seq-len must be at least 8, got 2"):
        config.check("model.seq_len", 2, name="--seq-len")
    with pytest.raises(UserError, match="^--mesh is empty"):
        config.load(None, {"distribution.parallel": "data", "distribution.mesh": " "})


def test_a_message_for_the_command_line_is_reworded_for_python():
    resume = config.Setting("resume", bool, False, "", flag="--resume")
    for cli, python in [
        ("pass --overwrite to replace it or choose another --output", "pass output.overwrite=True to replace it or "
         "choose another output.dir"),
        ("lower --batch-size (or use --batch-size auto) or --seq-len", 'lower train.batch_size (or use '
         'train.batch_size="auto") or model.seq_len'),
        ("JAX-only; pass --backend jax, or --parallel none", 'JAX-only; pass backend="jax", or '
         'distribution.parallel="none"'),
        ("must be at least 1, got 0; try --rank 4", "must be at least 1, got 0; try lora.rank=4"),
        ("--resume needs --output DIR, the run directory", "resume=True needs output.dir=DIR, the run directory"),
        ("pass --output gs://BUCKET/PATH.", 'pass output.dir="gs://BUCKET/PATH".'),
        ("raise --epochs or --max-steps to train further", "raise train.epochs or train.max_steps to train further"),
        ("--output is empty", "output.dir is empty"),
        ("use --set train.epochs=2 or --recipe tiny", "use --set train.epochs=2 or --recipe tiny"),  # no such setting
        ("--output 'ftp://x' is not a place", 'output.dir="ftp://x" is not a place'),  # quoted once, not twice
        ("`finetune export --format hf` keeps it; lower --rank", "`finetune export --format hf` keeps it; lower "
         "lora.rank"),  # a command quoted in backticks stays the command line's
    ]:  # fmt: skip
        assert config.in_python_words(cli, (resume,)) == python
    assert config.in_python_words("pass --overwrite", with_settings=False) == "pass --overwrite"


def test_dora_on_a_quantized_base_is_refused_before_anything_runs():
    with pytest.raises(UserError, match="--dora with --quantize int4 is not supported"):
        config.load(None, {"lora.dora": True, "model.quantize": "int4"})


def test_a_dict_of_settings_may_name_them_dotted_as_load_config_s_overrides():
    """finetune.run({"lora.rank": 8}) reads as {"lora": {"rank": 8}} (it said: unknown config key 'lora.rank'; did
    you mean 'lora.rank'?), beside sections; a setting given both ways is refused."""
    cfg = config.from_dict({"model.preset": "tiny", "lora": {"rank": 8}, "lora.alpha": 3, "train.max_steps": 5})
    assert (cfg.model.preset, cfg.lora.rank, cfg.lora.alpha, cfg.train.max_steps) == ("tiny", 8, 3.0, 5)
    with pytest.raises(UserError, match="'lora.rank' is given twice"):
        config.from_dict({"lora": {"rank": 8}, "lora.rank": 4})
    with pytest.raises(UserError, match="unknown config key 'lora.rnak'; did you mean 'lora.rank'"):
        config.from_dict({"lora.rnak": 4})
    with pytest.raises(UserError, match="'lora' is not a section"):
        config.from_dict({"lora": 3, "lora.rank": 2})


def test_reward_files_are_kept_absolute_and_built_ins_as_they_are(tmp_path, monkeypatch):
    """A GRPO run's config.yaml names its reward file absolute, as its data: a resume from another directory found
    the data and not `rewards.py`. In a recipe, a reward file is beside the recipe, as its data is."""
    monkeypatch.chdir(tmp_path)
    given = ["rewards.py:score", "run:runs/judge", "format:a/b:c", "exact", "math", "length:8", "pkg.mod:fn",
             "gs://b/r.py:f"]  # fmt: skip
    cfg = config.load(None, {"train.method": "grpo", "train.reward": given, "data.path": "p.jsonl"})
    assert cfg.train.reward == [f"{tmp_path}/rewards.py:score", f"run:{tmp_path}/runs/judge", *given[2:]]
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "r.yaml").write_text(
        "train:\n  method: grpo\n  reward: [judge.py:score, exact]\ndata:\n  path: p.jsonl\n"
    )
    assert config.load(folder / "r.yaml").train.reward == [f"{folder}/judge.py:score", "exact"]


def test_another_data_file_than_the_recipe_s_leaves_the_recipe_s_split_behind(tmp_path):
    """A recipe of a Hugging Face dataset names its split (train_prefs); --data FILE over it was refused for that
    split, a flag the user never typed. --data-split typed beside it is kept."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  path: hf:someone/prefs\n  split: train_prefs\n")
    assert config.load(recipe).data.split == "train_prefs"
    assert config.load(recipe, {"data.path": "mine.jsonl"}).data.split == config.DataConfig().split
    assert config.load(recipe, {"data.path": "hf:other", "data.split": "test"}).data.split == "test"


def test_a_resume_that_changes_parallel_leaves_the_checkpoint_s_mesh_behind():
    """A run of --parallel model --mesh 2x2 resumed with --parallel none (or data on other devices): the mesh was
    the old devices' layout, which the resume was refused against ("--mesh 2x2 needs --parallel data or --parallel
    model", a flag the user never gave). A mesh given with the resume is kept."""
    jax = {"backend": "jax"}
    base = config.load(None, {**jax, "distribution.parallel": "model", "distribution.mesh": "2x2"}).to_dict()
    assert config.load(None, {"distribution.parallel": "none"}, base=base).distribution.mesh is None
    assert config.load(None, {**jax, "distribution.parallel": "data"}, base=base).distribution.mesh is None
    kept = config.load(None, {**jax, "distribution.parallel": "data", "distribution.mesh": "4x1"}, base=base)
    assert kept.distribution.mesh == "4x1"
    assert config.load(None, {}, base=base).distribution.mesh == "2x2"  # the same devices: the run's own
