"""The exceptions that end a run with a message for a person instead of a traceback."""


class _Message(Exception):
    def _render_traceback_(self) -> list[str]:
        """What IPython (a Jupyter notebook) shows for it: the message, as the CLI prints it, without a traceback."""
        return [f"{type(self).__name__}: {self}"]


class UserError(_Message):
    """Bad input: a message for a person, printed without a traceback.

    The CLI turns it into one or two lines on stderr and exit code 2. Raise it
    before anything is written, so that a refused run leaves no trace.
    """


class RunStopped(_Message):
    """A run stopped on request: once training has begun, with a checkpoint saved to resume from; before it, with
    nothing written (training/loop.py StopSignals).

    exit_code: int. 130 for Ctrl-C, 143 for SIGTERM (128 + the signal), 75
        (EX_TEMPFAIL: try again later) for the time limit.
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
