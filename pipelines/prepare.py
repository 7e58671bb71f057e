"""Writers for the bundled datasets: real digits images and a learnable synthetic set of any
size."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.config import S3Config
from pipelines.errors import DataError
from pipelines.storage import Storage, open_storage, storage_error


def _table(x: np.ndarray, y: np.ndarray, feature_column: str) -> pa.Table:
    # One fixed-size-list column for all features: about 2x faster to decode than one column per
    # feature.
    flat = pa.array(np.ascontiguousarray(x, dtype=np.float32).ravel())
    return pa.table({
        feature_column: pa.FixedSizeListArray.from_arrays(flat, x.shape[1]),
        "label": pa.array(y.astype(np.int64)),
    })


def write_shard(table: pa.Table, storage: Storage, path: str) -> None:
    """Write one shard so that readers see the old object or the complete new one, never half of
    it."""
    buffer = pa.BufferOutputStream()
    # Random floats barely compress and dictionary encoding inflates them, so it is off.
    pq.write_table(table, buffer, use_dictionary=False,
                   row_group_size=max(1, min(len(table), 65536)))
    data = buffer.getvalue()
    fs = storage.filesystem()
    if storage.remote:
        # The shard is fully serialised before anything is sent, so an encoding error uploads
        # nothing. S3 makes an object visible only when its PUT (or CompleteMultipartUpload, which
        # pyarrow uses for large objects) succeeds: a failed or interrupted upload leaves no object,
        # and readers never see a partial one.
        try:
            with fs.open_output_stream(path) as out:
                out.write(data)
        except OSError as exc:
            raise storage_error(exc, storage, "writing", path) from None
        return
    # Local disk has no such guarantee: write a hidden temporary file, then rename it over the
    # target.
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    os.replace(tmp, path)


def _write_split(out: Storage, split: str, x: np.ndarray, y: np.ndarray, shards: int) -> None:
    directory = out.join(split)
    out.filesystem().create_dir(directory, recursive=True)
    for i, idx in enumerate(np.array_split(np.arange(len(y)), shards)):
        write_shard(_table(x[idx], y[idx], "pixels"), out, f"{directory}/part-{i:05d}.parquet")


def _check_out(out: str, shards: int, s3: S3Config | None) -> Storage:
    if shards < 1:
        raise DataError(f"--shards must be at least 1, got {shards}")
    storage = open_storage(out, s3)
    if storage.remote:
        _check_bucket(storage)
    return storage


def _check_bucket(storage: Storage) -> None:
    """Fail before generating any data when the bucket is missing or not writable by these
    credentials."""
    bucket = storage.root.partition("/")[0]
    try:
        storage.client().head_bucket(Bucket=bucket)
    except Exception as exc:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise DataError(f"bucket '{bucket}' does not exist ({storage.uri}): create it first, "
                            "or fix the bucket name or the endpoint ($AWS_ENDPOINT_URL)") from None
        if code in ("403", "AccessDenied"):
            raise DataError(f"access denied writing {storage.uri}: grant the credentials from the "
                            "standard AWS chain write access to the bucket (not retried)") from None
        raise storage_error(exc, storage, "writing", storage.root) from None


def prepare_digits(out: str, shards: int = 4, val_fraction: float = 0.2, seed: int = 0,
                   s3: S3Config | None = None) -> dict[str, int]:
    """scikit-learn's bundled 8x8 digits (1,797 real images, no download), scaled to [0, 1], split
    train/val. `out` is a local directory or s3://bucket/prefix."""
    from sklearn.datasets import load_digits

    root = _check_out(out, shards, s3)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    _write_split(root, "train", x[train], y[train], shards)
    _write_split(root, "val", x[val], y[val], max(1, shards // 2))
    return {"train": len(train), "val": len(val)}


def _synthetic_split(
    out: Storage, split: str, rows: int, shards: int, centres: np.ndarray, seed: int, stream: int
) -> None:
    """Gaussian clusters around fixed class centres, written one shard at a time so memory stays
    bounded."""
    directory = out.join(split)
    out.filesystem().create_dir(directory, recursive=True)
    classes, features = centres.shape
    for i, size in enumerate(len(part) for part in np.array_split(np.arange(rows), shards)):
        rng = np.random.default_rng([seed, stream, i])
        y = rng.integers(0, classes, size=size)
        x = centres[y] + rng.normal(0.0, 1.0, size=(size, features)).astype(np.float32)
        write_shard(_table(x, y, "features"), out, f"{directory}/part-{i:05d}.parquet")


def prepare_synthetic(
    out: str, rows: int, shards: int, features: int = 64, classes: int = 10, val_rows: int = 0,
    seed: int = 0, s3: S3Config | None = None,
) -> dict[str, int]:
    """A learnable classification set of any size (for benchmarks and streaming tests), local or
    s3://."""
    root = _check_out(out, shards, s3)
    if rows < shards:
        raise DataError(f"--rows ({rows}) must be at least --shards ({shards})")
    # Train and val share the class centres (same task) but draw their rows from different streams.
    centres = (np.random.default_rng(seed).normal(0.0, 1.0, size=(classes, features))
               .astype(np.float32))
    _synthetic_split(root, "train", rows, shards, centres, seed, stream=0)
    if val_rows:
        _synthetic_split(root, "val", val_rows, 1, centres, seed, stream=1)
    return {"train": rows, "val": val_rows}


VOCAB_SIZE = 256  # byte-level tokens


def prepare_text(inputs: list[str], out: str, seq_len: int, shards: int = 4,
                 val_fraction: float = 0.1, s3: S3Config | None = None) -> dict[str, int]:
    """Byte-tokenise local text files into fixed-length sequences of seq_len + 1 tokens (inputs and
    next-token targets), consecutive sequences overlapping by one token so every byte transition is
    a target once. The last `val_fraction` of the sequences is the validation split."""
    if seq_len < 1:
        raise DataError(f"--seq-len must be at least 1, got {seq_len}")
    root = _check_out(out, shards, s3)
    data = bytearray()
    for name in inputs:
        try:
            with open(name, "rb") as handle:
                data += handle.read() + b"\n"
        except OSError as exc:
            raise DataError(f"cannot read text file '{name}': {exc.strerror}") from None
    tokens = np.frombuffer(bytes(data), dtype=np.uint8)
    count = (len(tokens) - 1) // seq_len
    if count < 2:
        raise DataError(f"the input has {len(tokens)} bytes, too few "
                        f"for two sequences of --seq-len {seq_len}")
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:count]
    n_val = max(1, int(round(count * val_fraction)))
    for split, rows, parts in (("train", windows[:-n_val], shards), ("val", windows[-n_val:], 1)):
        directory = root.join(split)
        root.filesystem().create_dir(directory, recursive=True)
        for i, idx in enumerate(np.array_split(np.arange(len(rows)), min(parts, len(rows)))):
            flat = pa.array(np.ascontiguousarray(rows[idx]).ravel())
            table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(flat, seq_len + 1)})
            table = table.replace_schema_metadata({"vocab_size": str(VOCAB_SIZE)})
            write_shard(table, root, f"{directory}/part-{i:05d}.parquet")
    return {"train": count - n_val, "val": n_val}


