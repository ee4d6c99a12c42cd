"""The prerequisites the README states are the ones the project has: the Rust version in
Cargo.toml (rust-version) and the README agree and the toolchain building it is not older, the
Python versions of pyproject.toml, ruff and the README agree and the tests run on one of them,
and the README names the C compiler and the system packages of the launchers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def version(text: str) -> tuple:
    return tuple(int(x) for x in text.split("."))


def test_rust_version_agrees_and_holds():
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    declared = cargo["workspace"]["package"]["rust-version"]
    m = re.search(r"Rust\s+(?:toolchain\s+)?(\d+\.\d+)\s+or\s+later", README)
    assert m, "the README states the minimum Rust ('Rust X.Y or later')"
    assert m.group(1) == declared, f"README says Rust {m.group(1)}, Cargo.toml's rust-version is {declared}"
    for toml in sorted(ROOT.glob("crates/*/Cargo.toml")):
        package = tomllib.loads(toml.read_text())["package"]
        assert package.get("rust-version") == {"workspace": True}, f"{toml}: rust-version.workspace = true"
    if shutil.which("rustc") is None:
        pytest.skip("no rustc on PATH")
    out = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=True).stdout
    have = version(re.search(r"(\d+\.\d+)\.\d+", out).group(1))
    assert have >= version(declared), f"{out.strip()} is older than rust-version {declared}"


def test_python_version_agrees_and_holds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=(\d+\.\d+)", project["project"]["requires-python"]).group(1)
    m = re.search(r"Python\s+(\d+\.\d+)\s+or\s+later", README)
    assert m and m.group(1) == floor, f"README says Python {m and m.group(1)}, requires-python is >={floor}"
    assert project["tool"]["ruff"]["target-version"] == "py" + floor.replace(".", "")
    assert sys.version_info[:2] >= version(floor), f"the tests run on Python {sys.version.split()[0]}, below {floor}"


def test_readme_names_the_compiler_and_system_packages():
    assert "C compiler" in README
    dev = (ROOT / "dev").read_text()
    packages = re.search(r"SYSTEM_PACKAGES=\(([^)]*)\)", dev).group(1).split()
    for package in packages:
        assert package in README, f"README does not name the system package {package} that ./dev installs"


def test_a_missing_launcher_skips_except_on_ci(monkeypatch):
    from launchers import need_command, need_module

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no clairvoyant-no-such-command on PATH .*CI=true"):
        need_command("clairvoyant-no-such-command", install="install it")
    with pytest.raises(pytest.fail.Exception, match="cannot import clairvoyant_no_such_module"):
        need_module("clairvoyant_no_such_module", install="install it")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="no clairvoyant-no-such-command on PATH"):
        need_command("clairvoyant-no-such-command", install="install it")
