"""Every shipped recipe loads against the config's keys, says how to run it, and is found by name.

A recipe that names a key the code no longer has, or a wrong type, fails here
rather than in a user's first run. Pure config and the `recipes` command: no
keras, so no backend.

End to end over the shipped recipes (finetune/recipes/*.yaml, data rather than a module): each goes through
config.py and the `recipes` command.
"""

import pytest
from typer.testing import CliRunner

from finetune import config
from finetune.cli import app
from finetune.data.formats import SAMPLE
from finetune.platform.errors import UserError

RECIPES_DIR = config.RECIPES_DIR
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert RECIPES, f"no recipes in {RECIPES_DIR}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(recipe):
    assert isinstance(config.load(recipe), config.Config)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_opens_with_its_command_and_a_summary(recipe):
    command, summary = recipe.read_text(encoding="utf-8").splitlines()[:2]
    assert command == f"# finetune gemma --recipe {recipe.stem}", f"{recipe.name} must open with its command"
    assert summary.startswith("# ") and config.recipe_summary(recipe), f"{recipe.name}: line 2 is its one-line summary"


def test_tiny_recipe_is_the_offline_quickstart():
    cfg = config.load(RECIPES_DIR / "tiny.yaml")
    assert cfg.model.preset == "tiny"
    assert cfg.data.path == SAMPLE


def test_kaggle_recipes_fit_their_accelerators():
    t4 = config.load("kaggle-2xt4")
    assert (t4.distribution.parallel, t4.distribution.mesh) == ("data", None)
    assert t4.model.precision == "float16"  # a T4 has fast float16 and no bf16
    qlora = config.load("kaggle-t4-7b-int4")
    assert (qlora.model.preset, qlora.model.quantize, qlora.model.precision) == ("gemma_7b_en", "int4", "float16")
    tpu = config.load("kaggle-tpu")
    assert (tpu.distribution.parallel, tpu.distribution.mesh) == ("model", "1x8")  # a v3-8's 8 cores
    assert tpu.model.precision == "bfloat16"
    assert config.parse_duration(tpu.train.time_limit) < 9 * 3600  # Kaggle's TPU sessions end at 9 hours
    for cfg in (t4, qlora, tpu):
        assert cfg.backend == "jax" and cfg.output.dir is None  # /kaggle/working/runs/<timestamp> in a notebook


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_setting_says_why(recipe):
    for number, line in enumerate(recipe.read_text(encoding="utf-8").splitlines(), start=1):
        code = line.split("#", 1)[0]
        key, colon, value = code.partition(":")
        if colon and value.strip():  # a setting, not a section header or a comment
            assert "  # " in line, f"{recipe.name}:{number}: `{key.strip()}` needs an inline comment saying why"


@pytest.mark.parametrize("name", ["tiny", "tiny.yaml", "recipes/tiny.yaml"])
def test_shipped_recipes_are_found_by_name_from_anywhere(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: `recipes/tiny.yaml` is the pre-move path in old commands
    assert config.find_recipe(name) == RECIPES_DIR / "tiny.yaml"
    assert config.load(name).model.preset == "tiny"


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("lora:\n  rank: 7\n")
    assert config.load("tiny.yaml").lora.rank == 7
    assert config.load("tiny").lora.rank == 4  # a bare name is not a file here, so the shipped one


@pytest.mark.parametrize("name", ["nope", "recipes/nope.yaml"])
def test_an_unknown_recipe_lists_the_shipped_ones(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=", ".join(recipe.stem for recipe in RECIPES)):
        config.load(name)


def test_a_missing_path_elsewhere_is_not_read_as_a_shipped_recipe(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        config.load(tmp_path / "tiny.yaml")


def test_recipes_command_lists_names_and_summaries():
    result = CliRunner().invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    for recipe in RECIPES:
        assert f"{recipe.stem}  " in result.output and config.recipe_summary(recipe) in result.output


def test_recipes_copy_writes_a_copy_and_never_overwrites(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["recipes", "copy", "tiny", str(tmp_path)])  # a directory: DEST/tiny.yaml
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tiny.yaml").read_bytes() == (RECIPES_DIR / "tiny.yaml").read_bytes()
    assert config.load(tmp_path / "tiny.yaml").model.preset == "tiny"

    mine = tmp_path / "mine.yaml"
    mine.write_text("lora:\n  rank: 8\n")
    result = runner.invoke(app, ["recipes", "copy", "tiny", str(mine)])
    assert result.exit_code == 2 and "already exists" in result.output
    assert mine.read_text() == "lora:\n  rank: 8\n"


def test_recipes_copy_of_an_unknown_name_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["recipes", "copy", "nope", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "tiny" in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_recipes_copy_to_a_place_it_cannot_write_exits_2(tmp_path, read_only_dir):
    for dest, expected in (
        (read_only_dir, "not a writable directory"),
        (tmp_path / ("r" * 256), "too long for the file system"),
        (tmp_path / "missing" / "x.yaml", "its folder does not exist"),
    ):
        result = CliRunner().invoke(app, ["recipes", "copy", "tiny", str(dest)])
        assert result.exit_code == 2 and expected in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read-only"] and not list(read_only_dir.iterdir())


def test_a_section_set_whole_merges_into_the_recipes_section(tmp_path):
    """`--set 'train={learning_rate: 0.04}'` replaced the recipe's whole train section: its max_steps and
    samples fell back to the defaults, silently. A section given as a mapping is merged, as a recipe is."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  preset: tiny\n  seq_len: 48\ntrain:\n  max_steps: 3\n  learning_rate: 0.02\n")
    cfg = config.load(recipe, {"train": {"learning_rate": 0.04}, "model": {}})
    assert (cfg.train.max_steps, cfg.train.learning_rate) == (3, 0.04)
    assert (cfg.model.preset, cfg.model.seq_len) == ("tiny", 48)
    parsed = dict([config.parse_set("train={learning_rate: 0.05}")])  # as the command line reads it
    assert config.load(recipe, parsed).train.max_steps == 3
    assert config.load(recipe, {"train.max_steps": 5}).train.learning_rate == 0.02  # a key alone, as before


def test_a_second_recipe_is_refused_not_the_first_dropped(tmp_path):
    """Two --recipe: the last replaced the first whole (its data, preset and learning rate gone), silently."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text("model:\n  preset: tiny\n")
    for command in ("gemma", "plan"):
        extra = ["--plan-only"] if command == "gemma" else []
        result = CliRunner().invoke(app, [command, "--recipe", str(tmp_path / "a.yaml"), "--recipe",
                                          str(tmp_path / "b.yaml"), *extra])  # fmt: skip
        assert result.exit_code == 2 and "--recipe is given 2 times" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml", "b.yaml"]
