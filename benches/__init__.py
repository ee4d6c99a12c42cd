"""The benchmark and demo harness of clairvoyant, run from a checkout (``./dev bench``,
``./dev demo``); it is not part of the installed package.

- ``python -m benches [--only NAME] [--json]``: the benchmarks and their targets (:mod:`benches.bench`).
- ``python -m benches.demo``: PyTorch's DataLoader and clairvoyant side by side (:mod:`benches.demo`).
- :mod:`benches.emulation`: the emulated file system, accelerator and ranks the demo, the
  benchmarks and the tests share.
"""
