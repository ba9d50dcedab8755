"""One exception type for every problem the user can fix (bad input, bad config).

The CLI prints these as a single ``error: ...`` line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input: the message names the file, key or value at fault."""
