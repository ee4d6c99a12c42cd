"""Interposed-library benchmark (``python -m benches.preload``; docs/transparent.md).

Two figures of the transparent mode's targets, timed by a native loop (``preloadbench``, an example of
crates/clairvoyant-preload) so that no Python is timed. Within one process under ``LD_PRELOAD``
it alternates blocks of cycles through the interposed symbols and through libc's own definitions
(``dlopen("libc.so.6")``), so both sides see the same machine load:

- per-open overhead for a path outside the dataset root: ``open`` + ``close`` of a file outside
  the root, interposed minus libc, ns per pair (target: under 1 µs);
- a cached 110 KB read: ``open`` + ``read`` to the end + ``close`` of one dataset file served from
  the stand-in agent's arena, against libc's cycle on the same file from the page cache
  (target: within 10 %), once with the default verification (the checksum once per open) and
  once with ``CLAIRVOYANT_VERIFY=process`` (once per process and cached copy).

The stand-in agent (``fakeagent``) serves the file from its shared directory (no round trip).
Figures are the best block and the median block of each run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from clairvoyant._preload import LIBRARY_NAME, preload_env, read_counters

_REPO = Path(__file__).resolve().parents[1]
_TARGET = _REPO / "target" / "release"


def _binaries() -> tuple[Path, Path, Path]:
    lib, agent, bench = _TARGET / LIBRARY_NAME, _TARGET / "examples" / "fakeagent", _TARGET / "examples" / "preloadbench"
    if not (lib.is_file() and agent.is_file() and bench.is_file()):
        # Two builds, as ./dev build does (together, the agent's server would be linked into the library).
        for cmd in (["-p", "clairvoyant-preload", "--lib", "--examples"], ["-p", "clairvoyant-agent", "--examples"]):
            subprocess.run(["cargo", "build", "--release", "--quiet", *cmd], cwd=_REPO, check=True)
    return lib, agent, bench


def _loop(bench: Path, what: str, path: Path, n: int, env: dict) -> dict:
    r = subprocess.run([str(bench), what, str(path), str(n)], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"preloadbench {what} {path}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def run(n_open: int = 200_000, n_read: int = 40_000, size: int = 110_000) -> dict:
    """Time both loops; returns ns per cycle (best and median block) and the derived figures."""
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
            out = {
                "open_outside": _loop(bench, "open", outside, n_open, pre),
                "read_cached": _loop(bench, "read", root / "sample.bin", n_read, pre),
                "read_cached_verify_process": _loop(bench, "read", root / "sample.bin", n_read, per_process),
                # Both sides plain: the measurement's own noise.
                "read_noise": _loop(bench, "read", root / "sample.bin", n_read, plain),
            }
            counters = read_counters(state / "dir")
        finally:
            agent.stdin.close()
            agent.kill()
            agent.wait(timeout=10)
    if counters["cached_reads"] < 2 * n_read or counters["direct_reads"] != 0:
        raise RuntimeError(f"the cached loops were not served from the arena: {counters}")
    o, r, rp, z = out["open_outside"], out["read_cached"], out["read_cached_verify_process"], out["read_noise"]
    return {
        "size": size,
        "n_open": n_open,
        "n_read": n_read,
        "raw": out,
        "open_overhead_ns": o["linked_best_ns"] - o["libc_best_ns"],
        "open_overhead_median_ns": o["linked_median_ns"] - o["libc_median_ns"],
        "cached_read_ratio": r["linked_best_ns"] / r["libc_best_ns"],
        "cached_read_ratio_median": r["linked_median_ns"] / r["libc_median_ns"],
        "cached_read_ratio_verify_process": rp["linked_best_ns"] / rp["libc_best_ns"],
        "cached_read_ratio_verify_process_median": rp["linked_median_ns"] / rp["libc_median_ns"],
        "noise_ratio": z["linked_best_ns"] / z["libc_best_ns"],
        "cpus": os.cpu_count(),
    }


def report(res: dict) -> str:
    o, r, rp = res["raw"]["open_outside"], res["raw"]["read_cached"], res["raw"]["read_cached_verify_process"]
    return (
        f"open+close outside the root: libc {o['libc_best_ns']:.0f} ns, interposed {o['linked_best_ns']:.0f} ns "
        f"(overhead {res['open_overhead_ns']:.0f} ns best block, {res['open_overhead_median_ns']:.0f} ns median); "
        f"{res['size']} B open+read+close: page cache {r['libc_best_ns']:.0f} ns, from the arena {r['linked_best_ns']:.0f} ns "
        f"(ratio {res['cached_read_ratio']:.2f} best, {res['cached_read_ratio_median']:.2f} median); "
        f"with CLAIRVOYANT_VERIFY=process {rp['linked_best_ns']:.0f} ns vs {rp['libc_best_ns']:.0f} ns "
        f"(ratio {res['cached_read_ratio_verify_process']:.2f} best, {res['cached_read_ratio_verify_process_median']:.2f} median); "
        f"noise (libc vs libc) {res['noise_ratio']:.2f}"
    )


if __name__ == "__main__":
    r = run()
    print(json.dumps(r, indent=1))
    print(report(r))
