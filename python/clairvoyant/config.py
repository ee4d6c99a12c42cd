"""System description (performance model) resolution: an explicit TOML file, else
``$CLAIRVOYANT_CONFIG``, else ``<cache dir>/system.toml``, else defaults detected from the
machine. Returns a typed :class:`clairvoyant._native.SystemModel`."""

from __future__ import annotations

import os

from . import _native


def resolve(config=None) -> "_native.SystemModel":
    """The description in force (its ``path`` is the file used, None for machine defaults), with
    the environment's overrides applied and validated."""
    return _native.SystemModel.resolve(None if config is None else os.fspath(config))


def default_path() -> str:
    """``<cache dir>/system.toml``: the description every job uses when none is named."""
    return os.path.join(_native.default_index_dir(), "system.toml")
