"""A one-machine Slurm for the launcher tests: munged, slurmctld and one slurmd per emulated node
(Debian's Slurm runs several on one host, each with its own port) started as root with their
keys, sockets, state and configuration in a temporary directory (nothing under /etc or /run is
touched), and stopped again. Each node offers ``cpus`` CPUs whatever the machine has
(``SlurmdParameters=config_overrides``), so ``srun -n 4`` runs on a small machine too.

A task prolog makes each task part of its emulated node, as the netns harness does for others:
its node id is the Slurm node's name, its shared-memory directory is the node's own, and peer
servers listen on loopback. The launch commands and scripts stay those of a real cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def unavailable() -> str | None:
    """Why a Slurm cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    for name in (*DAEMONS, "srun", "sbatch", "sinfo"):
        if _daemon(name) is None:
            return f"no {name} (apt-get install slurm-wlm munge)"
    return None


class Slurm:
    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2):
        self.root = root
        self.procs: list = []
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o711)  # munged wants its socket's directories searchable by all
        (root / "state").mkdir(exist_ok=True)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        self.nodes = [f"cv{n}" for n in range(1, nodes + 1)]
        prolog = root / "task_prolog.sh"
        prolog.write_text(
            "#!/bin/sh\n"
            f'mkdir -p "{root}/shm/$SLURMD_NODENAME"\n'
            'echo "export CLAIRVOYANT_NODE_ID=$SLURMD_NODENAME"\n'
            f'echo "export CLAIRVOYANT_SHM_DIR={root}/shm/$SLURMD_NODENAME"\n'
            'echo "export CLAIRVOYANT_LISTEN=127.0.0.1"\n'
        )
        os.chmod(prolog, 0o755)
        node_lines = "".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} State=UNKNOWN\n" for name in self.nodes
        )
        self.conf = root / "slurm.conf"
        self.conf.write_text(
            f"""ClusterName=clairvoyant-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldPort={_free_port()}
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
TaskProlog={prolog}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SlurmdParameters=config_overrides
{node_lines}PartitionName=test Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )
        self.env = {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        r = self.root
        self._spawn(
            [_daemon("munged"), "-F", "-f", f"--key-file={r}/munge.key", f"--socket={r}/munge.sock",
             f"--pid-file={r}/munged.pid", f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed"], "munged"
        )  # fmt: skip
        self._wait(lambda: (r / "munge.sock").exists(), timeout, "munged's socket")
        self._spawn([_daemon("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld")
        for name in self.nodes:
            self._spawn([_daemon("slurmd"), "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
        env = dict(os.environ, **self.env)

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            return out.returncode == 0 and out.stdout.split() == ["idle"]

        self._wait(idle, timeout, "the nodes to be idle")

    def _spawn(self, argv, name) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)))

    def _wait(self, ready, timeout, what) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm did not start ({', '.join(dead) + ' exited' if dead else 'timed out waiting for ' + what}):\n{self.logs()}"
                )
            time.sleep(0.2)

    def logs(self) -> str:
        out = []
        names = ["munged.out", "slurmctld.out", "slurmctld.log"]
        names += [f"slurmd-{n}.{ext}" for n in self.nodes for ext in ("out", "log")]
        for name in names:
            p = self.root / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-1500:])
        return "\n".join(out)

    def _step_daemons(self) -> list:
        """Process ids of this cluster's slurmstepd processes (they detach from slurmd)."""
        pids, mark = [], f"SLURM_CONF={self.conf}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if not f.read().startswith(b"slurmstepd"):
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        # Steps still reporting to slurmd finish first; any left after the daemons stop are ended.
        deadline = time.monotonic() + 15
        while self._step_daemons() and time.monotonic() < deadline:
            time.sleep(0.2)
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _name, p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        for pid in self._step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
