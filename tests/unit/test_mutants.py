"""`make mutate` plants its bugs by exact text: each planted edit must still find its code, or the check stops
before planting anything (as it did once the loop's batches became named tensors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
assert spec and spec.loader
mutate = importlib.util.module_from_spec(spec)
sys.modules["mutate"] = mutate  # dataclasses look their module up there
spec.loader.exec_module(mutate)


@pytest.mark.parametrize("mutant", mutate.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_finds_its_code_once_and_names_tests_that_exist(mutant: object) -> None:
    assert (ROOT / mutant.file).read_text().count(mutant.old) == 1, f"update scripts/mutate.py: {mutant.name}"
    assert mutant.new != mutant.old
    for test in mutant.tests:  # a file, or one test in it (file::name)
        path, _, name = test.partition("::")
        assert (ROOT / path).exists(), test
        assert not name or f"def {name}(" in (ROOT / path).read_text(), test
