"""clairvoyant.torch.DataLoader yields exactly the batches torch's DataLoader yields.

Each case runs ``tests/dropin_train.py`` (a training-style script in which the choice of
DataLoader is the only line that differs) once with ``--loader torch`` and once with the loader
under test, and compares the per-rank records of every batch (a SHA-256 of its tensors' dtypes,
shapes and bytes, and one of its labels) line for line.

``CLAIRVOYANT_DROPIN_LOADER=torch`` runs torch's DataLoader on both sides: the suite then checks
itself (the script is deterministic, and its resume path reproduces an uninterrupted run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("PIL")

SCRIPT = Path(__file__).with_name("dropin_train.py")
CANDIDATE = os.environ.get("CLAIRVOYANT_DROPIN_LOADER", "clairvoyant")
TIMEOUT = 180
ALL_FIELDS = ("epoch", "step", "split", "n", "digest", "labels")
ORDER_FIELDS = ("epoch", "step", "split", "n", "labels")

# Images per class; counts that no batch size used here divides, so last batches are partial
# and a 2-rank DistributedSampler pads (train) and drops (val).
TRAIN_COUNTS = (14, 11, 15, 9, 13)  # 62
VAL_COUNTS = (6, 5, 6, 4, 6)  # 27


def write_split(root: Path, counts, seed: int) -> None:
    """Random-noise images of varying sizes, JPEG and PNG, some greyscale, as ImageFolder wants."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    k = 0
    for c, n in enumerate(counts):
        d = root / f"class_{c:02d}"
        d.mkdir(parents=True)
        for j in range(n):
            h, w = (int(x) for x in rng.integers(20, 72, size=2))
            img = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
            if k % 7 == 3:
                img = img.convert("L")
            if k % 3 == 0:
                img.save(d / f"img_{j:03d}.png")
            else:
                img.save(d / f"img_{j:03d}.jpg", quality=85)
            k += 1


@pytest.fixture(scope="session")
def imagenet_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dropin") / "imagenet"
    write_split(root / "train", TRAIN_COUNTS, seed=1)
    write_split(root / "val", VAL_COUNTS, seed=2)
    return root


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    torchrun: bool = False
    # Resume: stop after "EPOCH:STEP", then resume with `resume_args` replacing `args`' values.
    stop_after: str | None = None
    resume_args: tuple[str, ...] | None = None
    fields: tuple[str, ...] = ALL_FIELDS


W2 = ("--workers", "2")
VAL_WORKERS = ("--val", *W2)
TORCHRUN = ("--sampler", "distributed", "--val", "--workers", "1")
DIST_ONE_PROCESS = ("--sampler", "distributed", "--batch-size", "7")
CASES = [
    Case("torchrun_distributed_sampler", TORCHRUN, torchrun=True),
    Case("mp_spawn_distributed_sampler", ("--launch", "spawn", "--nprocs", "2", "--sampler", "distributed", "--val")),
    Case("one_process_shuffle", ("--shuffle", "--val")),
    Case("one_process_no_shuffle", ("--no-shuffle",)),
    Case("drop_last_true", ("--drop-last", "--batch-size", "7")),
    Case("drop_last_false_distributed_sampler", DIST_ONE_PROCESS),
    Case("validation_loader", VAL_WORKERS),
    Case("custom_collate", ("--collate", "custom", *W2)),
    Case("v2_transforms", ("--transforms", "v2", *W2)),
    Case("fakedata", ("--fake", "--val", *W2)),
    Case("workers_fork_worker_init_fn", (*W2, "--start-method", "fork", "--worker-init")),
    # Spawned and forkserver workers import torch: one epoch, or workers that persist.
    Case("workers_spawn_generator", (*W2, "--start-method", "spawn", "--generator", "--epochs", "1")),
    Case(
        "workers_forkserver_persistent_prefetch_factor",
        (*W2, "--start-method", "forkserver", "--persistent", "--prefetch-factor", "3"),
    ),
    Case("persistent_workers", (*W2, "--persistent", "--val", "--epochs", "3")),
    Case("peek", ("--peek", "--val")),
    Case("peek_persistent_workers", ("--peek", *W2, "--persistent")),
    # The uninterrupted runs of resume cases with the arguments of an earlier case are shared.
    Case("resume_mid_epoch", VAL_WORKERS, stop_after="1:3"),
    Case(
        "resume_mid_epoch_other_workers",
        (*W2, "--transforms", "eval"),
        stop_after="0:4",
        resume_args=("--workers", "0", "--transforms", "eval"),
    ),
    Case(
        "resume_mid_epoch_other_workers_augmented",
        DIST_ONE_PROCESS,
        stop_after="1:2",
        resume_args=W2,
        fields=ORDER_FIELDS,
    ),
    Case("resume_epoch_boundary", DIST_ONE_PROCESS, stop_after="1:0"),
    Case("resume_mid_epoch_torchrun", TORCHRUN, torchrun=True, stop_after="1:2"),
]


