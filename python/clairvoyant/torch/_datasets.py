"""How a user's map-style dataset meets clairvoyant's cache.

clairvoyant caches bytes, not items: it needs to know which stored bytes sample ``i`` is made
from, and it must hand those bytes to the dataset's own code so that ``dataset[i]`` means what
it meant. Two kinds of dataset qualify:

- torchvision ``DatasetFolder`` / ``ImageFolder`` (and subclasses, and ``Subset`` views of
  them): sample ``i`` is the file ``dataset.samples[i][0]``. The dataset's ``__getitem__`` runs
  unchanged; only its ``loader`` is given the cached bytes instead of opening the path (when the
  loader is one whose file-reading clairvoyant can stand in for: torchvision's
  ``default_loader``/``pil_loader``, ``clairvoyant.torch.pil_loader``, ``torchvision.io``'s
  ``decode_image``/``read_image``).
- any dataset implementing the protocol::

      def __clairvoyant_files__(self) -> Sequence[str]:
          '''The file holding sample i's bytes, for every i.'''
      def __clairvoyant_getitem__(self, index: int, data: memoryview):
          '''dataset[index], computed from that file's bytes (valid during the call only).'''

  or, instead of ``__clairvoyant_files__``, ``__clairvoyant_source__()`` returning a
  clairvoyant source (``clairvoyant.FileList``, ``ImageFolder``, ``Synthetic``, optionally
  through an emulated file system) whose sample i is the dataset's sample i.

Anything else is loaded as torch's DataLoader loads it.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import CorruptError
from .._samplers import folder_root
from . import _ahead, _tickets

__all__ = ["Adapter", "adapter_for", "CachedDataset", "Batch", "Index"]


def _pil_decode(data) -> Any:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


def _tv_decode_image(fn: Callable) -> Callable:
    def decode(data) -> Any:
        return fn(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    return decode


def _byte_decoder(loader: Callable) -> Optional[Callable]:
    """A function of the file's bytes that returns what ``loader(path)`` returns, or None when
    clairvoyant cannot stand in for this loader's file reading."""
    from . import _job_loader

    if loader is _job_loader.pil_loader:
        return _pil_decode
    # A loader cannot be one of torchvision's unless torchvision is already imported: looking
    # there first keeps classifying a dataset from importing torchvision (seconds per rank).
    tvf = sys.modules.get("torchvision.datasets.folder")
    if tvf is None:
        tvio = sys.modules.get("torchvision.io")
        if tvio is not None and (loader is tvio.decode_image or loader is tvio.read_image):
            return _tv_decode_image(tvio.decode_image)
        return None
    if loader is tvf.pil_loader:
        return _pil_decode
    if loader is tvf.default_loader:
        import torchvision

        return _pil_decode if torchvision.get_image_backend() == "PIL" else None
    try:
        import torchvision.io as tvio

        if loader is tvio.decode_image or loader is tvio.read_image:
            return _tv_decode_image(tvio.decode_image)
    except ImportError:  # pragma: no cover
        pass
    return None


class Adapter:
    """What clairvoyant knows about one dataset: the file of every sample (``files``), the
    labels it can tell (``labels``, or zeros), and how a worker computes ``dataset[i]`` from the
    bytes (``kind``)."""

    def __init__(self, kind: str, files: list, labels: Sequence[int], source=None):
        self.kind = kind  # "folder" or "protocol"
        self.files = files
        self.labels = labels
        self.source = source  # a clairvoyant source the dataset gave (else files are read)


def adapter_for(dataset) -> tuple[Optional[Adapter], str]:
    """(adapter, "") for a dataset clairvoyant can cache, else (None, why not)."""
    name = type(dataset).__name__
    source_fn = getattr(dataset, "__clairvoyant_source__", None)
    if source_fn is not None:
        if not callable(getattr(dataset, "__clairvoyant_getitem__", None)):
            return None, f"{name} has __clairvoyant_source__ but no __clairvoyant_getitem__"
        source = source_fn()
        if len(source) != len(dataset):
            return None, f"{name}.__clairvoyant_source__() has {len(source)} samples for {len(dataset)} in the dataset"
        return Adapter("protocol", [], [], source), ""
    files_fn = getattr(dataset, "__clairvoyant_files__", None)
    if files_fn is not None:
        if not callable(getattr(dataset, "__clairvoyant_getitem__", None)):
            return None, f"{name} has __clairvoyant_files__ but no __clairvoyant_getitem__"
        files = [os.fsdecode(p) for p in files_fn()]
        if len(files) != len(dataset):
            return None, f"{name}.__clairvoyant_files__() gave {len(files)} files for {len(dataset)} samples"
        labels = getattr(dataset, "targets", None)
        if labels is None or len(labels) != len(files):
            labels = [0] * len(files)
        return Adapter("protocol", files, [int(x) for x in labels]), ""
    folder, indices = folder_root(dataset)
    if folder is not None:
        if _byte_decoder(folder.loader) is None:
            return None, (
                f"{name}'s loader {getattr(folder.loader, '__qualname__', folder.loader)!r} reads files itself "
                "(implement __clairvoyant_files__/__clairvoyant_getitem__ to have it cached)"
            )
        samples = folder.samples
        order = range(len(samples)) if indices is None else indices
        files = [os.fsdecode(samples[i][0]) for i in order]
        labels = [int(samples[i][1]) for i in order]
        return Adapter("folder", files, labels), ""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None, f"{name} is an iterable-style dataset (it has no sample indices to read ahead)"
    return None, f"{name} has no stored files clairvoyant knows of (see clairvoyant.torch's dataset protocol)"


