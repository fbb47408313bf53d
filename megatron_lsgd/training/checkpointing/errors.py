"""The one exception type every checkpoint problem raises."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message says what differs and what to do."""
