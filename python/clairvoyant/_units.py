"""Byte sizes written the way people write them: 8GiB, 500MB, 1.5 GB, 1048576."""


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``; a ``ConfigError`` naming ``what`` otherwise. The core's parser
    (``model::parse_bytes``), the one the configuration file and the environment use."""
    from . import _native

    return _native.parse_bytes(str(text), what)
