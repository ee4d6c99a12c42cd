"""The Python start-up hook of `clairvoyant run --sampler-order` (a directory put on PYTHONPATH)."""
