class ConfigError(ValueError):
    """A bad config value: the message names the key, the value and what is allowed."""
