"""a3po.schema: the typed schemas of the fixed config groups hold the groups' YAML defaults,
and a value of the wrong type or range, or a key a group does not have, fails at start with
the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.schema import (AsyncRuntime, LaggedRuntime, LoggerConfig, RolloutConfig, TrainConfig, VLLMRolloutConfig,
                         check_group, schema_defaults)
from conftest import CONF_DIR

# (the YAML, the key in it or None for the whole file, its schema, whether its values are the schema's defaults)
GROUPS = [
    (CONF_DIR / "config.yaml", "train", TrainConfig, True),
    (CONF_DIR / "rollout" / "hf.yaml", None, RolloutConfig, True),
    (CONF_DIR / "rollout" / "vllm.yaml", None, VLLMRolloutConfig, True),
    (CONF_DIR / "runtime" / "lagged.yaml", None, LaggedRuntime, True),
    (CONF_DIR / "runtime" / "async.yaml", None, AsyncRuntime, True),
    (CONF_DIR / "logger" / "wandb_offline.yaml", None, LoggerConfig, True),
    (CONF_DIR / "logger" / "wandb_online.yaml", None, LoggerConfig, False),
    (CONF_DIR / "logger" / "none.yaml", None, LoggerConfig, False),
]


@pytest.mark.parametrize("path, key, schema, defaults", GROUPS, ids=lambda g: getattr(g, "__name__", str(g)))
def test_each_yaml_group_is_its_schema(path, key, schema, defaults):
    node = OmegaConf.load(path)
    group = OmegaConf.to_container(node[key] if key else node, resolve=False)
    fields = schema_defaults(schema)
    assert set(group) <= set(fields), f"{path}: keys without a schema field: {sorted(set(group) - set(fields))}"
    # a field the YAML leaves out is optional: null unless set
    assert all(fields[name] is None for name in set(fields) - set(group)), sorted(set(fields) - set(group))
    if defaults:
        assert group == {name: fields[name] for name in group}
    resolved = {k: (0 if isinstance(v, str) and v.startswith("${") else v) for k, v in group.items()}
    check_group(resolved, schema, "group")  # the shipped values pass their own schema


@pytest.mark.parametrize("group, message", [
    ({"lr": "abc"}, "train.lr='abc' is not allowed; it must be > 0"),
    ({"lr": 0}, "train.lr=0 is not allowed; it must be > 0"),
    ({"total_steps": 2.5}, "train.total_steps=2.5 is not allowed; it must be an integer >= 1"),
    ({"warmup": "yes"}, "train.warmup='yes' is not allowed; it must be true or false"),
    ({"n_prompts": True}, "train.n_prompts=True is not allowed; it must be an integer >= 1"),
    ({"adam_betas": [0.9, 1.0]}, "train.adam_betas=[0.9, 1.0] is not allowed; it must be two numbers in [0, 1)"),
    ({"collapse_steps": 0}, "train.collapse_steps=0 is not allowed; it must be an integer >= 1 (consecutive steps), "
                            "or null for 3"),
    ({"lrr": 1e-5}, "train.lrr is not a key of train; its keys: ['activation_checkpointing', 'adam_betas',"),
])
def test_a_bad_train_value_names_the_key_the_value_and_what_is_allowed(group, message):
    with pytest.raises(ConfigError) as err:
        check_group(group, TrainConfig, "train")
    assert str(err.value).startswith(message)


def test_null_passes_only_where_a_field_is_optional_and_ints_are_floats():
    check_group({"max_steps_this_run": None, "collapse_entropy": None, "lr": 1}, TrainConfig, "train")
    with pytest.raises(ConfigError, match="train.lr=None is not allowed"):
        check_group({"lr": None}, TrainConfig, "train")
    check_group({"device": "cuda:3"}, RolloutConfig, "rollout")
    with pytest.raises(ConfigError, match="rollout.device='gpu0' is not allowed; allowed: null"):
        check_group({"device": "gpu0"}, RolloutConfig, "rollout")
    with pytest.raises(ConfigError, match="rollout.batch_size is not a key of rollout"):
        check_group({"batch_size": 4}, VLLMRolloutConfig, "rollout")  # the HF engine's key only


def test_an_experiment_may_set_another_engines_keys_but_a_typo_still_fails(tiny_cfg):
    from a3po.config import parse_config

    parse_config(tiny_cfg("rollout=hf", "+rollout.dtype=bfloat16"))  # paper_gsm8k's vLLM key under rollout=hf
    with pytest.raises(ConfigError, match="rollout.temprature is not a key of rollout"):
        parse_config(tiny_cfg("+rollout.temprature=0.7"))


def test_every_schema_field_is_typed_and_says_what_is_allowed():
    for schema in (TrainConfig, RolloutConfig, VLLMRolloutConfig, LaggedRuntime, AsyncRuntime, LoggerConfig):
        hints = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            assert hints[field.name] is not typing.Any and field.metadata["allowed"], (schema.__name__, field.name)


def test_a_bad_group_value_fails_at_start_through_the_cli(tiny_cfg):
    from a3po.config import parse_config

    with pytest.raises(ConfigError, match="rollout.top_p=1.5 is not allowed; it must be in \\(0, 1\\]"):
        parse_config(tiny_cfg("rollout.top_p=1.5"))
    with pytest.raises(ConfigError, match="runtime.interruptible='maybe' is not allowed; it must be true or false"):
        parse_config(tiny_cfg("runtime=async", "runtime.interruptible=maybe"))
    with pytest.raises(ConfigError, match="logger.mode='loud' is not allowed; allowed:"):
        parse_config(tiny_cfg("logger.mode=loud"))


def test_a_misspelt_top_level_key_fails_naming_it_and_the_keys_there(tiny_cfg):
    from a3po.config import parse_config

    with pytest.raises(ConfigError, match=r"stalness=4 is not allowed; it is not a key of the config; "
                                          r"the top-level keys are \[.*'staleness'"):
        parse_config(tiny_cfg("+stalness=4"))


def test_every_shipped_experiment_and_variant_composes_to_known_top_level_keys(tiny_cfg):
    from a3po.config import TOP_LEVEL_KEYS

    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        assert set(tiny_cfg(f"experiment={path.stem}")) <= TOP_LEVEL_KEYS, path.name
    for path in sorted((CONF_DIR / "variant").glob("*.yaml")):
        assert set(tiny_cfg(f"+variant={path.stem}")) <= TOP_LEVEL_KEYS, path.name


def test_a_misspelt_experiment_fails_at_composition_naming_the_ones_there(tiny_cfg):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"Could not find 'experiment/s6_stres'(.|\n)*s6_stress"):
        tiny_cfg("experiment=s6_stres")


def test_an_unknown_logged_schedule_names_the_key_that_chose_it(tiny_cfg):
    from a3po.config import parse_config

    with pytest.raises(ConfigError, match=r"train.prox_error_schedules.foo: schedule='foo' is not allowed; allowed: \["):
        parse_config(tiny_cfg("train.log_prox_errors=true", "+train.prox_error_schedules.foo={}"))
    with pytest.raises(ConfigError, match=r"^schedule='nope' is not allowed"):
        parse_config(tiny_cfg("schedule.name=nope"))
