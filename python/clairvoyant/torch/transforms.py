"""torchvision's common image transforms under the same names and parameters.

Each class here *is* the torchvision transform (a subclass that adds nothing), so a pipeline
built from them runs exactly as torchvision's wherever it runs in Python, and
``clairvoyant.torch.DataLoader`` recognises them as it recognises torchvision's own (its native
decode path, docs/decode.md, is chosen by the transform's content, not by where the classes come
from). :func:`native_plan` and :class:`BatchDecoder` run a pipeline natively outside a
DataLoader.
"""

from __future__ import annotations

from torchvision import transforms as _T
from torchvision.transforms import v2 as _v2

from ._native_pipeline import BatchDecoder, NativePlan, native_plan

__all__ = [
    "Compose",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ToTensor",
    "PILToTensor",
    "ToImage",
    "ToDtype",
    "Normalize",
    "BatchDecoder",
    "NativePlan",
    "native_plan",
]


class Compose(_T.Compose):
    """torchvision.transforms.Compose."""


class RandomResizedCrop(_T.RandomResizedCrop):
    """torchvision.transforms.RandomResizedCrop (bilinear or bicubic stay native)."""


class RandomHorizontalFlip(_T.RandomHorizontalFlip):
    """torchvision.transforms.RandomHorizontalFlip."""


class Resize(_T.Resize):
    """torchvision.transforms.Resize (int size = shorter side, or (h, w))."""


class CenterCrop(_T.CenterCrop):
    """torchvision.transforms.CenterCrop."""


class ToTensor(_T.ToTensor):
    """torchvision.transforms.ToTensor: float32 CHW in [0, 1]."""


class PILToTensor(_T.PILToTensor):
    """torchvision.transforms.PILToTensor: uint8 CHW."""


class ToImage(_v2.ToImage):
    """torchvision.transforms.v2.ToImage: uint8 CHW."""


class ToDtype(_v2.ToDtype):
    """torchvision.transforms.v2.ToDtype (native for float32 with scale=True)."""


class Normalize(_T.Normalize):
    """torchvision.transforms.Normalize."""
