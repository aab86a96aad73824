"""The one base class of errors caused by user input.

Commands print these as a single line naming the bad value and the fix, and exit non-zero
without a traceback; every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the person running symattn (a config value, a path, missing files)."""


class ConfigError(UserError, ValueError):
    """A config value is out of range or names something that does not exist."""
