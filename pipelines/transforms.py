"""Per-batch preprocessing declared in `data.transforms`, run inside Ray Data `map_batches` (on Ray
Data's CPUs, overlapped with training) rather than in the training loop."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.entrypoints import load_function
from pipelines.errors import DataError
from pipelines.rest import ROW_ID

_DTYPES = {"float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64()}


def _map_values(column: pa.ChunkedArray, fn: Any) -> pa.ChunkedArray:
    """Apply `fn` to the numbers of a numeric or fixed-size-list column, keeping the list shape."""
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        values = fn(array.flatten())
        return pa.chunked_array([pa.FixedSizeListArray.from_arrays(values, array.type.list_size)])
    return pa.chunked_array([fn(array)])


def _normalize(mean: float, std: float) -> Any:
    def fn(values: pa.Array) -> pa.Array:
        # Integers become float32 (the training dtype); floats keep their width.
        if not pa.types.is_floating(values.type):
            values = values.cast(pa.float32())
        scalar = np.dtype(values.type.to_pandas_dtype()).type
        return pc.divide(pc.subtract(values, pa.scalar(scalar(mean))), pa.scalar(scalar(std)))
    return fn


def _cast(dtype: str) -> Any:
    return lambda values: values.cast(_DTYPES[dtype])


def apply_transforms(table: pa.Table, transforms: list[dict[str, Any]],
                     features: list[str]) -> pa.Table:
    """Apply the configured transforms in order to the feature columns (or each transform's
    `columns`)."""
    for item in transforms:
        (name, args), = item.items()
        if name == "call":
            table = _call(table, args["fn"], args.get("kwargs") or {})
            continue
        fn = (_normalize(args.get("mean", 0.0), args.get("std", 1.0)) if name == "normalize"
              else _cast(args["dtype"]))
        for column in args.get("columns") or features:
            index = table.schema.get_field_index(column)
            table = table.set_column(index, column, _map_values(table.column(index), fn))
    return table


def _call(table: pa.Table, spec: str, kwargs: dict[str, Any]) -> pa.Table:
    # The user's function sees only the data's own columns. The rows keep their ids (rest.ROW_ID)
    # when it keeps their number (and so, by the contract of a map, their order); a function that
    # filters loses them.
    ids = table.column(ROW_ID) if ROW_ID in table.column_names else None
    out = load_function(spec)(table.drop_columns([ROW_ID]) if ids is not None else table, **kwargs)
    if not isinstance(out, pa.Table):
        raise DataError(f"transform {spec} returned {type(out).__name__}, not a "
                        "pyarrow.Table: return the batch it was given, transformed")
    kept = ids is not None and out.num_rows == table.num_rows
    return out.append_column(ROW_ID, ids) if kept else out
