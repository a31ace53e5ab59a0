"""The model library's one error type for bad configuration, so callers can tell a user's mistake from a bug."""


class ModelConfigError(ValueError):
    """A model or MoE config that cannot be built; the message is one sentence naming the field and the fix."""
