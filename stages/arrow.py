"""Arrow columns from numpy, the one way: every stage and the runner build their list,
fixed-size-list and spread-out columns here."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa


def spread(values: Any, present: np.ndarray) -> Any:
    """One value (an Array's element, a Table's row) per ``present`` row -> one per row, null
    where not present."""
    if present.all():
        return values
    idx = np.cumsum(present) - 1
    return values.take(pa.array(np.where(present, idx, 0), mask=~present))


def list_array(sizes: np.ndarray, values: pa.Array, type: Optional[pa.DataType] = None,
               mask: Optional[pa.Array] = None) -> pa.ListArray:
    """Consecutive runs of ``values``, ``sizes[i]`` long, as row i's list (null where
    ``mask``)."""
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=type, mask=mask)


def masked_lists(values: np.ndarray, valid: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """[n, k] values -> n lists of the values where ``valid``."""
    return list_array(valid.sum(1), pa.array(values[valid], type_))


def fixed_lists(arr: np.ndarray, field_type: Any) -> pa.FixedSizeListArray:
    """(n, d) float array -> fixed_size_list<float32|float16, d> (the field's value type)."""
    np_type = np.float16 if field_type.value_type == pa.float16() else np.float32
    return pa.FixedSizeListArray.from_arrays(pa.array(arr.astype(np_type).ravel()), arr.shape[1])
