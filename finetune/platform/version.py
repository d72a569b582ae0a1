"""finetune's version, low in the package so that any module may read it (pyproject.toml reads it from here)."""

__version__ = "0.2.0"
