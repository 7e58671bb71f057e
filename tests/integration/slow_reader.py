"""A `data.transforms` call for tests: a reader that spends `seconds` on every block (a slow disk or decode)."""

from __future__ import annotations

import time

import pyarrow as pa


def slow(batch: pa.Table, seconds: float = 0.1) -> pa.Table:
    time.sleep(seconds)
    return batch
