"""The data layer: Parquet sources, batch collation, Ray Data builders and dataset writers.

Never imports `orchestrator`; the orchestrator's config embeds `DataConfig` from here.
"""

from pipelines.config import DataConfig

__all__ = ["DataConfig"]
