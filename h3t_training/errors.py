"""The driver's one error for a flag value that cannot run (imported by every resolution step)."""


class ArgumentError(Exception):
    """A flag value that cannot run; the message is one line naming the flag and the valid range."""
