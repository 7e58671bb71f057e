"""Building the Ray Datasets that Ray Train splits across workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.config import DataConfig
from pipelines.sources import DatasetInfo, inspect_parquet

if TYPE_CHECKING:
    import ray.data


def inspect_datasets(cfg: DataConfig) -> dict[str, DatasetInfo]:
    """Check the train (and val) shards before Ray starts; raises `DataError` naming the problem."""
    infos = {"train": inspect_parquet(cfg.train, cfg.features, cfg.label)}
    if cfg.val is not None:
        infos["val"] = inspect_parquet(cfg.val, cfg.features, cfg.label)
    return infos


# `cache: auto` keeps a dataset in memory when its files use less than this share of the object store.
AUTO_CACHE_SHARE = 0.05


def use_memory_cache(cfg: DataConfig, infos: dict[str, DatasetInfo], object_store_bytes: float) -> bool:
    if cfg.cache != "auto":
        return cfg.cache == "memory"
    return sum(info.num_bytes for info in infos.values()) < AUTO_CACHE_SHARE * object_store_bytes


def build_datasets(
    cfg: DataConfig, infos: dict[str, DatasetInfo], object_store_bytes: float
) -> dict[str, ray.data.Dataset]:
    """Parquet readers over the already-checked files. Streaming (nothing read until a worker iterates) unless
    the memory cache applies: then blocks are decoded once into the object store (never into the driver)."""
    import ray.data

    columns = [*cfg.features, cfg.label]
    datasets = {name: ray.data.read_parquet(info.files, columns=columns) for name, info in infos.items()}
    if use_memory_cache(cfg, infos, object_store_bytes):
        datasets = {name: ds.materialize() for name, ds in datasets.items()}
    return datasets
