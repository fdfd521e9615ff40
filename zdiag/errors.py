"""Errors that reach the user as one sentence on stderr, never as a traceback.

Raise `UserError` for anything the user can fix (a missing file, a bad option value, a corrupt
trace). The message says what is wrong and what to do, in one sentence. The CLI prints it as
`zdiag <command>: error: <message>` and exits with `exit_code`.
"""


class UserError(Exception):
    """A mistake the user can fix; the message is shown as-is, without a traceback."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class InputError(UserError):
    """An input file or folder is missing, unreadable, corrupt or of the wrong format."""


class ConfigError(UserError):
    """An option or configuration value is invalid; the message names the option."""
