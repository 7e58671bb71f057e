"""Finding and checking Parquet shards before any cluster resource is taken.

Only Parquet footers are read here (schema, row counts, statistics), never the rows themselves, so
the driver never loads the dataset.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.config import S3Config
from pipelines.errors import DataError, corrupt_parquet
from pipelines.storage import ObjectInfo, Storage, open_storage, storage_error


@dataclass(frozen=True)
class DatasetInfo:
    """What the driver needs to know about a Parquet dataset to size the model and the schedule."""

    path: str
    files: list[str]
    num_rows: int
    num_bytes: int
    # width of the feature columns concatenated (0 when some column is not a fixed-width number)
    feature_dim: int
    num_classes: int
    schema: pa.Schema | None = field(default=None, repr=False)
    # the first rows of the configured columns
    sample: pa.Table | None = field(default=None, repr=False)
    # Where the shards live and each shard's size/version/row count, for the readers (same order as
    # `files`).
    storage: Storage | None = field(default=None, repr=False)
    objects: list[ObjectInfo] = field(default_factory=list, repr=False)
    file_rows: list[int] = field(default_factory=list, repr=False)


def list_parquet_files(path: str, s3: S3Config | None = None) -> tuple[Storage, list[ObjectInfo]]:
    """The storage and the Parquet files at `path` (a file, a directory searched recursively, or an
    s3://bucket/prefix), sorted by path. Raises DataError naming the path when there are none."""
    storage = open_storage(path, s3)
    return storage, storage.list_objects(".parquet")


def _feature_width(field: pa.Field, file: str, named: bool) -> int:
    """Values per row of a feature column; 0 for what only named inputs take (variable-length lists,
    tensors)."""
    width, value_type = 1, field.type
    while pa.types.is_fixed_size_list(value_type):
        width, value_type = width * value_type.list_size, value_type.value_type
    if _is_numeric(value_type):
        return width
    if named and (isinstance(field.type, pa.ExtensionType)
                  or ((pa.types.is_list(field.type) or pa.types.is_large_list(field.type))
                      and pa.types.is_integer(field.type.value_type))):
        return 0
    raise DataError(
        f"feature column '{field.name}' in {file} has type {field.type}: use a numeric column "
        "or a fixed-size list of numbers"
        + ("" if named else " (variable-length token lists and tensor columns need model.inputs)")
    )


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def read_sample(storage: Storage, files: list[str], rows: list[int], columns: list[str],
                count: int = 8) -> pa.Table:
    """The first `count` rows of `columns` from the first non-empty shard (one row group's pages at
    most): a real batch for checks on the driver, the memory probe and the logged model's input
    example."""
    file = next(f for f, n in zip(files, rows, strict=True) if n)
    try:
        with storage.filesystem().open_input_file(file) as handle:
            batch = next(pq.ParquetFile(handle).iter_batches(batch_size=count, columns=columns))
    except (OSError, pa.ArrowInvalid) as exc:
        raise corrupt_parquet(storage.uri_of(file), exc) from None
    return pa.Table.from_batches([batch])


def _label_max(meta: pq.FileMetaData, column: int) -> int | None:
    """Largest label in a file, from row-group statistics (no rows are read)."""
    best: int | None = None
    for rg in range(meta.num_row_groups):
        stats = meta.row_group(rg).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        best = stats.max if best is None else max(best, stats.max)
    return best


def read_footer(storage: Storage, path: str) -> pq.FileMetaData:
    """One shard's Parquet footer; a corrupt file or an S3 failure becomes a DataError naming the
    object."""
    try:
        with storage.filesystem().open_input_file(path) as handle:
            return pq.read_metadata(handle)
    except pa.ArrowInvalid as exc:
        raise corrupt_parquet(storage.uri_of(path), exc) from None
    except OSError as exc:
        if storage.remote:
            raise storage_error(exc, storage, "reading", path) from None
        raise corrupt_parquet(path, exc) from None


def inspect_parquet(path: str, features: list[str], label: str | None, s3: S3Config | None = None,
                    named: bool = False) -> DatasetInfo:
    """Check every shard's footer (readable, same schema, configured columns present) and summarise
    it, with a sample of its first rows. With `label=None` the single feature column holds token
    sequences (next-token prediction). `named`: the model takes columns by name, so variable-length
    token lists are inputs too."""
    columns = [*features, *([label] if label else [])]
    storage, objects = list_parquet_files(path, s3)
    files = [o.path for o in objects]
    # Footers from an object store are one round trip each: fetch them concurrently (order is kept).
    with ThreadPoolExecutor(max_workers=16 if storage.remote else 1) as pool:
        footers = list(pool.map(lambda f: read_footer(storage, f), files))
    first_schema, num_rows, label_max = _check_footers(storage, files, footers, columns, label)
    file_rows = [meta.num_rows for meta in footers]
    sample = read_sample(storage, files, file_rows, columns) if num_rows else None
    if label is None and not named:
        return _token_info(path, files, objects, footers, first_schema, features[0], storage,
                           sample)
    widths = [_feature_width(first_schema.field(name), storage.uri_of(files[0]), named)
              for name in features]
    if label is None:  # named token column: the vocabulary from `prepare text`'s metadata, if any
        num_classes = int((first_schema.metadata or {}).get(b"vocab_size", b"0"))
    # one output per label (multilabel)
    elif pa.types.is_fixed_size_list(first_schema.field(label).type):
        num_classes = first_schema.field(label).type.list_size
    else:
        num_classes = (label_max + 1) if label_max is not None and label_max >= 0 else 0
    return DatasetInfo(
        path=path,
        files=files,
        num_rows=num_rows,
        num_bytes=sum(o.size for o in objects),
        feature_dim=0 if 0 in widths else sum(widths),
        num_classes=num_classes,
        schema=first_schema,
        sample=sample,
        storage=storage,
        objects=objects,
        file_rows=file_rows,
    )


def _check_footers(storage: Storage, files: list[str], footers: list[pq.FileMetaData],
                   columns: list[str], label: str | None) -> tuple[pa.Schema, int, int | None]:
    """Every shard has the configured columns, with the first shard's types: (its schema, the rows
    in all, the largest integer label the footers' statistics show, None when some shard has none,
    -1 before any)."""
    first_schema: pa.Schema | None = None
    num_rows = 0
    label_max: int | None = -1
    for file, meta in zip(files, footers, strict=True):
        file = storage.uri_of(file)
        schema = meta.schema.to_arrow_schema()
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DataError(
                f"column(s) {missing} not found in {file} (it has {schema.names}): "
                "fix data.features / data.label"
            )
        if first_schema is None:
            first_schema = schema
        for name in columns:
            if not schema.field(name).type.equals(first_schema.field(name).type):
                raise DataError(
                    f"schema mismatch in {file}: column '{name}' is "
                    f"{schema.field(name).type} but {storage.uri_of(files[0])} has "
                    f"{first_schema.field(name).type}; rewrite the shards with one schema"
                )
        num_rows += meta.num_rows
        if label is not None and label_max is not None and meta.num_rows and pa.types.is_integer(
                schema.field(label).type):
            file_max = _label_max(meta, schema.get_field_index(label))
            label_max = None if file_max is None else max(label_max, file_max)
    assert first_schema is not None  # list_parquet_files never returns an empty list
    return first_schema, num_rows, label_max


def _token_info(path: str, files: list[str], objects: list[ObjectInfo],
                footers: list[pq.FileMetaData], schema: pa.Schema, column: str, storage: Storage,
                sample: pa.Table | None) -> DatasetInfo:
    """Token sequences: a fixed-size list of integers per row; the vocabulary size comes from the
    schema metadata that `orchestrator prepare text` writes (else model.num_classes must say it)."""
    field = schema.field(column)
    if not (pa.types.is_fixed_size_list(field.type) and pa.types.is_integer(field.type.value_type)):
        raise DataError(f"token column '{column}' in {storage.uri_of(files[0])} has "
                        f"type {field.type}: next-token prediction (data.label=null) "
                        "needs a fixed-size list of integer token ids")
    vocab = int((schema.metadata or {}).get(b"vocab_size", b"0"))
    return DatasetInfo(
        path=path, files=files, num_rows=sum(m.num_rows for m in footers),
        num_bytes=sum(o.size for o in objects), feature_dim=field.type.list_size,
        num_classes=vocab, schema=schema, sample=sample, storage=storage, objects=objects,
        file_rows=[m.num_rows for m in footers],
    )
