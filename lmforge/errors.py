"""Error types a user can act on.

`UserError` and its subclasses carry one line that names the file, key, line or value at
fault and what is allowed; the CLI prints it and exits with code 2, never with a traceback.
Anything else that escapes is a bug in lmforge and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re

USER_ERROR_EXIT_CODE = 2
# errno values of a write that failed for a reason outside lmforge: the user's to fix.
WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EBUSY, errno.EFBIG}
)


class UserError(Exception):
    """A problem with the user's input (file, config, argument); exit code 2."""

    exit_code = USER_ERROR_EXIT_CODE


class ConfigError(UserError):
    """A config key or value that is unknown or invalid."""


class StageOrderError(ConfigError):
    """A pipeline stage that names a stage that comes after it in the file; `stage`: that one
    (so that a stage whose own error was reported does not also fail all that follow it)."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class ModelFormatError(UserError):
    """A path that is not a model lmforge can read, or whose files disagree."""


class DataError(UserError):
    """A malformed data row or file; the message names `file:line`."""


class HubError(UserError):
    """The Hugging Face hub cannot be reached or refused the request."""


class OutputError(UserError):
    """An output path that cannot be written without losing something, or a write that failed
    for the user's reasons (disk full, read-only, busy, permission, quota)."""


def write_error(err: BaseException, path: object = None) -> OutputError | None:
    """A one-line `OutputError` for a write that failed for the user's reasons (disk full,
    read-only, busy, permission, quota), naming the file the error names (else `path`); None
    for any other error (a bug: it keeps its traceback). Reads `OSError`s and safetensors'
    errors, which carry the OS error only in their text ("... (os error 28)" or, in older
    releases, "IoError(Os { code: 28, ...")."""
    code, cause = getattr(err, "errno", None), getattr(err, "strerror", None)
    if type(err).__name__ == "SafetensorError":
        found = re.search(r"(?:os error |code: )(\d+)", str(err))
        code = int(found.group(1)) if found else None
        cause = os.strerror(code) if code else None
    if code not in WRITE_ERRNOS:
        return None
    where = getattr(err, "filename", None) or path
    return OutputError(f"cannot write {where}: {cause}" if where else f"cannot write: {cause}")
