# The exit status of every entry point (experiments/train.py, the tools) on a ConfigError.
EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A bad config value: the message names the key, the value and what is allowed."""
