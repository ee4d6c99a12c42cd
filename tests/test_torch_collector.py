"""The drop-in keeps the training process's objects out of the collector's full walks while a
loader is open (``_dropin._Heap``): frozen at the first iterator, unfrozen when the last open
loader closes or at exit; a program that froze objects itself or turned the collector off is
left as it is; each worker freezes what it inherited. Each case runs in its own interpreter (the collector is process-wide)."""

import os
import subprocess
import sys
import textwrap

import plain_files
import pytest

pytest.importorskip("torch")

_PRELUDE = """
import gc, sys, weakref, clairvoyant.torch as ct

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("finalized", flush=True)

def loader():
    return ct.DataLoader(Plain(files), batch_size=4, num_workers=2)

def check(l):
    got = sorted(tuple(x) for b in l for x in b.tolist())
    assert got == EXPECTED, got
    assert l._cv.job is not None, "the dataset was not cached"
"""

_CASES = {
    # Frozen from the first iterator until the last open loader closes; a cycle among the
    # frozen objects that becomes garbage meanwhile is collected after that.
    "two loaders": """
        assert gc.get_freeze_count() == 0
        garbage = Cycle()
        ref = weakref.ref(garbage)
        a, b = loader(), loader()
        check(a)
        assert gc.get_freeze_count() > 0
        del garbage
        gc.collect()
        assert ref() is not None, "a frozen object was collected"
        check(b)
        a.close()
        assert gc.get_freeze_count() > 0, "unfrozen while a loader is open"
        check(b)  # a second epoch
        b.close()
        assert gc.get_freeze_count() == 0, "still frozen after the last loader closed"
        gc.collect()
        assert ref() is None, "not collected after the loaders closed"
        print("done")
        """,
    # Objects the program froze itself stay frozen, and nothing more is frozen.
    "program froze": """
        gc.freeze()
        n = gc.get_freeze_count()
        a = loader()
        check(a)
        assert 0 < gc.get_freeze_count() <= n  # (frozen objects the program dropped are freed)
        a.close()
        assert 0 < gc.get_freeze_count() <= n
        print("done")
        """,
    # The collector off: nothing is frozen, and it stays off.
    "collector off": """
        gc.disable()
        a = loader()
        check(a)
        assert gc.get_freeze_count() == 0 and not gc.isenabled()
        a.close()
        print("done")
        """,
    # Each worker freezes what it inherited at the fork, whatever the training process does
    # (here: nothing, its collector being off).
    "workers freeze": """
        class Counts(Plain):
            def __clairvoyant_getitem__(self, i, data):
                return torch.tensor(gc.get_freeze_count())
        gc.disable()
        a = ct.DataLoader(Counts(files), batch_size=4, num_workers=2)
        counts = torch.cat(list(a)).tolist()
        assert a._cv.job is not None, "the dataset was not cached"
        a.close()
        assert gc.get_freeze_count() == 0
        assert min(counts) > 1000, counts  # torch's objects, frozen in each worker
        print("done")
        """,
    # Exit without close(): unfrozen at exit, so the collection at exit finalizes the cycle.
    "exit without close": """
        garbage = Cycle()
        a = loader()
        check(a)
        assert gc.get_freeze_count() > 0
        del garbage
        gc.collect()
        print("done")
        """,
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_collector(tmp_path, case):
    script = tmp_path / "s.py"
    script.write_text(plain_files.make(tmp_path / "d") + _PRELUDE + textwrap.dedent(_CASES[case]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert "done" in lines, out.stdout + out.stderr
    if case in ("two loaders", "exit without close"):
        # finalized once: after the loaders closed, or at exit
        assert lines.count("finalized") == 1, out.stdout + out.stderr
        if case == "exit without close":
            assert lines.index("finalized") > lines.index("done"), out.stdout
