"""Launcher detection for the node cache: run ids that identify nothing are ignored, and local
ranks outside the world are a ConfigError naming ``local_ranks`` (never a panic)."""

from __future__ import annotations

import os

import pytest

import clairvoyant
from clairvoyant import _env


def test_torchelastic_none_is_no_run_id():
    p = _env.detect(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"})
    assert p.run_id == ""
    assert p.local_ranks == [0, 1]


def test_no_run_id_is_made_from_process_ids():
    # Ranks started by their own wrapper scripts have different parents: the id must not differ.
    p = _env.detect(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert p.run_id == ""


@pytest.mark.parametrize("local", [[0, 5], [0, 0], [-1, 0], ["a"]])
def test_bad_local_ranks_name_the_argument(local):
    with pytest.raises(clairvoyant.ConfigError, match="local_ranks"):
        _env.detect(rank=0, world_size=2, local_ranks=local, env={})


def test_job_with_local_ranks_outside_the_world_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_SHM_DIR", str(tmp_path))
    with pytest.raises(clairvoyant.ConfigError, match="local_ranks"):
        clairvoyant.Job(clairvoyant.Synthetic([10] * 8), batch_size=2, epochs=1, rank=0, world_size=2, local_ranks=[0, 5])


def test_close_releases_the_staging_ring_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_SHM_DIR", str(tmp_path))
    job = clairvoyant.Job(clairvoyant.Synthetic([100] * 64), batch_size=8, epochs=1, rank=0, world_size=1)
    ring = job.segments[0]
    held = next(iter(job.epoch(0)))  # a live view keeps the mapping, not the file
    assert os.path.exists(ring)
    job.close()
    assert not os.path.exists(ring)
    assert len(held[0]) == 100
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert leftovers == [], leftovers


@pytest.mark.parametrize(
    "env,name",
    [
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ],
)
def test_impossible_launcher_variables_name_the_variable(env, name):
    with pytest.raises(clairvoyant.ConfigError, match=f"'{name}'"):
        _env.detect(env=env)


def test_world_size_zero_as_an_argument_is_a_config_error():
    with pytest.raises(clairvoyant.ConfigError, match="world_size"):
        _env.detect(rank=0, world_size=0, env={})


def test_a_staging_ring_larger_than_any_disk_names_the_setting(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CLAIRVOYANT_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("CLAIRVOYANT_STAGING", "1000 TiB")
    with pytest.raises(clairvoyant.ConfigError, match="staging.capacity") as info:
        clairvoyant.Job(clairvoyant.Synthetic([100] * 8), batch_size=2, epochs=1, rank=0, world_size=1)
    assert "CLAIRVOYANT_STAGING" in str(info.value) and "free" in str(info.value)
    err = capfd.readouterr().err
    assert "warning" not in err, f"a warning before the error: {err}"
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == [], "files left behind"


def test_a_job_leaves_only_its_index_in_the_cache_folder(tmp_path, monkeypatch):
    """The index stays (kept between runs); its lock file goes with the scan that held it, and
    one a killed scanner left goes with the next load of the index."""
    for k in range(4):
        d = tmp_path / "data" / f"c{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{k}.jpg").write_bytes(bytes([k]) * 100)
    cache, shm = tmp_path / "cache", tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(cache))
    monkeypatch.setenv("CLAIRVOYANT_SHM_DIR", str(shm))

    def run():
        job = clairvoyant.Job(clairvoyant.ImageFolder(str(tmp_path / "data")), batch_size=2, epochs=1)
        assert sum(1 for _ in job.epoch(0)) == 4
        job.close()
        return sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())

    files = run()
    assert files and not [f for f in files if f.name.endswith(".lock")], files
    (cache / f"{files[0]}.lock").write_bytes(b"")  # as a scanner killed before removing it
    os.chmod(cache / f"{files[0]}.lock", 0o600)
    assert run() == files
    # Nothing of the job in the shared-memory folder either (the per-user folder stays).
    assert [f for _, _, fs in os.walk(shm) for f in fs] == []


def test_a_second_job_over_the_same_dataset_is_told_it_caches_in_the_first_ones_classes(monkeypatch, capfd):
    """Jobs of one process over one dataset share the first one's node cache (train and
    validation, say); one that asks for other classes gets the first one's, and is told so."""
    data = clairvoyant.Synthetic([123] * 77)
    first = clairvoyant.Job(data, batch_size=7, epochs=1, rank=0, world_size=1)
    assert [name for name, _, _ in first.placement()] == ["memory"]
    monkeypatch.setenv("CLAIRVOYANT_MEMORY", "0")
    capfd.readouterr()
    second = clairvoyant.Job(data, batch_size=7, epochs=1, rank=0, world_size=1)
    err = capfd.readouterr().err
    assert "shares the node cache of another open job" in err and "(memory)" in err and "(none)" in err, err
    assert second.placement() == first.placement()
    assert sum(1 for _ in second.epoch(0)) == 77
    second.close()
    first.close()
    # Alone, a job caches in its own classes.
    alone = clairvoyant.Job(data, batch_size=7, epochs=1, rank=0, world_size=1)
    assert alone.placement() == []
    alone.close()
