"""`LLM`: offline batch generation over the engine (vLLM's `LLM.generate` and `LLM.chat` shapes)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import numbers
import os
import signal
import threading
from typing import Callable, Optional, Sequence, Union

import numpy as np

from k3jax.runtime import Model, load_model
from serve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from serve import generation_config
from serve.chat import chat_ids
from serve.data_parallel import DataParallelEngine, load_options
from serve.engine import Engine, EngineConfig
from serve.lora import LoRARequest
from serve.profiler import Profiler, ProfilerError
from serve.tools import plan_tools
from serve.types import RequestOutput, RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], dict]  # vLLM's prompt dicts: {"prompt": str} or {"prompt_token_ids": [...]}
# (each with an optional "cache_salt")


def prompt_cache_salt(prompt, cache_salt: Optional[str]) -> tuple:
    """vLLM's prompt dicts may carry their own `cache_salt` (`{"prompt": ..., "cache_salt": "a"}`, the only
    way vLLM's `LLM.generate` salts a prompt) -> (the prompt without it, the salt it runs with: its own, else
    `generate`'s `cache_salt`)."""
    if not isinstance(prompt, dict) or "cache_salt" not in prompt:
        return prompt, cache_salt
    salt = prompt["cache_salt"]
    if cache_salt is not None and salt != cache_salt:
        raise ValueError(f"cache_salt: the prompt dict's {salt!r} differs from generate's cache_salt={cache_salt!r}")
    return {k: v for k, v in prompt.items() if k != "cache_salt"}, salt


def params_per_prompt(sampling_params, count: int, defaults: Callable[[], SamplingParams]) -> list:
    """`generate`'s `sampling_params` (one for every prompt, or a list with one per prompt; None, or a None
    in the list: the model's defaults) -> one per prompt; what is neither raises naming the entry."""
    if sampling_params is None or isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
        sampling_params = [sampling_params] * count
    elif not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params: expected SamplingParams, BeamSearchParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
    for i, sp in enumerate(sampling_params):
        if sp is not None and not isinstance(sp, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"sampling_params[{i}]: expected SamplingParams or BeamSearchParams, got "
                            f"{type(sp).__name__}")
    default = defaults() if any(sp is None for sp in sampling_params) else None
    return [default if sp is None else sp for sp in sampling_params]


def vllm_no_ops(enforce_eager, swap_space, disable_log_stats=True) -> list[str]:
    """vLLM's `LLM(enforce_eager=..., swap_space=..., disable_log_stats=...)`, taken for a vLLM script's sake as
    `k3jax serve` takes `--enforce-eager` / `--swap-space` (serve/cli.py `vllm_notes`) -> a note for each given
    that asks for something not done here; a `swap_space` that is no size raises naming it.
    `disable_log_stats=True` is vLLM's LLM default and what this LLM does: no note."""
    if swap_space is not None and (isinstance(swap_space, bool) or not isinstance(swap_space, numbers.Real)
                                   or not 0 <= swap_space < math.inf):
        raise ValueError(f"swap_space: expected GiB >= 0, got {swap_space!r}")
    notes = []
    if enforce_eager:
        notes.append("enforce_eager=True: accepted, changes nothing: every step program is compiled by XLA before "
                     "serving (no eager mode, no CUDA graphs); fewer buckets start faster")
    if swap_space is not None:
        notes.append(f"swap_space={swap_space:g}: accepted, changes nothing: preempted requests are recomputed (as "
                     f"in vLLM V1); host memory for cached pages is host_cache_bytes")
    if not disable_log_stats:
        notes.append("disable_log_stats=False: accepted, changes nothing: the offline LLM prints no statistics "
                     "lines (read llm.engine.stats(); `k3jax serve` prints them)")
    return notes


