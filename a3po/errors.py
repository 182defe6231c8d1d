# The exit status of every entry point (experiments/train.py, the tools) on a ConfigError.
EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A bad config value: the message names the key, the value and what is allowed."""


def composition_error(error: Exception, overrides) -> ConfigError:
    """Hydra's or OmegaConf's error when overrides do not compose, as a ConfigError on one line
    (it names the key, or the group and its options), without Hydra's config search path."""
    text = " ".join(str(error).split()).split(" Config search path:")[0]
    return ConfigError(f"the overrides {list(overrides)} do not compose: {text}")
