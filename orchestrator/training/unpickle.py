"""Reading a checkpoint's pickled state without running code from storage. Run storage is often a
shared bucket: whoever can write there could plant a `__reduce__` payload that
`torch.load(weights_only=False)` runs in every worker that resumes. torch's weights-only unpickler
takes tensors, numbers, strings and containers; the product's own state adds only these types:
numpy's RNG state array (`np.random.get_state()`), the byte buffer FSDP's training state travels in
through DCP, and Python's container types by name (a model's `get_extra_state` may pickle one as
`dict()`): constructors that build data, never run code."""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any

import numpy as np
import torch

from orchestrator.errors import UserError

# numpy 2 renamed the module its arrays pickle through
_NUMPY_CORE = np._core if hasattr(np, "_core") else np.core
SAFE_TYPES = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
              io.BytesIO, dict, list, set, frozenset]


class CheckpointRefused(UserError):
    """A checkpoint file holds something other than the product's state: it was not loaded."""


def load_state_file(source: str | IO[bytes], name: str) -> Any:
    """`torch.load` of a checkpoint's state (a path, or a file object read from storage: `name` says
    which file it is) on the CPU, with the weights-only unpickler and SAFE_TYPES; anything else is
    refused, naming the file."""
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = (re.search(r"GLOBAL (\S+)", str(exc))
                 or re.search(r"Unsupported global: (\S+)", str(exc)))
        what = found[1] if found else "something other than tensors and the product's own state"
        raise CheckpointRefused(
            f"checkpoint file {name} refused: it holds {what}, which loading would run "
            "(code from storage); if your model's get_extra_state returns it, return "
            "plain data instead (tensors, numbers, strings, lists, dicts); else "
            "delete that checkpoint, or resume from one this product wrote") from None
