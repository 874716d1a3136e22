"""tandem's exception types: each names what went wrong and how to fix it."""


class TandemError(Exception):
    """Base of tandem's own errors."""


class CaptureError(TandemError):
    """A training step could not be captured as a graph."""


class BatchMismatchError(TandemError, ValueError):
    """A batch does not match the shapes/dtypes the step was captured with."""


class PassError(TandemError):
    """A graph pass failed or produced an invalid graph."""
