"""Interposed-library benchmark (``python -m clairvoyant._bench_preload``; docs/transparent.md).

Two figures of the issue's targets, each timed by a native loop (``preloadbench``, an example of
crates/clairvoyant-preload) run once without and once with ``LD_PRELOAD``, so no Python is timed:

- per-open overhead for a path outside the dataset root: ``open`` + ``close`` of a file outside
  the root, ns per pair, with the library minus without (target: under 1 µs);
- a cached 110 KB read: ``open`` + ``read`` to the end + ``close`` of one dataset file served from
  the stand-in agent's arena, against the same cycle on the same file from the page cache
  (target: within 10 %); also with ``CLAIRVOYANT_VERIFY=process`` (the checksum of a cached copy
  verified once per process, not once per open).

The stand-in agent (``fakeagent``) serves the file from its shared directory (no round trip).
Each figure is the best of ``rounds`` rounds (the machine may be shared; the best round is the
least disturbed one); the medians are reported beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from ._preload import LIBRARY_NAME, preload_env, read_counters

_REPO = Path(__file__).resolve().parents[2]
_TARGET = _REPO / "target" / "release"


def _binaries() -> tuple[Path, Path, Path]:
    lib, agent, bench = _TARGET / LIBRARY_NAME, _TARGET / "examples" / "fakeagent", _TARGET / "examples" / "preloadbench"
    if not (lib.is_file() and agent.is_file() and bench.is_file()):
        cmd = ["cargo", "build", "--release", "--quiet", "-p", "clairvoyant-preload", "-p", "clairvoyant-agent", "--lib", "--examples"]
        subprocess.run(cmd, cwd=_REPO, check=True)
    return lib, agent, bench


def _loop(bench: Path, what: str, path: Path, n: int, env: dict) -> float:
    r = subprocess.run([str(bench), what, str(path), str(n)], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"preloadbench {what} {path}: {r.stderr.strip()}")
    return json.loads(r.stdout)["ns_per_op"]


def run(n_open: int = 200_000, n_read: int = 20_000, rounds: int = 5, size: int = 110_000) -> dict:
    """Time both loops; returns ns per operation (best and median of ``rounds``) and the ratios."""
    lib, agent_exe, bench = _binaries()
    with tempfile.TemporaryDirectory(prefix="cv-bench-preload-") as tmp:
        tmp = Path(tmp)
        root = tmp / "data"
        root.mkdir()
        (root / "sample.bin").write_bytes(os.urandom(size))
        outside = tmp / "outside.bin"
        outside.write_bytes(b"x" * 100)
        state = tmp / "state"
        state.mkdir(mode=0o700)
        sock = state / "sock"
        agent = subprocess.Popen(
            [str(agent_exe), "--root", str(root), "--socket", str(sock), "--state", str(state), "--mode", "dir"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if agent.stdout.readline().strip() != "ready":
                raise RuntimeError("fakeagent did not start")
            plain = dict(os.environ)
            plain.pop("LD_PRELOAD", None)
            pre = preload_env(root, sock, env=plain, library=str(lib))
            per_process = dict(pre, CLAIRVOYANT_VERIFY="process")
            t = {"open_plain": [], "open_preload": [], "read_page_cache": [], "read_cached": [], "read_cached_verify_process": []}
            for _ in range(rounds):
                t["open_plain"].append(_loop(bench, "open", outside, n_open, plain))
                t["open_preload"].append(_loop(bench, "open", outside, n_open, pre))
                t["read_page_cache"].append(_loop(bench, "read", root / "sample.bin", n_read, plain))
                t["read_cached"].append(_loop(bench, "read", root / "sample.bin", n_read, pre))
                t["read_cached_verify_process"].append(_loop(bench, "read", root / "sample.bin", n_read, per_process))
            counters = read_counters(state / "dir")
        finally:
            agent.stdin.close()
            agent.kill()
            agent.wait(timeout=10)
    if counters["cached_reads"] < 2 * n_read * rounds or counters["direct_reads"] != 0:
        raise RuntimeError(f"the cached loop was not served from the arena: {counters}")
    best = {k: min(v) for k, v in t.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "size": size,
        "rounds": rounds,
        "n_open": n_open,
        "n_read": n_read,
        "best_ns": best,
        "median_ns": med,
        "open_overhead_ns": best["open_preload"] - best["open_plain"],
        "open_overhead_median_ns": med["open_preload"] - med["open_plain"],
        "cached_read_ratio": best["read_cached"] / best["read_page_cache"],
        "cached_read_ratio_median": med["read_cached"] / med["read_page_cache"],
        "cached_read_ratio_verify_process": best["read_cached_verify_process"] / best["read_page_cache"],
        "cached_read_ratio_verify_process_median": med["read_cached_verify_process"] / med["read_page_cache"],
        "cpus": os.cpu_count(),
    }


def report(res: dict) -> str:
    b = res["best_ns"]
    return (
        f"open+close outside the root: {b['open_plain']:.0f} ns plain, {b['open_preload']:.0f} ns interposed "
        f"(overhead {res['open_overhead_ns']:.0f} ns best, {res['open_overhead_median_ns']:.0f} ns median); "
        f"{res['size']} B open+read+close: page cache {b['read_page_cache']:.0f} ns, served from the arena "
        f"{b['read_cached']:.0f} ns (ratio {res['cached_read_ratio']:.2f} best, {res['cached_read_ratio_median']:.2f} median); "
        f"verifying once per process instead of once per open: {b['read_cached_verify_process']:.0f} ns "
        f"(ratio {res['cached_read_ratio_verify_process']:.2f} best, {res['cached_read_ratio_verify_process_median']:.2f} median)"
    )


if __name__ == "__main__":
    r = run()
    print(json.dumps(r, indent=1))
    print(report(r))
