"""System description (performance model) resolution: an explicit TOML file, else
``$CLAIRVOYANT_CONFIG``, else ``<cache dir>/system.toml``, else defaults detected from the
machine. Returns the model as TOML text for the engine."""

from __future__ import annotations

import os

from . import _native


def resolve(config=None) -> tuple:
    """(path used or None, model TOML text)."""
    return _native.resolve_config(None if config is None else os.fspath(config))


def default_path() -> str:
    """``<cache dir>/system.toml``: the description every job uses when none is named."""
    return os.path.join(_native.default_index_dir(), "system.toml")