def cache_options(engine_options: dict, kv_cache_memory_bytes: Optional[int]) -> tuple[dict, list[str]]:
    """vLLM's `LLM(kv_cache_memory_bytes=...)` as `cache_bytes`; an explicit size (either, or
    `num_gpu_blocks_override`) beside `gpu_memory_utilization` wins, as vLLM's `kv_cache_memory_bytes` ignores the
    fraction (as `k3jax serve` does for its flags) -> (the engine options, a note when the fraction is dropped)."""
    opts = dict(engine_options)
    if kv_cache_memory_bytes is not None:
        if (isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, numbers.Integral)
                or kv_cache_memory_bytes < 1):  # (named as given: the engine would name its cache_bytes)
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes!r}: expected an integer >= 1 (bytes)")
        if "cache_bytes" in opts:
            raise ValueError("kv_cache_memory_bytes and cache_bytes set the same budget: give one")
        opts["cache_bytes"] = kv_cache_memory_bytes
    if (opts.get("gpu_memory_utilization") is None or opts.get("cache_bytes") is None
            or opts.get("num_gpu_blocks_override") is not None):  # (that override: the engine says it wins)
        return opts, []
    note = (f"gpu_memory_utilization={opts['gpu_memory_utilization']}: ignored, "
            f"{'kv_cache_memory_bytes' if kv_cache_memory_bytes is not None else 'cache_bytes'} sets the cache's size "
            f"(as vLLM's kv_cache_memory_bytes ignores it)")
    return {**opts, "gpu_memory_utilization": None}, [note]


