"""Byte sizes written the way people write them: 8GiB, 500MB, 1.5 GB, 1048576."""

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if unit not in _UNITS or value is None or value < 0:
        raise ConfigError(f"{text!r} is not a size (e.g. 8GiB, 500MB, 1048576)")
    return int(value * _UNITS[unit])
