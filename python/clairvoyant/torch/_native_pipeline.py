"""Recognising a torchvision transform pipeline and running it natively.

:func:`native_plan` maps a ``transforms.Compose`` / ``transforms.v2.Compose`` of known transforms
(exact classes, so a user subclass that overrides behaviour is never mistaken for the original)
to a :class:`NativePlan`; anything it does not know gives ``None`` and the caller keeps the
Python path. :class:`BatchDecoder` runs a plan on batches of encoded images with
``clairvoyant._native.DecodePipeline``: decode threads in Rust, the GIL released, each batch
written into one (pinned, when CUDA is available) tensor from a small ring reused batch after
batch.

What "the same as torchvision" means here is in docs/decode.md: geometric transforms act on the
decoded 8-bit RGB image as torchvision does on a PIL image (Pillow's antialiased filters; the
``antialias`` flag is ignored for PIL inputs by torchvision too), random parameters are drawn with
torchvision's formulas from a per-sample stream seeded by (seed, epoch, sample) instead of torch's
global generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .. import _native
from ..errors import ConfigError

__all__ = ["NativePlan", "native_plan", "BatchDecoder"]


@dataclass(frozen=True)
class NativePlan:
    """A recognised pipeline: ``ops`` in ``_native.DecodePipeline``'s tuple form and the output."""

    ops: tuple
    output: str  # "uint8_chw" or "float32_chw"
    mean: tuple = (0.0, 0.0, 0.0)
    std: tuple = (1.0, 1.0, 1.0)


def _classes(names: Sequence[str]) -> dict:
    """name -> set of exact classes (torchvision v1, v2, and clairvoyant's subclasses)."""
    from torchvision import transforms as T
    from torchvision.transforms import v2

    from . import transforms as C

    out: dict = {}
    for n in names:
        out[n] = {getattr(m, n) for m in (T, v2, C) if hasattr(m, n)}
    return out


_KINDS = (
    "Compose",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ToTensor",
    "PILToTensor",
    "ToImage",
    "ToDtype",
    "ConvertImageDtype",
    "Normalize",
)


def _interp(mode: Any) -> Optional[str]:
    value = getattr(mode, "value", mode)
    return value if value in ("bilinear", "bicubic") else None


def _hw(size: Any) -> Optional[tuple]:
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 1:
        return (int(size[0]), int(size[0]))
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return (int(size[0]), int(size[1]))
    return None


def _three(v: Any) -> Optional[tuple]:
    v = [float(x) for x in v]
    if len(v) == 1:
        v = v * 3
    return tuple(v) if len(v) == 3 else None


def _flatten(transform: Any, compose: set) -> Optional[list]:
    if type(transform) in compose:
        out: list = []
        for t in transform.transforms:
            sub = _flatten(t, compose)
            if sub is None:
                return None
            out.extend(sub)
        return out
    return [transform]