@contextlib.contextmanager
def interrupts_between_steps():
    """Hold back Ctrl-C (SIGINT) while the engine is called -> `check()`, which raises the KeyboardInterrupt held
    back; call it between engine calls. Python raises KeyboardInterrupt at whatever line runs, and a line of the
    engine's bookkeeping cut in half (a slot freed, its pages not yet) leaked cache memory for good; held back,
    the interrupt comes out where the engine is consistent and `generate` withdraws its requests. A second
    Ctrl-C raises at once (a step that never returns). Only in the main thread, under Python's own handler
    (a notebook's, too); a handler of the caller's is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    held = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    def check():
        if held:
            held.clear()
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    check()


class LLM:
    """`LLM(model_or_path, **engine_options)`; options are `EngineConfig` fields (`seed`, as vLLM's, seeds the
    sampling of requests without a seed of their own, and a preset's random weights) plus `dtype` when a path or
    preset is given (vLLM's default "auto": the checkpoint's `torch_dtype`; float32 for presets), and
    `data_parallel_size`: that many replicas of the engine, each on its own devices (`len(jax.devices()) / N` of
    them under a `sharding` config, one without), with
    prompts routed by cached prefix and load (`data_parallel_routing="cache_aware"`) or by load alone
    (`"load"`; serve/data_parallel.py). vLLM's `enforce_eager` and `swap_space` are accepted and change nothing
    (a logged note says so, as `k3jax serve` does for its flags); its `kv_cache_memory_bytes` is `cache_bytes`, and
    an explicit cache size wins over `gpu_memory_utilization` (`cache_options`).

    On a mesh over several processes (`k3jax.initialize_distributed`, then `sharding=...`), every
    process builds the same `LLM`; process 0 calls `generate` and finally `close()`, the others call
    `follow()`, which returns when process 0 closes."""

    progress: bool = True  # progress bars (warm-up, and `use_tqdm`'s default)
    _request_ids = itertools.count()  # request ids, numbered as vLLM's LLM numbers them (unique in the process)
    _caller: Optional[int] = None  # the thread in `generate`

    def __init__(self, model: Union[Model, str] = "tiny-k3", *, dtype: str = "auto", seed: int = 0,
                 progress: bool = True, data_parallel_size: int = 1, data_parallel_routing: str = "cache_aware",
                 enforce_eager: bool = False, swap_space: Optional[float] = None, disable_log_stats: bool = True,
                 kv_cache_memory_bytes: Optional[int] = None, **engine_options):
        engine_options, notes = cache_options(engine_options, kv_cache_memory_bytes)
        for note in vllm_no_ops(enforce_eager, swap_space, disable_log_stats) + notes:
            log.warning(note)
        # vLLM's `seed` seeds sampling (unseeded requests' seeds are drawn from it); a preset's weights too
        config = EngineConfig(seed=seed, **engine_options)
        if not isinstance(model, Model):  # straight into the (first) engine's shards
            model = load_model(model, dtype=dtype, seed=0 if seed is None else seed,
                               **load_options(config, data_parallel_size))
        self.model = model
        self.progress = progress
        # vLLM's data_parallel_size: that many engine replicas on disjoint device groups (serve/data_parallel.py)
        self.engine = (Engine(self.model, config, progress=progress) if data_parallel_size == 1
                       else DataParallelEngine.build(self.model, config, data_parallel_size, progress=progress,
                                                     routing=data_parallel_routing))
        if data_parallel_size == 1 and self.engine.layer_scan is not None:
            # the engine keeps the scanned layers' weights stacked only; holding the per-layer model here would
            # keep a second copy alive (its scanned layers are 0-d placeholders: run it through the engine)
            self.model = self.engine.model

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer`); None for token-id-only checkpoints."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams carrying the model's generation_config.json fields (`generation_config`
        engine option; serve/generation_config.py), what `generate` uses when given none."""
        return generation_config.default_params(self.engine.generation_defaults)

    def generate(self, prompts: Union[Prompt, list[Prompt]],
                 sampling_params: Union[SamplingParams, BeamSearchParams, list, None] = None,
                 priority: Optional[list[int]] = None, cache_salt: Optional[str] = None,
                 lora_request=None, *, use_tqdm: Union[bool, Callable, None] = None) -> list[RequestOutput]:
        """Run the prompts to completion; `priority` (one per prompt, lower first) orders the queue;
        `cache_salt`: only requests with the same salt share cached prefixes (a prompt dict's own
        `"cache_salt"`, vLLM's, for that prompt); `lora_request`: a LoRA
        adapter (a loaded adapter's name or a `LoRARequest`, loaded on first use) for every prompt, or
        a list with one per prompt (None: the base model). Without `sampling_params` (or for a None in
        its list), the model's defaults (`get_default_sampling_params`). Token ids may come as arrays
        (NumPy, JAX, torch: `[L]` one prompt, `[B, L]` a batch). `use_tqdm` (vLLM's): a progress bar over finished
        prompts (True, or a tqdm-like factory; default: the `progress` the LLM was built with)."""
        if not isinstance(prompts, (str, dict, list, tuple)) and hasattr(prompts, "__array__"):
            prompts = np.asarray(prompts)  # (a JAX or torch array of ids)
        if isinstance(prompts, np.ndarray):  # one prompt's ids ([L]) or a batch of them ([B, L])
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        sampling_params = params_per_prompt(sampling_params, len(prompts), self.get_default_sampling_params)
        priority = priority if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # only each request's final output is read: the engine builds no output before it (vLLM does the same)
        final = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                 for sp in sampling_params if isinstance(sp, SamplingParams)}
        sampling_params = [final.get(id(sp), sp) for sp in sampling_params]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        with self._one_call_at_a_time(), interrupts_between_steps() as check_interrupt:
            return self._run(prompts, sampling_params, priority, loras, cache_salt, use_tqdm, check_interrupt)

    @contextlib.contextmanager
    def _one_call_at_a_time(self):
        """Calls of `generate` from several threads run one after another: two stepping the engine at once
        corrupted it (donated buffers used twice, KeyErrors) and both failed. One made from inside another
        (a progress-bar callback) would wait forever, and so does an `AsyncEngine` stepping this engine: both
        raise instead."""
        from serve.async_engine import running_driver

        if self._caller == threading.get_ident():
            raise RuntimeError("generate: called from inside a generate call of this LLM (a use_tqdm callback?)")
        replicas = getattr(self.engine, "replicas", None)
        driven = [i for i, e in enumerate(replicas or [self.engine]) if running_driver(e) is not None]
        if driven:  # (with data-parallel replicas the AsyncEngine steps one of them: named so, its handle is there)
            where = "llm.engine" if replicas is None else f"llm.engine.replicas[{driven[0]}]"
            raise RuntimeError(f"generate: an AsyncEngine's thread steps this LLM's engine; shut it down first "
                               f"(serve.async_engine.running_driver({where}).shutdown()) or generate through it")
        with self.__dict__.setdefault("_generating", threading.Lock()):
            self._caller = threading.get_ident()
            try:
                yield
            finally:
                self._caller = None

    def _run(self, prompts, sampling_params, priority, loras, cache_salt, use_tqdm, check_interrupt) -> list:
        """`generate`'s requests queued and stepped to completion -> their final outputs, in order; on any error
        or interrupt every request of the call is withdrawn and the engine left empty and usable."""
        ids: list[str] = []
        adding = None  # the id being queued: ours before the engine sees it (a Ctrl-C inside add_request withdraws it)
        try:
            for p, sp, pr, lr in zip(prompts, sampling_params, priority, loras):
                p, salt = prompt_cache_salt(p, cache_salt)
                adding = str(next(self._request_ids))
                self.engine.add_request(p, sp, adding, priority=pr, cache_salt=salt, lora_request=lr)
                ids.append(adding)
                adding = None
                check_interrupt()
        except BaseException as e:  # a rejected prompt or Ctrl-C: the ones already queued are withdrawn, nothing runs
            # (a rejected one was never queued: its id may be someone else's request)
            for rid in ids + ([adding] if adding is not None and not isinstance(e, Exception) else []):
                self.engine.abort(rid)
            self.engine._reap()
            raise
        done: dict[str, RequestOutput] = {}
        mine = set(ids)  # (the engine may hold requests added outside this call: their outputs are not ours)
        bar = self._progress_bar(use_tqdm, len(ids))
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                check_interrupt()
        except BaseException:  # a failed step or Ctrl-C: withdraw the rest, leave the engine empty and usable
            for rid in ids:
                self.engine.abort(rid)
            self.engine._reap()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def _progress_bar(self, use_tqdm, total: int):
        if use_tqdm is None:
            use_tqdm = self.progress
        if not use_tqdm or total == 0:
            return None
        if callable(use_tqdm):
            return use_tqdm(total=total, desc="Processed prompts")
        from tqdm.auto import tqdm
        return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def beam_search(self, prompts: Union[Prompt, list[Prompt]], params: BeamSearchParams,
                    lora_request=None, use_tqdm: Union[bool, Callable, None] = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best hypotheses, best first. The
        beams run in the engine next to each other and any other request, forking their cache state
        (serve/beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        outs = self.generate(prompts, params, lora_request=lora_request, use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, list(c.logprobs),
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason)
                                  for c in o.outputs]) for o in outs]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, list[SamplingParams], None] = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None,
             continue_final_message: bool = False, use_tqdm: Union[bool, Callable, None] = None,
             lora_request=None, tools: Optional[list[dict]] = None) -> list[RequestOutput]:
        """Generate the assistant's turn of one conversation (a list of OpenAI-style messages) or of
        several; the model family's chat format renders them (serve/chat.py). Texts are raw (K3's
        think / response channels included; `serve.reasoning.split_reasoning` splits them). With
        `continue_final_message` (and `add_generation_prompt=False`) a final assistant message is
        continued instead (a prefilled answer start). `lora_request`: as `generate`'s. `tools` (vLLM's):
        OpenAI function tools rendered into the prompt as the HTTP API renders them with tool_choice
        "auto"; the answer stays raw text (calls unparsed, nothing forced)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        family = getattr(tok, "chat_family", None) or {"kimi_k3": "k3", "kimi_linear": "kimi_linear"}.get(
            self.engine.cfg.family, "byte")
        plan = plan_tools(tools, None, None)
        prompts = [chat_ids(tok, family, conv, add_generation_prompt, chat_template_kwargs, tools=plan,
                            continue_final_message=continue_final_message) for conv in convs]
        return self.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a PEFT adapter directory into a free slot (needs `max_loras >= 1`); no compile."""
        self.engine.add_lora(lora_request)
        return True

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict) -> bool:
        """An adapter from tensors in memory and its PEFT config (SGLang's; see `Engine`): no disk, no compile."""
        self.engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict)
        return True

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter (not while requests use it)."""
        self.engine.remove_lora(name)
        return True

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def update_weights(self, model: Union[Model, str], *, dtype: Optional[str] = None, seed: int = 0) -> None:
        """Swap in new weights of the same model (a `Model`, a checkpoint directory or a preset, loaded in
        `dtype`, default the engine's): the compiled programs are reused, the prefix cache is cleared (see
        `Engine.update_weights`). A directory goes to `Engine.update_weights_from_disk` (on a multi-process
        mesh every process loads it)."""
        if isinstance(model, str) and os.path.isdir(model) and hasattr(self.engine, "update_weights_from_disk"):
            self.engine.update_weights_from_disk(model)
            self.model = self.engine.model
            return
        if not isinstance(model, Model):
            where = self.engine.load_options() if hasattr(self.engine, "load_options") else {}
            model = load_model(model, dtype=dtype or self.engine.model.dtype, seed=seed, **where)
        self.engine.update_weights(model)
        self.model = model

    def get_weights_by_name(self, name: str, truncate_size: Optional[int] = 100):
        """A checkpoint tensor as the engine serves it now, its first `truncate_size` rows (SGLang's; see
        `Engine.get_weights_by_name`); with data-parallel replicas, a list with each replica's."""
        return self.engine.get_weights_by_name(name, truncate_size)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        """Write some weights, given as (checkpoint name, tensor) pairs (SGLang's; see
        `Engine.update_weights_from_tensor`): the others stay, no compile."""
        self.engine.update_weights_from_tensor(named_tensors, flush_cache)
        self.model = self.engine.model  # (the caller's Model no longer holds these weights)

    def sleep(self, level: int = 1, tags: Optional[list[str]] = None) -> None:
        """Release the device memory of the weights and the cache (vLLM's sleep mode; see `Engine.sleep`):
        level 1 keeps the weights in host memory, level 2 discards them (`update_weights` loads new ones);
        `tags` ("weights", "kv_cache"; default both) releases only those."""
        self.engine.sleep(level, tags)
        if self.engine.model.params is None:
            self.model = None  # the engine's host copy (level 1) is the only one left

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take back the weights and / or the cache (`tags`: "weights", "kv_cache"; default both)."""
        self.engine.wake_up(tags)
        self.model = self.engine.model

    @property
    def is_sleeping(self) -> bool:
        """As the engine says (a level-2 sleep stays asleep after `wake_up` until new weights are loaded)."""
        return any(e.is_sleeping for e in getattr(self.engine, "replicas", [self.engine]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (both tiers) -> True when the cache is empty (see Engine)."""
        return self.engine.reset_prefix_cache()

    def start_profile(self, log_dir: Optional[str] = None) -> str:
        """vLLM's: start a `jax.profiler` trace of what runs until `stop_profile` (each engine step annotated
        `k3jax.step` with its bucket) into `log_dir`, else $K3JAX_PROFILER_DIR -> that directory
        (serve/profiler.py). A refused start (one already recording) keeps the recording's handle, so
        `stop_profile` still ends it."""
        profiler = Profiler(log_dir)
        started = profiler.start()
        self._profiler = profiler
        return started

    def stop_profile(self) -> dict:
        """Stop the trace -> {"dir": the run directory written (TensorBoard / XProf; a Perfetto
        `*.trace.json.gz` beside), "seconds"}."""
        profiler = getattr(self, "_profiler", None)
        if profiler is None:
            raise ProfilerError("stop_profile: no profile is being recorded")
        self._profiler = None
        return profiler.stop()

    def follow(self) -> int:
        """Processes 1.. of a multi-process mesh (serve/multihost.py): run process 0's steps until it
        calls `close()` (or exits); -> steps run."""
        return self.engine.follow()

    def close(self) -> None:
        """Process 0 of a multi-process mesh: release the followers. A no-op on one process."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
