"""The one exception a user should ever see: a one-line message naming the key or file at fault."""


class LowbitError(Exception):
    """A user error (bad config, bad data, bad path). The CLI prints it on one line and exits with status 2."""