def native_plan(transform: Any) -> Optional[NativePlan]:
    """The native equivalent of ``transform`` (applied to a PIL RGB image), or None.

    Recognised, from ``torchvision.transforms``, ``torchvision.transforms.v2`` or
    ``clairvoyant.torch.transforms`` (nested ``Compose`` too): RandomResizedCrop, Resize,
    CenterCrop (bilinear/bicubic), RandomHorizontalFlip, then one conversion (ToTensor; or
    PILToTensor/ToImage, optionally followed by ToDtype(float32, scale=True) or
    ConvertImageDtype(float32)), then at most one Normalize. The result must have a fixed size
    (so samples collate) and be a tensor; anything else is None.
    """
    try:
        k = _classes(_KINDS)
    except ImportError:  # pragma: no cover - torchvision is optional
        return None
    flat = _flatten(transform, k["Compose"])
    if not flat:
        return None
    ops: list = []
    output: Optional[str] = None  # None while the sample is still a PIL image
    mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    normalized = False
    for t in flat:
        kind = next((n for n, cls in k.items() if type(t) in cls), None)
        geometric = kind in ("RandomResizedCrop", "RandomHorizontalFlip", "Resize", "CenterCrop")
        if geometric and output is not None:
            return None  # tensor resampling differs from Pillow's; keep torchvision's
        if kind == "RandomResizedCrop":
            hw, mode = _hw(t.size), _interp(t.interpolation)
            if hw is None or mode is None:
                return None
            ops.append(("random_resized_crop", hw[0], hw[1], tuple(map(float, t.scale)), tuple(map(float, t.ratio)), mode))
        elif kind == "RandomHorizontalFlip":
            ops.append(("hflip", float(t.p)))
        elif kind == "Resize":
            mode = _interp(t.interpolation)
            size = [t.size] if isinstance(t.size, int) else t.size
            if mode is None or size is None or len(size) not in (1, 2):
                return None
            ops.append(("resize", [int(s) for s in size], t.max_size, mode))
        elif kind == "CenterCrop":
            hw = _hw(t.size)
            if hw is None:
                return None
            ops.append(("center_crop", hw[0], hw[1]))
        elif kind == "ToTensor" and output is None:
            output = "float32_chw"
        elif kind in ("PILToTensor", "ToImage") and output is None:
            output = "uint8_chw"
        elif kind == "ToDtype" and output == "uint8_chw":
            dtype = t.dtype.get(torch.Tensor, t.dtype.get("others")) if isinstance(t.dtype, dict) else t.dtype
            if dtype is not torch.float32 or not t.scale:
                return None
            output = "float32_chw"
        elif kind == "ConvertImageDtype" and output == "uint8_chw":
            if t.dtype is not torch.float32:
                return None
            output = "float32_chw"
        elif kind == "Normalize" and output == "float32_chw" and not normalized:
            m, s = _three(t.mean), _three(t.std)
            if m is None or s is None:
                return None
            mean, std, normalized = m, s, True
        else:
            return None
    if output is None:
        return None
    plan = NativePlan(tuple(ops), output, mean, std)
    try:
        _native.DecodePipeline(list(plan.ops), plan.output, list(plan.mean), list(plan.std), False, 1)
    except Exception:  # not collatable (no fixed size) or invalid parameters: torchvision decides
        return None
    return plan


class BatchDecoder:
    """Decode batches of encoded images with a :class:`NativePlan` on ``threads`` Rust threads.

    Each call returns a tensor of shape ``(len(inputs), *sample_shape)`` taken from a ring of
    ``depth`` buffers per batch size, allocated once and reused: the tensor returned by a call
    stays valid until ``depth`` further calls. Buffers are pinned (page-locked, ready for
    ``.to("cuda", non_blocking=True)``) when ``pin_memory`` is true, which is the default when
    CUDA is available.
    """

    def __init__(
        self,
        plan: NativePlan,
        threads: int = 0,
        *,
        pin_memory: Optional[bool] = None,
        depth: int = 2,
        exif_orientation: bool = False,
    ):
        if depth < 1:
            raise ConfigError(f"depth must be >= 1, got {depth}")
        self.plan = plan
        self._pipe = _native.DecodePipeline(list(plan.ops), plan.output, list(plan.mean), list(plan.std), exif_orientation, threads)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.depth = depth
        self._ring: dict = {}
        self._turn: dict = {}

    @property
    def sample_shape(self) -> tuple:
        return tuple(self._pipe.sample_shape)

    @property
    def threads(self) -> int:
        return self._pipe.threads

    def _buffer(self, n: int) -> torch.Tensor:
        ring = self._ring.setdefault(n, [])
        turn = self._turn.get(n, 0)
        self._turn[n] = (turn + 1) % self.depth
        if turn < len(ring):
            return ring[turn]
        dtype = torch.float32 if self.plan.output == "float32_chw" else torch.uint8
        buf = torch.empty((n, *self.sample_shape), dtype=dtype, pin_memory=self.pin_memory)
        ring.append(buf)
        return buf

    def decode(
        self,
        inputs: Sequence[Any],
        samples: Sequence[int],
        *,
        seed: int = 0,
        epoch: int = 0,
        names: Optional[Sequence[str]] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Decode ``inputs`` (bytes or 1-D uint8 numpy arrays) into one batch tensor.

        Sample ``i`` draws its random parameters from (seed, epoch, samples[i]). A decode error
        raises ``clairvoyant.CorruptError`` naming the sample (and ``names[i]`` when given).
        """
        if len(inputs) != len(samples):
            raise ConfigError(f"{len(inputs)} inputs but {len(samples)} sample ids")
        if out is None:
            out = self._buffer(len(inputs))
        self._pipe.run(list(inputs), [int(s) for s in samples], seed, epoch, out.numpy(), None if names is None else list(names))
        return out
