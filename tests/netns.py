"""Several emulated nodes on one machine, for multi-node tests.

``Nodes(n)`` (root only) gives each node its own network namespace and, for every process it
starts, a private mount namespace with a fresh tmpfs on /dev/shm, so nodes share nothing but the
file systems mounted before (the FUSE-emulated shared file system). The nodes' veths meet on a
bridge that lives in a namespace of its own, so the host's network is never touched and traffic
goes only to the addresses the harness created. Rate (tc tbf) and delay (tc netem, where the
kernel has it) apply to both directions of every node's link.

``LoopbackNodes(n)`` has the same interface and runs anywhere: every node listens on its own
127.0.0.x address and has its own CLAIRVOYANT_SHM_DIR and CLAIRVOYANT_SSD_DIR under a
temporary directory.

    with Nodes(4, rate="1gbit", delay="0.5ms") as nodes:
        p = nodes.popen(0, [sys.executable, "server.py", nodes.addresses[0]])
        ...
        nodes.kill(0)

Every process gets ``CLAIRVOYANT_NODE_ID=node<i>`` and ``CLAIRVOYANT_SSD_DIR`` (a private
directory of that node); namespace and link names carry this process's id, so test runs in
parallel do not collide. ``close()`` (also at exit) removes everything and is idempotent.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_counter = itertools.count()


def _run(argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network and mount namespaces); the loopback variant runs instead"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    name = f"cvprobe{os.getpid()}x{next(_counter)}"
    r = _run(["ip", "netns", "add", name], check=False)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return None


def reap_stale() -> list:
    """Remove namespaces a killed test run left behind (names of this harness whose process is
    gone); returns their names."""
    r = _run(["ip", "netns", "list"], check=False)
    gone = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"cv(\d+)x\d+(?:hub|n\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", name], check=False)
            gone.append(name)
    return gone


class _Base:
    addresses: list

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"at least one node, got {n}")
        self.n = n
        self.procs: dict = {i: [] for i in range(n)}
        self.tmp = tempfile.mkdtemp(prefix="cv-nodes-")
        self.ssd_dirs = []
        for i in range(n):
            d = os.path.join(self.tmp, f"node{i}", "ssd")
            os.makedirs(d, mode=0o700)
            self.ssd_dirs.append(d)
        self._closed = False
        atexit.register(self.close)

    def _env(self, node: int, env) -> dict:
        out = dict(os.environ if env is None else env)
        out["CLAIRVOYANT_NODE_ID"] = f"node{node}"
        out["CLAIRVOYANT_SSD_DIR"] = self.ssd_dirs[node]
        return out

    def _check(self, node: int) -> None:
        if self._closed:
            raise RuntimeError("the nodes were closed")
        if not 0 <= node < self.n:
            raise IndexError(f"node {node} of {self.n}")

    def _start(self, node: int, argv, env, kw) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)  # kill() takes the process group
        p = subprocess.Popen(argv, env=env, **kw)
        self.procs[node].append(p)
        return p

    def _kill_group(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.kill()
            except ProcessLookupError:
                pass

    def kill(self, node: int) -> None:
        """SIGKILL every process of ``node`` (and wait for those the harness started)."""
        self._check(node)
        self._kill_node(node)

    def _kill_node(self, node: int) -> None:
        for p in self.procs[node]:
            self._kill_group(p)
        for p in self.procs[node]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"netns: a process of node {node} (pid {p.pid}) survived SIGKILL for 10 s", file=sys.stderr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for node in range(self.n):
            self._kill_node(node)
        self._teardown()
        shutil.rmtree(self.tmp, ignore_errors=True)
        atexit.unregister(self.close)

    def _teardown(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LoopbackNodes(_Base):
    """``n`` nodes on loopback: node i listens on 127.0.0.(i+1) (``CLAIRVOYANT_LISTEN`` is set to
    it) and has its own shared-memory and SSD directories. No root needed; nodes still share the
    machine's network stack and /dev/shm, so only code that honours CLAIRVOYANT_SHM_DIR is kept
    apart."""

    kind = "loopback"

    def __init__(self, n: int):
        super().__init__(n)
        self.addresses = [f"127.0.0.{i + 1}" for i in range(n)]
        self.shm_dirs = []
        for i in range(n):
            d = os.path.join(self.tmp, f"node{i}", "shm")
            os.makedirs(d, mode=0o700)
            self.shm_dirs.append(d)

    def popen(self, node: int, argv, env=None, **kw) -> subprocess.Popen:
        """Start ``argv`` as a process of ``node``; ``kw`` goes to subprocess.Popen."""
        self._check(node)
        e = self._env(node, env)
        e["CLAIRVOYANT_SHM_DIR"] = self.shm_dirs[node]
        e["CLAIRVOYANT_LISTEN"] = self.addresses[node]
        return self._start(node, list(argv), e, kw)


class Nodes(_Base):
    """``n`` nodes, each a network namespace on a private bridge (addresses 10.231.0.1..n/24),
    every process in a private mount namespace with its own /dev/shm (tmpfs of ``shm_size``).
    ``rate`` ("1gbit") and ``delay`` ("0.5ms") shape each node's link both ways; ``delay_applied``
    says whether the kernel could add the delay (it needs the netem qdisc)."""

    kind = "netns"

    def __init__(self, n: int, rate: str | None = None, delay: str | None = None, shm_size: str = "512m", subnet: str = "10.231.0"):
        why = netns_unavailable()
        if why:
            raise RuntimeError(why)
        if n > 250:
            raise ValueError(f"at most 250 nodes on one /24, got {n}")
        reap_stale()
        super().__init__(n)
        tag = f"cv{os.getpid()}x{next(_counter)}"
        self.hub = f"{tag}hub"
        self.namespaces = [f"{tag}n{i}" for i in range(n)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self.shm_size = shm_size
        self.rate, self.delay = rate, delay
        self.delay_applied = delay is None
        self._created: list = []
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        _run(["ip", "netns", "add", self.hub])
        self._created.append(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.namespaces):
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            # Created inside the node, its peer moved into the hub: the host's namespace never sees either.
            _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", "netns", self.hub])
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._shape(ns, "eth0")  # node -> bridge
            self._shape(self.hub, f"v{i}")  # bridge -> node
        if self.delay is not None and not self.delay_applied:
            print(f"netns: this kernel has no netem qdisc; links are not delayed by {self.delay}", file=sys.stderr)

    def _shape(self, ns: str, dev: str) -> None:
        if self.delay is not None:
            cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay]
            if self.rate is not None:
                cmd += ["rate", self.rate]
            if _run(cmd, check=False).returncode == 0:
                self.delay_applied = True
                return
        if self.rate is not None:
            # A token bucket: bursts of 10 ms at the rate (at least 64 KB), a queue of 50 ms.
            bits = _rate_bits(self.rate)
            burst = max(bits // 8 // 100, 64 * 1024)
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"])

    def popen(self, node: int, argv, env=None, **kw) -> subprocess.Popen:
        """Start ``argv`` in ``node``'s network namespace and a private mount namespace with a
        fresh /dev/shm; ``kw`` goes to subprocess.Popen."""
        self._check(node)
        script = f'mount -t tmpfs -o size={self.shm_size},mode=1777 clairvoyant-shm /dev/shm && exec "$@"'
        wrapped = ["ip", "netns", "exec", self.namespaces[node], "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]
        e = self._env(node, env)
        # The node's /dev/shm is a fresh one: a shared-memory folder of the host's (the test
        # session's own) is not there.
        if os.path.normpath(e.get("CLAIRVOYANT_SHM_DIR", "/")).startswith("/dev/shm/"):
            del e["CLAIRVOYANT_SHM_DIR"]
        return self._start(node, wrapped + [str(a) for a in argv], e, kw)

    def _kill_node(self, node: int) -> None:
        super()._kill_node(node)
        # Anything else that runs in the node's network namespace (a daemon that left the session).
        if node < len(self.namespaces) and self.namespaces[node] in self._created:
            r = _run(["ip", "netns", "pids", self.namespaces[node]], check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def _teardown(self) -> None:
        # Deleting a namespace deletes its end of each veth (and so the pair) and the bridge.
        deadline = time.monotonic() + 10
        for ns in reversed(self._created):
            while True:
                r = _run(["ip", "netns", "del", ns], check=False)
                if r.returncode == 0 or "No such file" in r.stderr or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if r.returncode != 0 and "No such file" not in r.stderr:
                print(f"netns: could not remove namespace {ns}: {r.stderr.strip()}", file=sys.stderr)
        self._created = []


def _rate_bits(rate: str) -> int:
    """tc's rate syntax ("1gbit", "100mbit", "500kbit", "10mbps") in bits per second."""
    units = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
    r = rate.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if r.endswith(unit):
            return int(float(r[: -len(unit)]) * units[unit])
    return int(float(r))


def emulated_nodes(n: int, **kw):
    """``Nodes(n, **kw)`` where namespaces work, else ``LoopbackNodes(n)`` (and says why on stderr)."""
    why = netns_unavailable()
    if why is None:
        return Nodes(n, **kw)
    print(f"netns: {why}", file=sys.stderr)
    return LoopbackNodes(n)
