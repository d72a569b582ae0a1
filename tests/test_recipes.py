"""Every shipped recipe loads against the config's keys and says how to run it.

A recipe that names a key the code no longer has, or a wrong type, fails here
rather than in a user's first run. Pure config: no keras, so no backend.
"""

from pathlib import Path

import pytest

from finetune import config
from finetune.data import SAMPLE

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert RECIPES, f"no recipes in {RECIPES_DIR}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(recipe):
    assert isinstance(config.load(recipe), config.Config)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_opens_with_its_command(recipe):
    first_line = recipe.read_text(encoding="utf-8").splitlines()[0]
    assert first_line.startswith("#"), f"{recipe.name} must open with a comment giving its command"
    assert f"finetune gemma --recipe recipes/{recipe.name}" in first_line


def test_tiny_recipe_is_the_offline_quickstart():
    cfg = config.load(RECIPES_DIR / "tiny.yaml")
    assert cfg.model.preset == "tiny"
    assert cfg.data.path == SAMPLE


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_setting_says_why(recipe):
    for number, line in enumerate(recipe.read_text(encoding="utf-8").splitlines(), start=1):
        code = line.split("#", 1)[0]
        key, colon, value = code.partition(":")
        if colon and value.strip():  # a setting, not a section header or a comment
            assert "  # " in line, f"{recipe.name}:{number}: `{key.strip()}` needs an inline comment saying why"
