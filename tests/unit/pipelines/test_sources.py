"""Parquet checks that run on the driver before Ray starts: each bad input names the file or column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.batches import collate_arrow
from pipelines.errors import DataError
from pipelines.prepare import prepare_digits, prepare_synthetic
from pipelines.sources import inspect_parquet


def test_digits_are_real_and_split(tmp_path: Path) -> None:
    counts = prepare_digits(str(tmp_path))
    assert counts == {"train": 1438, "val": 359}
    info = inspect_parquet(str(tmp_path / "train"), ["pixels"], "label")
    assert (info.num_rows, info.feature_dim, info.num_classes, len(info.files)) == (1438, 64, 10, 4)
    table = pq.read_table(info.files[0])
    x, y = collate_arrow(table, ["pixels"], "label").values()
    assert x.shape == (len(table), 64) and x.dtype.is_floating_point and 0 <= float(x.min()) <= float(x.max()) <= 1
    assert y.dtype.is_signed and set(y.tolist()) <= set(range(10))
    assert not (tmp_path / "train" / ".part-00000.parquet.tmp").exists()  # written via rename


def test_synthetic_is_learnable_and_sized(tmp_path: Path) -> None:
    prepare_synthetic(str(tmp_path), rows=1000, shards=3, features=8, classes=3, val_rows=300)
    train = inspect_parquet(str(tmp_path / "train"), ["features"], "label")
    assert (train.num_rows, train.feature_dim, len(train.files)) == (1000, 8, 3)
    tx, ty = collate_arrow(pq.read_table(train.files), ["features"], "label").values()
    vx, vy = collate_arrow(pq.read_table(tmp_path / "val"), ["features"], "label").values()
    # Nearest class mean from train classifies val well above chance (1/3): the task is learnable.
    means = np.stack([tx[ty == c].mean(0).numpy() for c in range(3)])
    pred = ((vx.numpy()[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == vy.numpy()).mean() > 0.8
    assert not np.allclose(tx[:300].numpy(), vx.numpy())  # val rows are not train rows


def test_collate_concatenates_scalar_and_list_columns() -> None:
    table = pa.table({
        "a": pa.array([1.0, 2.0, 3.0]),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.float32)), 2),
        "label": pa.array([0, 1, 0]),
    }).slice(1)  # a sliced table exercises array offsets
    x, y = collate_arrow(table, ["a", "v"], "label").values()
    assert x.tolist() == [[2.0, 2.0, 3.0], [3.0, 4.0, 5.0]]
    assert y.tolist() == [1, 0]


def test_missing_path_names_it_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*nowhere' does not exist: create it with `orchestrator prepare"):
        inspect_parquet(str(tmp_path / "nowhere"), ["x"], "label")


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="holds no .parquet files"):
        inspect_parquet(str(tmp_path), ["x"], "label")


def test_corrupt_file_is_named(tmp_path: Path) -> None:
    prepare_digits(str(tmp_path))
    bad = tmp_path / "train" / "part-00002.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"corrupt Parquet file .*part-00002.parquet"):
        inspect_parquet(str(tmp_path / "train"), ["pixels"], "label")


def test_missing_column_is_named(tmp_path: Path) -> None:
    prepare_digits(str(tmp_path))
    with pytest.raises(DataError, match=r"column\(s\) \['pixel'\] not found .* fix data.features"):
        inspect_parquet(str(tmp_path / "train"), ["pixel"], "label")


def test_schema_mismatch_names_file_and_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0]), "label": pa.array([0])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array(["s"]), "label": pa.array([1])}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"schema mismatch in .*b.parquet: column 'x' is string"):
        inspect_parquet(str(tmp_path), ["x"], "label")


def test_ragged_features_are_refused_unless_the_model_takes_them_by_name(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([[1.0], [1.0, 2.0]]), "label": pa.array([0, 1])}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match="fixed-size list.*need model.inputs"):
        inspect_parquet(str(tmp_path), ["x"], "label")
    with pytest.raises(DataError, match="fixed-size list"):  # variable-length floats have no padding rule
        inspect_parquet(str(tmp_path), ["x"], "label", named=True)
    pq.write_table(pa.table({"ids": pa.array([[5], [6, 7]]), "label": pa.array([0, 1])}), tmp_path / "a.parquet")
    info = inspect_parquet(str(tmp_path), ["ids"], "label", named=True)  # token ids of any length, by name
    assert info.feature_dim == 0 and info.sample is not None and info.sample.num_rows == 2


def test_text_becomes_next_token_sequences(tmp_path: Path) -> None:
    from pipelines.prepare import prepare_text

    source = tmp_path / "a.txt"
    source.write_bytes(bytes(range(256)) * 4)
    counts = prepare_text([str(source)], str(tmp_path / "out"), seq_len=16, shards=2)
    assert counts["train"] + counts["val"] == (1024 + 1 - 1) // 16  # +1: the newline appended after each file
    info = inspect_parquet(str(tmp_path / "out" / "train"), ["tokens"], None)
    assert (info.feature_dim, info.num_classes, info.num_rows) == (17, 256, counts["train"])
    x, y = collate_arrow(pq.read_table(info.files[0]).slice(1, 2), ["tokens"], None).values()
    assert x.shape == y.shape == (2, 16) and x.dtype == y.dtype
    assert x[0].tolist() == list(range(16, 32)) and y[0].tolist() == list(range(17, 33))  # targets shifted by one
    with pytest.raises(DataError, match="fixed-size list of integer token ids"):
        prepare_digits(str(tmp_path / "d"))
        inspect_parquet(str(tmp_path / "d" / "train"), ["pixels"], None)
    with pytest.raises(DataError, match="too few for two sequences"):
        prepare_text([str(source)], str(tmp_path / "short"), seq_len=4096)


def test_language_model_needs_exactly_one_token_column() -> None:
    from pydantic import ValidationError

    from pipelines.config import DataConfig

    assert DataConfig(features=["tokens"], label=None).columns == ["tokens"]
    assert DataConfig().columns == ["pixels", "label"]
    with pytest.raises(ValidationError, match="exactly one token column"):
        DataConfig(features=["a", "b"], label=None)
