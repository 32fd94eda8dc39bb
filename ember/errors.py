"""User-facing errors.

Every failure a user can fix (a bad config key, a missing file, a corrupt shard)
raises an ``EmberError`` whose message says what went wrong, where, and how to
fix it. The CLI prints the message in one or two lines and exits with code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class EmberError(Exception):
    """A problem with the user's input or environment, explained in the message."""

    exit_code = 2


class ConfigError(EmberError):
    """An unknown key, a wrong type or an invalid value in a config."""


class DataError(EmberError):
    """A missing source, an empty corpus, a malformed record or a corrupt shard."""
