"""Python start-up hook of ``clairvoyant run --sampler-order`` (this directory is put first on
``PYTHONPATH``). It runs the program's own ``sitecustomize`` if there is one, then waits for
``torch.utils.data`` to be imported and, at the first ``iter()`` of a DataLoader over the
dataset, hands the sampler's future order to the node agent
(:mod:`clairvoyant._sampler_hook`). It never imports torch itself and never fails the
program: any problem is a one-line notice and the agent places without the order."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain():
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


class _AfterDataLoader(importlib.abc.MetaPathFinder):
    """Patches ``torch.utils.data.dataloader`` right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name != "torch.utils.data.dataloader":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                run(module)
                try:
                    from clairvoyant import _sampler_hook

                    _sampler_hook.install(module)
                except Exception as e:  # noqa: BLE001 - the program must run whatever happens here
                    print(f"clairvoyant run: the sampler order hook is off: {e}", file=sys.stderr)

        spec.loader = _Loader()
        return spec


try:
    _chain()
except Exception as e:  # noqa: BLE001
    print(f"clairvoyant run: the program's own sitecustomize failed: {e}", file=sys.stderr)

if os.environ.get("CLAIRVOYANT_SAMPLER_ORDER") == "1" and os.environ.get("CLAIRVOYANT_AGENT"):
    sys.meta_path.insert(0, _AfterDataLoader())
