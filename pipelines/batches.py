"""Turning Arrow record batches into the (features, labels) tensors the loop trains on."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from ray.data.collate_fn import ArrowBatchCollateFn


def _column_matrix(column: pa.ChunkedArray) -> np.ndarray:
    """A (rows, width) float32 matrix; fixed-size lists are flattened without a per-row Python loop."""
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        # .flatten() honours the array offset; .values would not after slicing.
        return array.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, width)
    return array.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, 1)


def collate_arrow(table: pa.Table, features: list[str], label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the feature columns into one float32 tensor: one tensor per batch is the fastest path into torch."""
    parts = [_column_matrix(table.column(name)) for name in features]
    x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    y = table.column(label).combine_chunks().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return _tensor(x), _tensor(y)


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are read-only; torch wants writable memory, and a copy of one batch is cheap.
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class FeatureCollate(ArrowBatchCollateFn):
    """Collate for `iter_torch_batches`: Arrow batch in, `(x, y)` tensors out (moved to the device by Ray)."""

    def __init__(self, features: list[str], label: str) -> None:
        super().__init__()
        self.features = list(features)
        self.label = label

    def __call__(self, batch: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
        return collate_arrow(batch, self.features, self.label)
