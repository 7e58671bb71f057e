"""Errors the data layer raises for problems the user can fix (bad path, corrupt file, wrong column)."""


class DataError(ValueError):
    """A user-fixable data problem; the message names the thing and the fix."""
