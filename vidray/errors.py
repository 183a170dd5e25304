"""Exception types that separate the user's mistakes from vidray's bugs.

A `UserError` is an error in what the user gave: the job config, command-line arguments, input files, or a
checkpoint to resume from. The CLI prints it as one line, ``vidray <cmd>: error: <message>``, and exits with
status 2. Any other exception is a bug in vidray (or its dependencies): the CLI lets it propagate with its full
traceback (exit status 1), so it can be reported and fixed.

Raise a `UserError` (or a subclass) only when the message tells the user what to change; the message names the
key, argument or file, the value found and the fix.
"""

from __future__ import annotations

__all__ = ["RequestCannotBeMetError", "UserError", "UserFileNotFound"]


class UserError(ValueError):
    """An error in what the user gave (config, arguments, input files, checkpoints to resume from).

    The CLI prints it as one line ``vidray <cmd>: error: ...`` and exits 2; anything else is a bug and shows
    its traceback. Subclasses `ValueError` so callers that catch `ValueError` keep working.
    """


class UserFileNotFound(UserError, FileNotFoundError):
    """A file or folder the user named (argument, config value, metadata entry) does not exist.

    Both a `UserError` (printed as one line by the CLI) and a `FileNotFoundError` (for callers that catch that).
    """


class RequestCannotBeMetError(UserError):
    """The job asks for resources (GPUs, CPUs, memory) that the cluster neither has nor can add (its autoscaler's
    limit included). Raised before Ray reserves anything (`vidray.train.trainer.check_resources`,
    `vidray.data.fill_cache.check_encode_resources`); the message names the numbers and the keys to lower."""
