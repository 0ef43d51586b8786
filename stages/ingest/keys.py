"""Record keys: a source's own keys, and the keys the project invents for keyless records, in
two namespaces that can never meet.

An invented key starts with ``INVENTED`` (``∅:``); a real key that starts with ``∅`` is stored
with one more ``∅`` in front (``∅x`` -> ``∅∅x``), so no real key can start with ``∅:``. So a
source record whose key is ``∅:row3`` (or anything else) never collides with the key invented for a
keyless record, and a real key is never rejected as a duplicate because an invented one took its
string. ``invented(key)`` says which a stored key is (the ``key_invented`` column).

An invented key is made from where the record sits in its source: the file's name and the
record's position there (the first line of a captions record, a Parquet row's index in its
file, a tar record's ordinal in its tar), so it is stable while the file is unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

MARK = "\u2205"              # ∅
INVENTED = MARK + ":"


def real(key: Any) -> Optional[str]:
    """A source's key as stored: None when it has none (null or empty), else the text with a
    leading ``∅`` doubled."""
    if key is None:
        return None
    key = key if isinstance(key, str) else str(key)
    if not key:
        return None
    return MARK + key if key.startswith(MARK) else key


def invent(where: str) -> str:
    """The key of a record that has none, from its place in the source (``captions.csv:12``)."""
    return INVENTED + where


def invented(key: str) -> bool:
    return key.startswith(INVENTED)
