"""Error types a user can act on.

`UserError` and its subclasses carry one line that names the file, key, line or value at
fault and what is allowed; the CLI prints it and exits with code 2, never with a traceback.
Anything else that escapes is a bug in lmforge and keeps its traceback.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A problem with the user's input (file, config, argument); exit code 2."""

    exit_code = USER_ERROR_EXIT_CODE


class ConfigError(UserError):
    """A config key or value that is unknown or invalid."""


class ModelFormatError(UserError):
    """A path that is not a model lmforge can read, or whose files disagree."""


class DataError(UserError):
    """A malformed data row or file; the message names `file:line`."""


class HubError(UserError):
    """The Hugging Face hub cannot be reached or refused the request."""
