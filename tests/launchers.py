"""What the launcher tests share: a prerequisite that is missing skips the test with the reason,
except on CI (``CI=true``), where it fails (CI installs every prerequisite through ./dev); and
the environment of a launch with no launcher variables of the test's own run in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

_LAUNCHER_PREFIXES = ("CLAIRVOYANT_", "SLURM_", "MASTER_", "TORCHELASTIC_", "OMPI_", "PMI", "PMIX_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Skip with ``reason``; on CI fail with it."""
    if on_ci():
        pytest.fail(f"{reason} (CI=true: ./dev test installs this; the test must run)", pytrace=False)
    pytest.skip(reason)


def need_command(*names: str, install: str) -> None:
    for name in names:
        if shutil.which(name) is None:
            missing(f"no {name} on PATH ({install})")


def need_module(name: str, install: str) -> None:
    """``name`` imports in a child process (importing mpi4py.MPI here would start MPI in the test
    process, and every process it forks)."""
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        missing(f"cannot import {name}: {proc.stderr.strip().splitlines()[-1:]} ({install})")


def clean_env(**extra: str) -> dict:
    """This process's environment without any launcher's variables (the cache directory and
    shared-memory folder the tests use are kept), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_NAMES)}
    for kept in ("CLAIRVOYANT_CACHE_DIR", "CLAIRVOYANT_SHM_DIR"):
        if os.environ.get(kept):
            env[kept] = os.environ[kept]
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env
