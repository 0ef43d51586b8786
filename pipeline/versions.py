"""Versions recorded in every manifest (read from package metadata: no heavy imports)."""
from __future__ import annotations

import functools
import platform
from importlib import metadata

_PACKAGES = ("vlcurate", "ray", "pyarrow", "numpy", "pillow", "torch", "timm", "transformers",
             "sentence-transformers", "spacy", "faiss-cpu", "webdataset")


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in _PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out
