"""Project error types. User errors carry a message naming the bad value and the valid ones."""


class RocdraftError(ValueError):
    """Base class for every error rocdraft raises about user input or configuration."""


class BackendUnavailableError(RocdraftError):
    """A registered attention backend cannot run on this machine (the message says why)."""


class UnsupportedFeatureError(RocdraftError):
    """A backend was asked for a capability it does not declare."""


class CheckpointError(RocdraftError):
    """A checkpoint directory is missing, malformed, or does not fit the model."""
