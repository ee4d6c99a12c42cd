"""The one-line change for scripts that write ``torch.utils.data.DataLoader(...)`` in full.

``import clairvoyant.torch.patch`` makes ``torch.utils.data.DataLoader`` name
:class:`clairvoyant.torch.DataLoader` in this process (torch's class stays reachable as
``torch.utils.data.dataloader.DataLoader``, and ``clairvoyant.torch.DataLoader`` is a subclass of
it, so ``isinstance`` checks keep passing). Import it before the script builds its loaders.
"""

import torch.utils.data

from ._dropin import DataLoader

torch.utils.data.DataLoader = DataLoader
