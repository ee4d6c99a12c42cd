"""Twelve small files and a dataset over them with clairvoyant's dataset protocol, for the
scripts tests run in a fresh interpreter: ``make(folder)`` writes the files, ``SCRIPT`` (with
``DATA`` set to that folder first) defines ``Plain`` and ``files``, and ``EXPECTED`` is what
every sample yields, sorted."""

import os

SCRIPT = """
import os, torch

class Plain(torch.utils.data.Dataset):
    def __init__(self, files):
        self.files = files
    def __len__(self):
        return len(self.files)
    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            return self.__clairvoyant_getitem__(i, f.read())
    def __clairvoyant_files__(self):
        return self.files
    def __clairvoyant_getitem__(self, i, data):
        return torch.tensor([i, len(data)])

files = [os.path.join(DATA, f"{i}.bin") for i in range(12)]
EXPECTED = [(i, 100 + i) for i in range(12)]
"""


def make(folder) -> str:
    """Write the files into ``folder`` (created); returns the script's header defining DATA."""
    os.makedirs(folder, exist_ok=True)
    for i in range(12):
        with open(os.path.join(folder, f"{i}.bin"), "wb") as f:
            f.write(bytes([i]) * (100 + i))
    return f"DATA = {str(folder)!r}\n" + SCRIPT