class Batch(list):
    """The sample indices of one batch, as the user's batch sampler gave them, plus where their
    bytes are in clairvoyant's shared memory. Travels to a worker in torch's index queue."""

    __slots__ = ("token", "segments", "where", "private", "restore", "last")

    def __init__(self, indices, token: int, segments, where, private: dict, restore=None, last=None):
        super().__init__(indices)
        self.token, self.segments, self.where, self.private, self.restore = token, segments, where, private, restore
        self.last = last  # the epoch's last token when workers decode the next epoch's first batches ahead

    def __reduce__(self):
        return (Batch, (list(self), self.token, self.segments, self.where, self.private, self.restore, self.last))


class Index(int):
    """One sample index (no automatic batching), with where its bytes are."""

    def __new__(cls, index: int, token: int, segments, where, private: dict, restore=None):
        obj = super().__new__(cls, index)
        obj.token, obj.segments, obj.where, obj.private, obj.restore = token, segments, where, private, restore
        return obj

    def __reduce__(self):
        return (Index, (int(self), self.token, self.segments, self.where, self.private, self.restore))


def rng_state() -> tuple:
    """This process's random states that torch seeds in each DataLoader worker."""
    import random

    state: list = [torch.get_rng_state(), random.getstate(), None]
    try:
        import numpy as np

        state[2] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return tuple(state)


