"""Versions recorded in every manifest (read from package metadata: no heavy imports)."""
from __future__ import annotations

import functools
import platform
from importlib import metadata

_PACKAGES = ("vlcurate", "ray", "pyarrow", "numpy", "pillow", "torch", "timm", "transformers",
             "sentence-transformers", "spacy", "faiss-cpu", "webdataset")


def installed(*dists: str) -> dict[str, str]:
    """{distribution: version} of those installed (the others are left out)."""
    out = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return out


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    return {"python": platform.python_version(), **installed(*_PACKAGES)}