def _check_split(rows: int, val_fraction: float) -> int:
    """Validation rows for a split of `rows`; both sides must be non-empty."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    n_val = int(round(rows * val_fraction))
    if not 0 < n_val < rows:
        raise DataError(f"--val-fraction {val_fraction} of {rows} "
                        "rows leaves an empty train or val split")
    return n_val


def _write_table(out: Storage, split: str, table: pa.Table, shards: int) -> None:
    """Cut `table` into contiguous shards (slices keep the schema metadata)."""
    directory = out.join(split)
    out.filesystem().create_dir(directory, recursive=True)
    for i, idx in enumerate(np.array_split(np.arange(len(table)), min(shards, len(table)))):
        write_shard(table.slice(int(idx[0]), len(idx)), out, f"{directory}/part-{i:05d}.parquet")


def _fixed_list(x: np.ndarray) -> pa.FixedSizeListArray:
    values = pa.array(np.ascontiguousarray(x, dtype=np.float32).ravel())
    return pa.FixedSizeListArray.from_arrays(values, x.shape[1])


def prepare_diabetes(out: str, shards: int = 2, val_fraction: float = 0.2, seed: int = 0,
                     s3: S3Config | None = None) -> dict[str, int]:
    """scikit-learn's bundled diabetes regression set (442 patients, no download), shuffled and
    split train/val. Columns: all 10 scaled features; sex and a 10-way age bucket as category ids
    next to the 8 other features (for models with embedding inputs); the target standardised, its
    original mean and std in the schema metadata."""
    from sklearn.datasets import load_diabetes

    root = _check_out(out, shards, s3)
    x, y = load_diabetes(return_X_y=True)
    n_val = _check_split(len(y), val_fraction)
    # sklearn's sex column holds two scaled values: their sorted order gives the ids 0 and 1.
    sex = np.unique(x[:, 1], return_inverse=True)[1].astype(np.int64)
    # Edges at the deciles of the whole set; searchsorted(right) keeps equal ages in one bucket, ids
    # 0..9.
    deciles = np.quantile(x[:, 0], np.linspace(0.1, 0.9, 9))
    age_bucket = np.searchsorted(deciles, x[:, 0], side="right")
    mean, std = float(y.mean()), float(y.std())
    table = pa.table({
        "features": _fixed_list(x),
        "sex": pa.array(sex),
        "age_bucket": pa.array(age_bucket.astype(np.int64)),
        "dense": _fixed_list(x[:, 2:]),
        "target": pa.array(((y - mean) / std).astype(np.float32)),
    }).replace_schema_metadata({"target_mean": repr(mean), "target_std": repr(std)})
    order = np.random.default_rng(seed).permutation(len(y))
    _write_table(root, "train", table.take(order[n_val:]), shards)
    _write_table(root, "val", table.take(order[:n_val]), max(1, shards // 2))
    return {"train": len(y) - n_val, "val": n_val}


PAD_ID, CLS_ID = 0, 1  # reserved token ids in `prepare sequences`; real tokens start at 2


def _sequence_table(rng: np.random.Generator, rows: int, vocab: int, min_len: int,
                    max_len: int) -> pa.Table:
    """Rows [CLS, t1, ...] labelled 1 when token 2 occurs more often than token 3 (ties 0): a
    bag-of-tokens model can learn it exactly, but only by counting two ids among noise."""
    lengths = rng.integers(min_len, max_len + 1, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    starts = offsets[:-1]
    # the label each row leans towards, so that both labels are common
    intent = rng.random(rows) < 0.5
    leans_two = np.repeat(intent, lengths)
    tokens = rng.integers(2, vocab, size=int(offsets[-1]))
    # About a fifth of the tokens are 2 or 3, drawn 3:1 towards the row's intent: uniform noise
    # alone would make both counts mostly zero, i.e. nearly all ties and label 0.
    signal = rng.random(len(tokens)) < 0.2
    two = rng.random(len(tokens)) < np.where(leans_two, 0.75, 0.25)
    tokens = np.where(signal, np.where(two, 2, 3), tokens)
    # One guaranteed intent token per row keeps ties (which go to 0) rare, so the labels stay near
    # balanced.
    tokens[rng.integers(starts + 1, starts + lengths)] = np.where(intent, 2, 3)
    tokens[starts] = CLS_ID
    count_two = np.add.reduceat(tokens == 2, starts)
    count_three = np.add.reduceat(tokens == 3, starts)
    input_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                         pa.array(tokens.astype(np.int64)))
    label = pa.array((count_two > count_three).astype(np.int64))
    table = pa.table({"input_ids": input_ids, "label": label})
    return table.replace_schema_metadata({"vocab_size": str(vocab)})


def prepare_sequences(out: str, rows: int = 2000, vocab: int = 64,
                      lengths: tuple[int, int] = (4, 24), shards: int = 2,
                      val_fraction: float = 0.2, seed: int = 0,
                      s3: S3Config | None = None) -> dict[str, int]:
    """A learnable synthetic sequence-classification set: variable-length token lists (list<int64>,
    each starting with the [CLS]-like id 1; 0 is left for padding; each row's length drawn from
    `lengths`, (min, max) tokens) and a binary label, split train/val."""
    min_len, max_len = lengths
    if vocab < 4:
        raise DataError("--vocab must be at least 4 (ids 0 and 1 are "
                        f"reserved, 2 and 3 decide the label), got {vocab}")
    if not 2 <= min_len <= max_len:
        raise DataError("need 2 <= --min-len <= --max-len (a row is [CLS] and "
                        f"at least one token), got {min_len} and {max_len}")
    root = _check_out(out, shards, s3)
    n_val = _check_split(rows, val_fraction)
    # Separate streams per split and shard: val rows are fresh draws, and memory stays one shard's
    # worth.
    for stream, (split, count, parts) in enumerate((("train", rows - n_val, shards),
                                                    ("val", n_val, max(1, shards // 2)))):
        directory = root.join(split)
        root.filesystem().create_dir(directory, recursive=True)
        for i, part in enumerate(np.array_split(np.arange(count), min(parts, count))):
            rng = np.random.default_rng([seed, stream, i])
            table = _sequence_table(rng, len(part), vocab, min_len, max_len)
            write_shard(table, root, f"{directory}/part-{i:05d}.parquet")
    return {"train": rows - n_val, "val": n_val}
