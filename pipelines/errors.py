"""Errors the data layer raises for problems the user can fix (bad path, corrupt file, wrong
column)."""


class DataError(ValueError):
    """A user-fixable data problem; the message names the thing and the fix."""


def corrupt_parquet(uri: str, exc: BaseException) -> DataError:
    """The one error for a file that is not readable Parquet (a bad footer, a truncated column
    chunk)."""
    return DataError(f"corrupt Parquet file {uri}: {exc}; rewrite or remove it")
