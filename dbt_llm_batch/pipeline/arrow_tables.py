"""Arrow tables made from Python values, and NumPy arrays read from Arrow, without importing pandas.

pyarrow imports pandas, when it is installed, the first time it converts Python or NumPy values
(`pa.array`, `pa.table` of lists or arrays, `pa.scalar`, `Array.to_numpy`, `pc.fill_null(a, 0)`):
it asks its pandas shim whether the value is a pandas object. That import takes 0.25-0.35 s on
this project's 2-core machine, and a submit or a harvest paid it in every `dbt run` although no
pandas object is ever involved. So the run builds its small tables with DuckDB (which converts
Python lists itself) and moves NumPy arrays through Arrow buffers, neither of which asks the shim.
A user's Python model that uses pandas still imports it, as it would without this plugin.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# The fixed-width Arrow types the run reads and writes as NumPy arrays.
_NUMPY_TYPES = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float64(): np.float64,
}
_ARROW_TYPES = {np.dtype(numpy_type): arrow_type for arrow_type, numpy_type in _NUMPY_TYPES.items()}


def from_lists(con, columns: dict[str, tuple[str, list]]) -> pa.Table:
    """A table of the columns {name: (DuckDB type, Python values)}, all of one length, made by DuckDB
    on `con` (which must have no result pending)."""
    names = list(columns)
    selects = ", ".join(f'unnest(${i + 1}::{columns[n][0]}[]) as "{n}"' for i, n in enumerate(names))
    return con.sql(f"select {selects}", params=[list(columns[n][1]) for n in names]).to_arrow_table()


def from_numpy(columns: dict[str, np.ndarray]) -> pa.Table:
    """A table of the NumPy arrays {name: array}, all of one length, sharing their memory."""
    arrays = []
    for values in columns.values():
        values = np.ascontiguousarray(values)
        arrays.append(pa.Array.from_buffers(_ARROW_TYPES[values.dtype], len(values), [None, pa.py_buffer(values)]))
    return pa.Table.from_arrays(arrays, names=list(columns))


def to_numpy(array: pa.Array, dtype, null=None) -> np.ndarray:
    """A copy of the fixed-width `array` as NumPy `dtype`; nulls become `null` (an error if None)."""
    if array.type not in _NUMPY_TYPES:  # e.g. a SUM's DECIMAL(38, 0): Arrow's safe cast fails on any loss
        array = array.cast(_ARROW_TYPES[np.dtype(dtype)])
    start, n = array.offset, len(array)
    if n == 0:
        return np.empty(0, dtype=dtype)
    validity, data = array.buffers()[:2]
    values = np.frombuffer(data, dtype=_NUMPY_TYPES[array.type])[start : start + n].astype(dtype)
    if array.null_count:
        if null is None:
            raise ValueError(f"dbt-llm-batch bug: an unexpected NULL among {n} values")
        present = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")[start : start + n]
        values[present == 0] = null
    return values
