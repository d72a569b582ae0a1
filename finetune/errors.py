"""The one exception type for mistakes a user can fix."""


class UserError(Exception):
    """Bad input: a message for a person, printed without a traceback.

    The CLI turns it into one or two lines on stderr and exit code 2. Raise it
    before anything is written, so that a refused run leaves no trace.
    """