class Runner:
    """Runs the script; identical runs (same loader and arguments) are run once per session."""

    def __init__(self, data: Path, root: Path):
        self.data, self.root = data, root
        self.cache: dict[tuple, Path] = {}
        self.lock = threading.Lock()
        self.count = 0

    def __call__(self, loader: str, args: tuple[str, ...], torchrun: bool = False, resume: Path | None = None) -> Path:
        key = (loader, args, torchrun, str(resume))
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            self.count += 1
            out = self.root / f"run{self.count:03d}-{loader}"
        cmd = [sys.executable]
        if torchrun:
            cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        cmd += [str(SCRIPT), "--loader", loader, "--data", str(self.data), "--out", str(out), *args]
        if resume is not None:
            cmd += ["--resume", str(resume / "checkpoint_rank{rank}.pt")]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            pytest.fail(f"--loader {loader} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}", pytrace=False)
        if loader == "clairvoyant":
            # ImageFolder is read through clairvoyant's cache; FakeData (no files) falls back.
            notice = "clairvoyant: not cached" in proc.stderr
            if notice != ("--fake" in args):
                pytest.fail(f"{' '.join(cmd)}: expected {'a' if '--fake' in args else 'no'} 'not cached' notice:\n{proc.stderr[-2000:]}", pytrace=False)
        with self.lock:
            self.cache[key] = out
        return out


@pytest.fixture(scope="session")
def run(imagenet_dir, tmp_path_factory):
    return Runner(imagenet_dir, tmp_path_factory.mktemp("dropin-runs"))


