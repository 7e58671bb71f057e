"""What every config section is built on: a section refuses unknown keys and inf/nan, a
cross-field error names the key to change, and a name that is not known suggests the close match."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


class _Section(BaseModel):
    # inf/nan pass gt/ge bounds (inf > 0) and then poison a schedule, a timeout or a price: refuse
    # them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @property
    def dotted(self) -> dict[str, Any]:
        """The section as flat dotted keys, values as its plain data has them (`to_dict`): for
        the whole config {'optim.lr': 0.0003, ...}, what a run's name and a --resume's comparison
        read."""
        return flatten(self.model_dump(mode="json"))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1}} -> {'optim.lr': 1} (MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _key_error(loc: tuple[str, ...], message: str, value: Any) -> ValidationError:
    """A validation error placed at the config key `loc`: a cross-field check in a model
    validator otherwise has no location, and the user's one line would not name the key to
    change."""
    error = PydanticCustomError("value_error", "{message}", {"message": message})
    details = InitErrorDetails(type=error, loc=loc, input=value)
    return ValidationError.from_exception_data("Config", [details])


def suggest(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'x'?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
