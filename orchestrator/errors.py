"""Errors that reach the user as one clear line (the CLI prints them and exits non-zero)."""


class UserError(Exception):
    """Something the user can fix: the message names the thing and the fix."""


class ConfigError(UserError):
    """An invalid, unknown or contradictory configuration value."""
