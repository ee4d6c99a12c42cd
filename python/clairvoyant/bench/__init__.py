"""``python -m clairvoyant.bench [--only epoch0] [...]``: the benchmarks of a source checkout.

The benchmarks (the ``benches`` folder beside ``python/``) emulate file systems and nodes and
need the checkout's native builds, so they are not part of an installed package. Run from a
checkout (an editable install, as ``./dev`` makes), this runs them exactly as ``./dev bench``
and ``python -m benches`` do, with the same arguments; elsewhere it says where they are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional


def checkout() -> Optional[Path]:
    """The source checkout this package was installed from, if it has the benchmarks."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "benches" / "bench.py").is_file() else None


def main(argv: Optional[list] = None) -> int:
    root = checkout()
    if root is None:
        print(
            "clairvoyant.bench: the benchmarks are in the source checkout (benches/), not in an "
            "installed package; run ./dev bench there, or python -m benches from its root",
            file=sys.stderr,
        )
        return 2
    # The ranks the benchmarks start (spawned interpreters, launched programs) import them too.
    sys.path.insert(0, str(root))
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(root) + (os.pathsep + path if path else "")
    from benches.bench import main as run

    return run(argv, program="python -m clairvoyant.bench")

