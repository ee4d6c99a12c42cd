"""The wheel: ``./dev wheel`` builds dist/clairvoyant-<version>-*.whl, and in a fresh virtual
environment with no Rust toolchain on PATH the installed package runs: ``clairvoyant
--version``, ``clairvoyant plan``, one epoch of a Job, the PyTorch drop-in, ``clairvoyant run
-- cat FILE`` and the demo's smallest form (the checkout's harness, benches/, which the wheel
does not ship, on the wheel's package). The fresh environment sees the test environment's
third-party packages (torch, numpy, ...) through a .pth file, not to download them again;
clairvoyant itself comes from the wheel only."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import numpy as np
import pytest

from launchers import clean_env, missing

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
TIMEOUT = float(os.environ.get("CV_TEST_TIMEOUT", 600))
# Modules of the benchmark and demo harness that the package once held.
HARNESS = {"bench.py", "demo.py", "_emulation.py", "_validate.py"}


def _build_wheel() -> Path:
    if os.environ.get("CLAIRVOYANT_WHEEL"):
        return Path(os.environ["CLAIRVOYANT_WHEEL"])
    if shutil.which("cargo") is None or not (ROOT / ".venv" / "bin" / "maturin").exists():
        missing("building the wheel needs cargo and maturin in .venv (./dev build sets them up)")
    proc = subprocess.run([str(ROOT / "dev"), "wheel"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"./dev wheel failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    wheels = sorted(glob.glob(str(ROOT / "dist" / f"clairvoyant-{VERSION}-*.whl")), key=os.path.getmtime)
    assert wheels, f"./dev wheel made no dist/clairvoyant-{VERSION}-*.whl:\n{proc.stdout[-2000:]}"
    return Path(wheels[-1])


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    wheel = _build_wheel()
    import zipfile

    # The stable ABI from the oldest Python the project states (and its tests run on).
    floor = PROJECT["requires-python"].removeprefix(">=").replace(".", "")
    assert f"-cp{floor}-abi3-" in wheel.name, f"{wheel.name}: expected the stable ABI of Python >= {PROJECT['requires-python']}"
    names = zipfile.ZipFile(wheel).namelist()
    for part in ("clairvoyant/libclairvoyant_preload.so", "clairvoyant/cli.py", "clairvoyant/torch/__init__.py"):
        assert part in names, f"{wheel.name} lacks {part}"
    assert any(n.startswith("clairvoyant/_native") and n.endswith(".so") for n in names), f"{wheel.name} lacks the native module"
    # The benchmark and demo harness stays in the checkout.
    harness = [n for n in names if n.startswith("benches/") or n.split("/")[-1] in HARNESS or "/_bench_" in n]
    assert not harness, f"{wheel.name} ships the benchmark and demo harness: {harness}"

    env_dir = tmp_path_factory.mktemp("wheel") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # Third-party packages (torch, numpy, matplotlib) from this environment, after the new one's own.
    import torch

    third_party = {str(Path(torch.__file__).parent.parent), sysconfig.get_paths()["purelib"]}
    Path(site, "zz-third-party.pth").write_text("".join(p + "\n" for p in sorted(third_party)))
    # pip of this environment installs into the new one; no index: only the wheel is new.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"pip install {wheel.name} failed:\n{proc.stdout}{proc.stderr}"
    return env_dir


RUST = ("cargo", "rustc", "rustup", "rustdoc", "rustfmt", "maturin")


def system_bin(venv: Path) -> Path:
    """A directory of links to the system's commands, less any Rust tool (a toolchain installed
    in /usr/bin stays out of sight too)."""
    out = venv / "system-bin"
    if not out.is_dir():
        out.mkdir()
        for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if name.startswith(RUST) or name.startswith(("cargo-", "rust-")) or (out / name).exists():
                    continue
                os.symlink(os.path.join(d, name), out / name)
    return out


def venv_path(venv: Path) -> str:
    return os.pathsep.join([str(venv / "bin"), str(system_bin(venv))])


def run(venv: Path, *args, cwd=None, expect: int = 0, **extra) -> subprocess.CompletedProcess:
    """A command in the fresh environment with no Rust toolchain (nor the source tree) in sight,
    which must exit with ``expect``."""
    path = venv_path(venv)
    env = clean_env(PATH=path, VIRTUAL_ENV=str(venv), **extra)
    for k in ("PYTHONPATH", "CARGO_HOME", "RUSTUP_HOME", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR"):
        env.pop(k, None)
    proc = subprocess.run([str(a) for a in args], env=env, cwd=cwd or venv, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == expect, f"{' '.join(str(a) for a in args)} exited {proc.returncode}, not {expect}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


def test_no_rust_and_the_package_is_the_wheels(venv):
    for tool in RUST:
        assert shutil.which(tool, path=venv_path(venv)) is None, f"{tool} is on the fresh environment's PATH"
    out = run(
        venv,
        venv / "bin" / "python",
        "-c",
        "import clairvoyant, clairvoyant._native as n; print(clairvoyant.__file__); print(n.__file__); print(clairvoyant.preload_library())",
    ).stdout.split()
    for path in out:
        assert Path(path).resolve().is_relative_to(venv.resolve()), f"{path} is not from the wheel installed in {venv}"


def test_version_and_plan(venv):
    assert run(venv, venv / "bin" / "clairvoyant", "--version").stdout.strip() == f"clairvoyant {VERSION}"
    plan = run(
        venv,
        venv / "bin" / "clairvoyant",
        "plan",
        "--samples",
        "1000",
        "--world-size",
        "4",
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--memory",
        "20MB",
        "--json",
    )
    assert '"placement"' in plan.stdout or '"histogram"' in plan.stdout, plan.stdout[:500]


def test_the_benchmarks_stay_in_the_checkout_and_the_package_says_so(venv):
    err = run(venv, venv / "bin" / "python", "-m", "clairvoyant.bench", "--only", "epoch0", expect=2).stderr
    assert "./dev bench" in err and "benches/" in err, err


def test_one_epoch_of_a_job(venv, tmp_path):
    rng = np.random.default_rng(2)
    files = []
    for k in range(40):
        p = tmp_path / f"s{k:03d}.bin"
        p.write_bytes(rng.integers(0, 256, size=500 + k, dtype=np.uint8).tobytes())
        files.append(p)
    (tmp_path / "list.txt").write_text("".join(f"{p}\t{k % 2}\n" for k, p in enumerate(files)))
    code = (
        "import sys, clairvoyant\n"
        "src = clairvoyant.FileList(sys.argv[1])\n"
        "job = clairvoyant.Job(src, batch_size=8, epochs=1, seed=3)\n"
        "sizes = sorted(len(bytes(v)) for views, _ in job.batches(0) for v in views)\n"
        "job.close()\n"
        "print(sizes == sorted(500 + k for k in range(40)), len(sizes))\n"
    )
    assert run(venv, venv / "bin" / "python", "-c", code, tmp_path / "list.txt").stdout.split() == ["True", "40"]


def _imagenet(root: Path, classes: int = 4, per_class: int = 6) -> Path:
    from PIL import Image

    rng = np.random.default_rng(4)
    for c in range(classes):
        d = root / "train" / f"n{c:04d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(d / f"img{i}.jpg")
    return root


def test_dropin(venv, tmp_path):
    data = _imagenet(tmp_path / "imagenet")
    out = run(
        venv,
        venv / "bin" / "python",
        ROOT / "examples" / "train_imagenet.py",
        "--data",
        data,
        "--epochs",
        "1",
        "--workers",
        "0",
        "--batch-size",
        "8",
        "--image-size",
        "32",
    )
    assert "epoch 0: 24 images" in out.stdout, out.stdout


def test_clairvoyant_run_cat(venv, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    payload = np.random.default_rng(5).integers(0, 256, size=70_000, dtype=np.uint8).tobytes()
    (data / "f.bin").write_bytes(payload)
    proc = subprocess.run(
        [venv / "bin" / "clairvoyant", "run", "--dataset", data, "--", "cat", data / "f.bin"],
        env=clean_env(PATH=venv_path(venv)), capture_output=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout == payload


def test_demo_smallest(venv, tmp_path):
    # From the checkout (benches/ is not in the wheel); clairvoyant itself is the wheel's.
    run(
        venv, venv / "bin" / "python", "-m", "benches.demo", "--samples", "48", "--classes", "3", "--epochs", "1",
        "--ranks", "2", "--batch-size", "8", "--bandwidth-mbps", "500", "--latency-ms", "0.1", "--out", tmp_path,
        cwd=ROOT,
    )  # fmt: skip
    assert (tmp_path / "demo.json").exists()
