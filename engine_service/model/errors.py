"""The one exception of checkpoint loading."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served: the message names the file, tensor or field and
    the value. A ValueError, so the engine's start-up turns it into a non-zero exit."""
