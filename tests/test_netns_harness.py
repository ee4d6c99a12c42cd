"""The emulated-node harness (tests/netns.py): namespaces where root, loopback everywhere."""

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import netns  # noqa: E402

WHY_NOT = netns.netns_unavailable()
KINDS = [
    pytest.param("loopback", id="loopback"),
    pytest.param("netns", id="netns", marks=pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))),
]

# Listens on argv[1], prints the port, receives a length-prefixed message, answers with its sha256.
SERVER = r"""
import hashlib, socket, struct, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
s.settimeout(30)
c, peer = s.accept()
c.settimeout(30)
n = struct.unpack("<Q", c.recv(8, socket.MSG_WAITALL))[0]
h, got = hashlib.sha256(), 0
while got < n:
    b = c.recv(min(1 << 20, n - got))
    if not b:
        break
    h.update(b)
    got += len(b)
c.sendall(h.digest())
print(peer[0], got, flush=True)
"""

CLIENT = r"""
import hashlib, os, socket, struct, sys, time
data = os.urandom(int(sys.argv[3]))
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(struct.pack("<Q", len(data)) + data)
digest = c.recv(32, socket.MSG_WAITALL)
print(digest == hashlib.sha256(data).digest(), time.monotonic() - t0, flush=True)
"""


def make(kind, n, **kw):
    return netns.Nodes(n, **kw) if kind == "netns" else netns.LoopbackNodes(n)


def exchange(nodes, size):
    """Node 1 serves at its address; node 0 sends `size` bytes. Returns (ok, seconds, peer seen)."""
    srv = nodes.popen(1, [sys.executable, "-c", SERVER, nodes.addresses[1]], stdout=subprocess.PIPE, text=True)
    port = srv.stdout.readline().strip()
    assert port.isdigit(), f"server said {port!r}"
    cli = nodes.popen(0, [sys.executable, "-c", CLIENT, nodes.addresses[1], port, str(size)], stdout=subprocess.PIPE, text=True)
    out, _ = cli.communicate(timeout=60)
    peer, got = srv.stdout.readline().split()
    srv.wait(timeout=10)
    ok, seconds = out.split()
    assert int(got) == size
    return ok == "True", float(seconds), peer


@pytest.mark.parametrize("kind", KINDS)
def test_two_nodes_exchange_data_over_tcp_at_their_addresses(kind):
    with make(kind, 2) as nodes:
        assert len(set(nodes.addresses)) == 2
        ok, _, peer = exchange(nodes, 3 << 20)
        assert ok
        assert peer == nodes.addresses[0], "the server saw the client come from its node's address"


def test_rate_is_limited():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    with netns.Nodes(2, rate="100mbit") as nodes:
        ok, seconds, _ = exchange(nodes, 5 << 20)
    # 5 MiB at 100 Mbit/s take 0.42 s; unshaped veths move it in a few milliseconds.
    assert ok and seconds > 0.3, seconds


@pytest.mark.parametrize("kind", KINDS)
def test_node_ids_and_private_directories(kind):
    code = "import os; print(os.environ['CLAIRVOYANT_NODE_ID'], os.environ['CLAIRVOYANT_SSD_DIR'], os.environ.get('CLAIRVOYANT_SHM_DIR', '/dev/shm'))"
    with make(kind, 2) as nodes:
        outs = [nodes.popen(i, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0].split() for i in range(2)]
        assert [o[0] for o in outs] == ["node0", "node1"]
        assert outs[0][1] != outs[1][1]


@pytest.mark.parametrize("kind", KINDS)
def test_shared_memory_of_one_node_is_invisible_to_another(kind):
    name = f"cv-harness-{os.getpid()}"
    write = f"import os; d = os.environ.get('CLAIRVOYANT_SHM_DIR', '/dev/shm'); open(os.path.join(d, '{name}'), 'w').write('x'); print(d)"
    look = f"import os; d = os.environ.get('CLAIRVOYANT_SHM_DIR', '/dev/shm'); print(os.path.exists(os.path.join(d, '{name}')))"
    with make(kind, 2) as nodes:
        # One process of node 0 writes, a second process of node 0 must not see it either for
        # netns (each process has a private mount namespace), so both checks run in one shell.
        both = f"{sys.executable} -c \"{write}\" && {sys.executable} -c \"{look}\""
        out0 = nodes.popen(0, ["sh", "-c", both], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0].split()
        assert out0[-1] == "True", "the writer's own node sees the file"
        out1 = nodes.popen(1, [sys.executable, "-c", look], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0].split()
        assert out1 == ["False"], "another node sees node 0's shared memory"
        assert not os.path.exists(os.path.join("/dev/shm", name)), "the host sees node 0's shared memory"


@pytest.mark.parametrize("kind", KINDS)
def test_kill_takes_every_process_of_a_node(kind):
    with make(kind, 2) as nodes:
        # A shell with a child: both belong to node 1.
        victim = nodes.popen(1, ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        child = int(victim.stdout.readline())
        other = nodes.popen(0, ["sleep", "60"])
        t0 = time.monotonic()
        nodes.kill(1)
        assert victim.wait(timeout=5) == -9
        assert time.monotonic() - t0 < 5
        for _ in range(100):
            if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"node 1's child {child} survived kill()")
        assert other.poll() is None, "kill(1) touched node 0"
    assert other.poll() is not None, "close() leaves no process behind"


def test_close_leaves_no_namespace_or_link():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    nodes = netns.Nodes(3, rate="1gbit", delay="0.5ms")
    names = [nodes.hub, *nodes.namespaces]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listed for n in names)
    # The host's own namespace holds none of the harness's links.
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == links_before
    nodes.popen(0, ["sleep", "60"])
    nodes.close()
    nodes.close()  # idempotent
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == links_before
    assert not os.path.exists(nodes.tmp)


def test_loopback_close_removes_its_directories():
    nodes = netns.LoopbackNodes(2)
    assert os.path.isdir(nodes.shm_dirs[1])
    nodes.close()
    nodes.close()
    assert not os.path.exists(nodes.tmp)


def test_namespaces_of_a_killed_run_are_reaped():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    # A process that is gone: a child that has exited and been waited for.
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"cv{dead.pid}x0n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.reap_stale()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