def both(fn, *calls):
    """Run the reference and the candidate side by side (two cores); re-raise the first failure."""
    results, errors = [None] * len(calls), []

    def go(i, c):
        try:
            results[i] = fn(*c)
        except BaseException as e:  # noqa: BLE001 - pytest.fail's Failed is a BaseException
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def records(*outs: Path) -> dict[int, list[dict]]:
    """Per rank, the records of `outs` in order (a stopped run, then its resumed run)."""
    ranks = sorted({int(p.stem[4:]) for out in outs for p in out.glob("rank*.jsonl")})
    assert ranks, f"no rank*.jsonl in {[str(o) for o in outs]}"
    return {r: [json.loads(line) for out in outs for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in ranks}


def where(rec: dict) -> str:
    return f"epoch {rec['epoch']} step {rec['step']} ({rec['split']})"


def assert_same(case_id: str, ref: dict, got: dict, fields=ALL_FIELDS, ref_name="torch", got_name=CANDIDATE) -> None:
    if sorted(got) != sorted(ref):
        pytest.fail(f"{case_id}: ranks {sorted(got)} from {got_name}, {sorted(ref)} from {ref_name}", pytrace=False)
    for rank in sorted(ref):
        a, b = ref[rank], got[rank]
        for i, (x, y) in enumerate(zip(a, b)):
            diff = [f for f in fields if x.get(f) != y.get(f)]
            if diff:
                detail = ", ".join(f"{f}: {x.get(f)!r} from {ref_name}, {y.get(f)!r} from {got_name}" for f in diff)
                pytest.fail(
                    f"{case_id}: first difference at rank {rank}, batch {i} = {where(x)} of {ref_name} / "
                    f"{where(y)} of {got_name}: {detail}",
                    pytrace=False,
                )
        if len(a) != len(b):
            longer, name = (a, ref_name) if len(a) > len(b) else (b, got_name)
            extra = longer[min(len(a), len(b))]
            pytest.fail(
                f"{case_id}: rank {rank}: {len(a)} batches from {ref_name}, {len(b)} from {got_name}; "
                f"the first extra one ({name}) is {where(extra)}",
                pytrace=False,
            )


def override(args: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    """`args` with the options in `new` replacing theirs (options with one value or none)."""
    out, i, names = [], 0, {a for a in new if a.startswith("--")}
    while i < len(args):
        a = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if a in names:
            i += 2 if takes_value else 1
            continue
        out.append(a)
        if takes_value:
            out.append(args[i + 1])
            i += 1
        i += 1
    return (*out, *new)


def test_script_records_every_batch(run):
    """The reference run itself: 62 train images in batches of 8, every image once per epoch."""
    out = run("torch", ("--shuffle", "--val"))
    recs = records(out)[0]
    train = [r for r in recs if r["split"] == "train"]
    assert [r["n"] for r in train if r["epoch"] == 0] == [8] * 7 + [6]
    assert [(r["epoch"], r["step"]) for r in train] == [(e, s) for e in range(2) for s in range(8)]
    assert sum(r["n"] for r in recs if r["split"] == "val") == 2 * sum(VAL_COUNTS)
    # Different random augmentations and orders from one epoch to the next.
    assert {r["digest"] for r in train if r["epoch"] == 0}.isdisjoint(r["digest"] for r in train if r["epoch"] == 1)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_batches_as_torch(case: Case, run):
    if case.stop_after is None:
        ref, got = both(run, ("torch", case.args, case.torchrun), (CANDIDATE, case.args, case.torchrun))
        assert_same(case.id, records(ref), records(got), case.fields)
        return

    stop_args = (*case.args, "--stop-after", case.stop_after)
    resume_args = override(case.args, case.resume_args) if case.resume_args else case.args
    ref_stop, got_stop, whole = both(
        run, ("torch", stop_args, case.torchrun), (CANDIDATE, stop_args, case.torchrun), ("torch", case.args, case.torchrun)
    )
    ref_resumed, got_resumed = both(
        run,
        ("torch", resume_args, case.torchrun, ref_stop),
        (CANDIDATE, resume_args, case.torchrun, got_stop),
    )
    # The stopped runs are the same, as any other case; the resumed ones continue alike.
    assert_same(case.id + " (until the stop)", records(ref_stop), records(got_stop), ALL_FIELDS)
    assert_same(case.id, records(ref_stop, ref_resumed), records(got_stop, got_resumed), case.fields)
    # The reference is what it claims: stopped and resumed, torch's DataLoader gives the batches of
    # an uninterrupted run.
    assert_same(
        case.id + " (reference against an uninterrupted run)",
        records(whole),
        records(ref_stop, ref_resumed),
        case.fields,
        "uninterrupted torch",
        "stopped and resumed torch",
    )


def test_comparison_names_the_first_difference():
    rec = [{"epoch": 0, "step": s, "split": "train", "n": 8, "digest": f"d{s}", "labels": f"l{s}"} for s in range(3)]
    changed = [dict(r) for r in rec]
    changed[1]["digest"] = "other"
    with pytest.raises(pytest.fail.Exception, match=r"rank 1, batch 1 = epoch 0 step 1 \(train\).*digest: 'd1'"):
        assert_same("c", {0: rec, 1: rec}, {0: rec, 1: changed})
    assert_same("c", {0: rec}, {0: changed}, ORDER_FIELDS)  # labels only: the same
    with pytest.raises(pytest.fail.Exception, match=r"rank 0: 3 batches from torch, 2 from .*epoch 0 step 2"):
        assert_same("c", {0: rec}, {0: rec[:2]})
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0\] from .*\[0, 1\] from torch"):
        assert_same("c", {0: rec, 1: rec}, {0: rec})
    assert override(("--workers", "2", "--val", "--sampler", "distributed"), ("--workers", "0")) == (
        "--val",
        "--sampler",
        "distributed",
        "--workers",
        "0",
    )