def plain_rng_state(state: tuple) -> dict:
    """A worker's random states (:func:`rng_state`) as what ``torch.load(weights_only=True)``
    accepts: tensors, ints, floats, strings, lists, dicts and None (no numpy arrays)."""
    version, internal, gauss = state[1]
    plain: dict = {"torch": state[0], "python": [int(version), [int(x) for x in internal], gauss], "numpy": None}
    if state[2] is not None:
        name, keys, pos, has_gauss, cached = state[2]
        plain["numpy"] = [str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return plain


def rng_state_from_plain(plain) -> tuple:
    """The inverse of :func:`plain_rng_state` (a state already in :func:`rng_state`'s form is
    returned as it is)."""
    if not isinstance(plain, dict):
        return tuple(plain)
    version, internal, gauss = plain["python"]
    numpy_state = None
    if plain.get("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = plain["numpy"]
        numpy_state = (name, np.asarray(keys, dtype=np.int64).astype(np.uint32), int(pos), int(has_gauss), float(cached))
    return (plain["torch"], (int(version), tuple(int(x) for x in internal), gauss), numpy_state)


def set_rng_state(state: tuple) -> None:
    import random

    torch.set_rng_state(state[0])
    random.setstate(state[1])
    if state[2] is not None:
        import numpy as np

        np.random.set_state(state[2])


class _CachedLoader:
    """Stands in for a DatasetFolder's ``loader`` during one ``dataset[i]``: the path being
    loaded gets the cached bytes, any other path the original loader."""

    def __init__(self, original: Callable, decode: Callable, path, data):
        self.original, self.decode = original, decode
        self.path, self.data = path, data

    def __call__(self, path):
        data, self.data = self.data, None
        if data is not None and path == self.path:
            try:
                return self.decode(data)
            except Exception as exc:  # the decoder saw bytes, not a file: name the file
                try:
                    named = type(exc)(f"{os.fsdecode(path)} ({len(data)} bytes): {exc}")
                except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                    raise exc from None
                raise named from exc
        return self.original(path)


class CachedDataset(torch.utils.data.Dataset):
    """The dataset torch's iterator (and its workers) see in clairvoyant's place of the user's:
    ``dataset[i]`` of the user's dataset, computed from the bytes clairvoyant staged for it.

    Each batch's bytes stay in shared memory until this process says it is done with them:
    ``done[token % len(done)] = token + 1`` (a shared tensor the loading process reads)."""

    def __init__(self, dataset, kind: str, done: torch.Tensor, states: torch.Tensor, board=None):
        self.dataset = dataset
        self.kind = kind
        self.board = board  # where a ticket's bytes are posted (see _tickets)
        self.done = done
        self.states = states  # [slots, bytes]: RNG state before each batch, for exact resume
        self._maps: dict = {}
        self._folder = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}
        state["_folder"] = None
        state.pop("_decode", None)
        return state

    def __len__(self) -> int:
        return len(self.dataset)

    def _region(self, path: str):
        m = self._maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = self._maps[path] = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        return m

    def _bytes(self, k: int, segments, where, private):
        """Sample ``k``'s bytes; None: clairvoyant could not read it (the dataset reads it)."""
        return self._bytes_at(k, where[k], segments, private)

    def _bytes_at(self, k: int, row, segments, private):
        if k in private:
            return memoryview(private[k])
        r, off, n = row
        if r == _tickets.DATASET_READS:
            return None
        if n == 0:
            return memoryview(b"")
        return self._region(segments[r])[off : off + n]

    def _sample(self, index: int, data):
        """``dataset[index]`` from its staged bytes, or read by the dataset (``data`` None)."""
        return self.dataset[index] if data is None else self._item(index, data)

    def _posted_items(self, req) -> list:
        """The batch of ticket ``req``, each sample computed as soon as its bytes are posted
        (the batch is posted in parts as it is staged: the first samples are decoded while the
        last are read)."""
        items, k, n = [], 0, len(req)
        while k < n:
            where, private, final = self.board.redeem_from(req.token, k)
            if where is None:  # clairvoyant could not read the batch: as torch would, from k on
                items += [self.dataset[i] for i in req[k:]]
                break
            for row in where:
                items.append(self._sample(req[k], self._bytes_at(k, row, req.segments, private)))
                k += 1
            if final and k < n:
                raise CorruptError(f"batch {req.token}'s post describes {k} of its {n} samples")
        return items

    def _where(self, req) -> tuple:
        """(where, private) of a request: a ticket waits until its bytes are staged."""
        if isinstance(req.where, str):
            return self.board.redeem(req.token)
        return req.where, req.private

    def _item(self, index: int, data):
        if self.kind == "protocol":
            return self.dataset.__clairvoyant_getitem__(index, data)
        folder = self._folder
        if folder is None:
            folder = self._folder = folder_root(self.dataset)[0]
            self._decode = _byte_decoder(folder.loader)
        # The dataset's own __getitem__ runs; only its loader is given the bytes, for this call
        # (the dataset object is the user's in a single-process loader: it is left as it was).
        original = folder.loader
        folder.loader = _CachedLoader(original, self._decode, self._path_of(index), data)
        try:
            return self.dataset[index]
        finally:
            folder.loader = original

    def _path_of(self, index: int):
        d = self.dataset
        while isinstance(d, torch.utils.data.Subset):
            index = d.indices[index]
            d = d.dataset
        return d.samples[index][0]

    def _begin(self, req) -> None:
        if req.restore is not None:
            set_rng_state(req.restore)
        self._record(req.token)

    def _record(self, token: int) -> None:
        """Keep this worker's random state before batch ``token`` (for an exact resume)."""
        import pickle

        states = self.states
        if states.numel() == 0:
            return
        blob = pickle.dumps((token, rng_state()), protocol=pickle.HIGHEST_PROTOCOL)
        row = states[token % states.shape[0]]
        if len(blob) + 8 > row.numel():
            return
        view = row.numpy()
        view[8 : 8 + len(blob)] = memoryview(blob)
        view[:8] = memoryview(len(blob).to_bytes(8, "little"))

    def __getitems__(self, req):
        if not isinstance(req, Batch):  # not one of clairvoyant's batches: as torch would
            return [self.dataset[i] for i in req]
        # This worker may have decoded it ahead: the decode ahead ends before anything else runs.
        early = _ahead.claim(req.token) if req.last is not None or _ahead.active() else None
        try:
            self._begin(req)
            if early is not None and not early.adopted(req, self.board):
                early = None
            if early is None and isinstance(req.where, str):
                return self._posted_items(req)
            # An adopted batch's post holds the bytes it was decoded from.
            where, private = (early.where, early.private) if early is not None else self._where(req)
            if where is None:  # not cached, or clairvoyant could not read it: as torch would
                return [self.dataset[i] for i in req]
            items = early.use() if early is not None else None
            if items is not None:
                return items
            return [self._sample(i, self._bytes(k, req.segments, where, private)) for k, i in enumerate(req)]
        finally:
            self.done[req.token % self.done.numel()] = req.token + 1
            if req.last is not None:
                _ahead.after(self, req)

    def __getitem__(self, req):
        if not isinstance(req, Index):
            return self.dataset[req]
        try:
            self._begin(req)
            where, private = self._where(req)
            if where is None:
                return self.dataset[int(req)]
            return self._sample(int(req), self._bytes(0, req.segments, where, private))
        finally:
            self.done[req.token % self.done.numel()] = req.token + 1


def read_state(states: torch.Tensor, token: int) -> Optional[tuple]:
    """The random state a worker recorded before batch ``token``, if it did."""
    import pickle

    if states.numel() == 0:
        return None
    view = states[token % states.shape[0]].numpy()
    n = int.from_bytes(bytes(view[:8]), "little")
    if n == 0 or n + 8 > view.size:
        return None
    try:
        got, state = pickle.loads(bytes(view[8 : 8 + n]))
    except Exception:
        return None
    return state if got == token else None
