"""The one exception type that reaches the user as a one-line message with exit code 2."""


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix.

    The CLI prints ``Error: <message>`` and exits with status 2; nothing is written.
    """
