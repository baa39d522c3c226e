"""The serving engine: owns the params, the cache arena and the compiled steps; runs the scheduler's
plans; turns sampled tokens into request outputs.

Each `step()` runs at most two device programs (a decode batch, then a prefill batch), each padded to
a bucket compiled at start-up. Host work per step is proportional to the number of requests in the
step, never to layers or tokens of context. With `async_scheduling` that work leaves the device's critical
path: a step is launched (`_launch`) before the step launched by the call before is read back (`_land`),
and a request's next input token, sampled by the step in flight, reaches the next step on the device.
Decode programs then return their logits and a sample program, launched once the step before is read back
(`_complete`), samples them: the rows' masks (structured outputs, bad words) need the token that step sampled.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import collections.abc
import dataclasses
import hashlib
import io
import functools
import itertools
import json
import logging
import math
import numbers
import operator
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from k3jax import layer_scan, lora as model_lora
from k3jax.dequantize import dequantize_experts
from k3jax.sharding import (axes_size, expert_axis, load_sharding_config, moe_exchange_bytes, put, replicated,
                            shard_model, state_axis)
from k3jax.weight_layout import transpose_dense_weights
from k3jax.layer_scan import LayerScan, split_params
from k3jax.checkpoint import read_config
from k3jax.runtime import Model, tie_head
from pallas_kernels.dispatch import resolve_backend
from pallas_kernels.mla import decode_work_follows_length
from serve.host_cache import HostCache, HostEntry, Transfers, own_rows
from serve.latent_codec import canonical as canonical_kv_cache_dtype
from serve.lora import (Adapter, LoRAError, LoRARequest, Registry, check_peft_dir, factor_leaves, parse_peft,
                        read_peft)
from serve.beam_search import BeamGroup, BeamSearchParams, Hypothesis, aborted_hypotheses, best, expand
from serve.buckets import default_buckets, program_shapes
from serve.memory import (Arena, ArenaLayout, OutOfMemory, UnitRefs, arena_summary, concurrency_note, longest_request,
                          min_units, state_dtype_name)
from serve.memory_budget import (MemoryPlan, device_memory, largest_programs, plan_cache_bytes,
                                 step_temp_bytes)
from serve.moe_timing import compile_moe_blocks, time_moe_blocks
from serve import named_weights
from serve.named_weights import WeightNameError, WeightNames, pair_expanded
from serve.multihost import (ADAPTER, ADAPTER_CHUNK, EPLB, FORGET, LORA, LORA_DROP, NAMED_READ, NAMED_WRITE, RESTORE,
                             SAMPLE, SLEEP, SPILL, TABLES, UPDATE, WAKE, HostCopy, StepChannel, bytes_payload,
                             mesh_processes, payload_bytes, payload_text, text_payload)
from serve.page_tables import PageTables
from serve.profiler import step_annotation
from serve.prefix_cache import (BRANCH, CHUNK_END, DECODE, PROMPT_END, CkptEntry, Hit, PageEntry, PrefixCache,
                                PrefixCacheConfig, PrefixHasher, prefix_salt)
from serve.position_rows import PositionRows
from serve.routed_experts import RoutesStore, SequenceRoutes, ids_dtype
from serve import generation_config, logits_processors, prompt_embeds
from serve.sampling import SamplingBatch, ban_in_bias, check_logprobs_mode
from serve.speculative import DraftGate, NgramIndex, SpeculativeConfig, SuffixIndex, SuffixProposer
from serve.series import ITERATION_TOKEN_BUCKETS, BucketCounts, Recent
from serve.scheduler import Memory, SchedulerConfig, SeqView, StepPlan, chunk_end, schedule, units_for, waiting_cut
from serve import eplb
from serve.state_split import StateSplit
from serve.step import StepBatch, StepOptions, bind_sample, bind_step
from serve.stop_checker import StopChecker
from serve.structured import (GrammarCompiler, Guide, allowed_tokens, banned_tokens, check_text, clear_bits,
                              count_allowed, fill_masks, first_line, mask_words)
from serve.types import (MAX_BAD_WORD_TOKENS, MAX_LOGIT_BIAS, CompletionOutput, Logprob, RequestError, RequestMetrics,
                         RequestOutput, RequestOutputKind, SamplingParams, TokenLogprobs, loggable)

log = logging.getLogger(__name__)

MIN_TOKENS_STOP_IDS = 32  # stop tokens a min_tokens request may ban (room in the bias rows)
BIAS_WIDTH = MAX_LOGIT_BIAS + MIN_TOKENS_STOP_IDS  # logit-bias entries per batch row
KDA_CHUNK = 64  # chunk size of the chunked KDA prefill (pallas_kernels.kda.chunk_kda default)
CANONICAL_ORDER = 1 << 50  # internal re-prefill rows sort behind every real request (until one waits: _deferred)
INTERNAL_PRIORITY = 1 << 30  # ... whatever its priority
MAX_TAILS = 64  # finished first-of-their-kind conversations remembered for _canonicalize_shared_tails
LATENCY_SAMPLES = 1 << 16  # latencies `Engine.latency` keeps of each kind (the latest)
DEFAULT_CACHE_BYTES = 256 << 20  # EngineConfig.cache_bytes when neither it nor gpu_memory_utilization is given


class EngineSleeping(RuntimeError):
    """A request reached an engine whose device memory `sleep` released (HTTP: 503)."""


class StepFailed(RuntimeError):
    """A step raised. `request_ids`: the requests that part of the step ran, now ended (aborted, their memory
    freed); every other request stays queued and runs on the next step (recomputed if the failure consumed
    the cache). `outputs`: what the step's other part produced before the failure (a decode that ran before
    a failed prefill), to be delivered like a step's return value. `own`: only those requests' own host-side work
    failed (their adapter's read, their bookkeeping) while the step ran: no sign of an engine that cannot recover
    (`AsyncEngine` counts the other failures towards DEAD_AFTER_FAILURES). `summary`: what failed, without the
    ended requests' ids, for their clients (the ids may be other clients' X-Request-Id values). `causes`: the
    error of each request that failed in its own host-side work, where it is not `cause` (several such requests in
    one step each end with their own error, not the first's); `summary_of(request_id)`: what that request's client
    is told."""

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: tuple = (), own: bool = False,
                 causes: Optional[dict] = None):
        self.summary = failure_summary(cause)
        super().__init__(f"{self.summary}; ended {len(request_ids)} request(s) it ran: {request_ids[:4]}")
        self.request_ids, self.cause, self.outputs, self.own = request_ids, cause, list(outputs), own
        self.causes: dict[str, BaseException] = dict(causes or {})

    def summary_of(self, request_id: str) -> str:
        """The summary of what ended `request_id`: its own failure's when it had one, else the step's."""
        cause = self.causes.get(request_id)
        return self.summary if cause is None or cause is self.cause else failure_summary(cause)


def failure_summary(cause: BaseException) -> str:
    """What a client whose request a failed step ended is told (no other request's id in it)."""
    return f"engine step failed ({type(cause).__name__}: {cause})"


def check_min_tokens_allowed(params: SamplingParams, eos_token_ids) -> None:
    """`min_tokens` bans the stop tokens (EOS, ignore_eos or not, and `stop_token_ids`, vLLM's
    `all_stop_token_ids`) until that many tokens are out; `allowed_token_ids` that are all stop tokens leave
    nothing to sample meanwhile (vLLM samples from an all -inf row: garbage): refused, naming both fields."""
    allowed = params.allowed_token_ids
    if params.min_tokens and allowed and set(allowed) <= set(params.stop_token_ids) | set(eos_token_ids):
        raise RequestError(f"allowed_token_ids: every allowed token is a stop token (EOS or stop_token_ids), "
                           f"which min_tokens={params.min_tokens} bans until that many tokens are out: nothing "
                           f"could be sampled; allow another token or drop min_tokens")


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # EngineConfig.kv_transfer_config["kv_role"]
# EngineConfig's on / off options (a truthy string or list would pass for True, or fail far from the option)
BOOL_OPTIONS = ("prefill_first", "enable_deterministic_inference", "enable_prefix_caching", "enable_return_routed_experts",
                "enable_return_hidden_states", "measure_moe_time", "scan_layers", "enable_eplb", "enable_prompt_embeds",
                "async_scheduling", "enable_expert_parallel")


def expert_parallel_refusal(sharding: str, rule, mesh_sizes: Optional[dict] = None, num_experts: int = 0,
                            physical: int = 0) -> Optional[str]:
    """Why `enable_expert_parallel` cannot hold under the `sharding` config (its `experts` rule `rule`) on a mesh of
    `mesh_sizes` (None: not known yet) -> the error, or None. The rule must split the routed experts by expert
    over more than one rank, and those ranks must divide the stacked experts (`physical`: with EPLB's copies),
    else the experts stay whole on every device (`k3jax.sharding.spec_for`), which is not what was asked for."""
    key = f"enable_expert_parallel: sharding={sharding!r}"
    if mesh_sizes is not None and math.prod(mesh_sizes.values()) < 2:
        return None  # one device: nothing to split (vLLM's EP size 1)
    if rule is None:
        return (f"{key} does not split the routed experts (no `experts` rule); use a config that does, e.g. 'tp', "
                f"'ep' or 'tp_ep'")
    if mesh_sizes is None:
        return None
    ranks = axes_size(rule, mesh_sizes)
    if ranks < 2:
        return f"{key} on {math.prod(mesh_sizes.values())} devices: its `experts` rule {rule!r} splits them over 1 rank"
    if physical % ranks:
        copies = f" and their copies ({physical})" if physical != num_experts else ""
        return (f"{key}: the {num_experts} routed experts{copies} do not split evenly over the {ranks} ranks of its "
                f"`experts` rule {rule!r}")
    return None


def _check_int(key: str, v, low: int, high: Optional[int] = None) -> None:
    """A ValueError naming `key` unless `v` is an integer (not a bool) in [low, high]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low or (high is not None and v > high):
        raise ValueError(f"{key}={v!r}: expected an integer " + (f">= {low}" if high is None else f"in [{low}, {high}]"))


def _check_buckets(key: str, v) -> None:
    """A ValueError naming `key` unless `v` is None or a non-empty sequence of integers >= 1."""
    if v is not None and (isinstance(v, (str, bytes)) or not isinstance(v, collections.abc.Sequence) or not v or not all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1 for b in v)):
        raise ValueError(f"{key}={v!r}: expected None or a non-empty sequence of integers >= 1")


MEMORY_TAGS = ("weights", "kv_cache")  # what sleep releases and wake_up takes back (vLLM's / SGLang's tags)


def _memory_tags(what: str, tags: Optional[list[str]]) -> frozenset:
    """`tags` as a set of `MEMORY_TAGS` (None or empty: both), else a ValueError naming the unknown ones."""
    if not tags:
        return frozenset(MEMORY_TAGS)
    bad = sorted(set(tags) - set(MEMORY_TAGS))
    if bad:
        raise ValueError(f"{what}: tags must be 'weights' and / or 'kv_cache', got {bad}")
    return frozenset(tags)


@dataclass(frozen=True)
class EngineConfig:
    # the context window (prompt + completion tokens); at most the model's max_position_embeddings (vLLM's check;
    # K3JAX_ALLOW_LONG_MAX_MODEL_LEN=1, or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, lifts it). "auto" (or vLLM's -1):
    # the longest request the arena holds, capped there (needs `cache_bytes`: under `gpu_memory_utilization` the
    # arena is sized from step programs whose widths follow max_model_len)
    max_model_len: Union[int, str] = 1024
    page_size: int = 16
    # the one budget for MLA pages and KDA state slots (vLLM's kv_cache_memory_bytes). None: sized by
    # `gpu_memory_utilization` when that is set, else DEFAULT_CACHE_BYTES (`arena_bytes`); a size given wins
    cache_bytes: Optional[int] = None
    # vLLM's gpu_memory_utilization: the fraction of each device's memory (its allocator's limit) the engine
    # may use for weights, step temporaries and cache together; the arena gets what the weights and the
    # largest step programs leave (serve/memory_budget.py). Needs a backend that reports device memory (GPU,
    # TPU). Ignored, with a start-up note, beside an explicit `cache_bytes` or `num_gpu_blocks_override`, as
    # vLLM's kv_cache_memory_bytes ignores it. None: `cache_bytes`.
    gpu_memory_utilization: Optional[float] = None
    # vLLM's num_gpu_blocks_override: the arena's units (what vLLM's cache_config_info reports as num_gpu_blocks
    # here: each an MLA page of one layer or a share of a KDA state slot), overriding the count `cache_bytes` or
    # `gpu_memory_utilization` would give (as vLLM's overrides its profiled count). None: theirs.
    num_gpu_blocks_override: Optional[int] = None
    max_num_seqs: int = 32  # requests running at once = rows of the largest decode bucket (vLLM's meaning)
    prefill_chunk: int = 64  # tokens per prefill row; KDA checkpoints align to it
    max_prefill_seqs: int = 4  # prefill rows per step
    max_num_batched_tokens: int = 512
    # Tokens of the one-row prefill program (in place of 1 x prefill_chunk). KDA's recurrence keeps a request's
    # chunks in one row, one after another, so a prompt with no other prompt to share the step would advance
    # `prefill_chunk` tokens per step however wide the prefill programs are (k3-small, a 2048-token prompt alone
    # on the 2-core CPU host, first token: 4.9 s in 32 steps of the 1 x 64 program, 4.1 s in 8 of 1 x 256; 17 s
    # -> 3.3 s where 4 x 64 is the only prefill program; benchmarks/long_prefill.py). Every one-row prefill
    # step runs in this program, and the scheduler gives its row up to this many tokens, or takes it over the
    # rows of `prefill_chunk` when it computes more prompt tokens (serve/scheduler.py). A multiple of
    # `prefill_chunk`; None: max_prefill_seqs x prefill_chunk (the widest prefill program's tokens, within the
    # token budget and max_model_len); 0 (default): off, one-row steps run the 1 x prefill_chunk program.
    # Off by default because a prompt's rows then run in one program alone and in another beside other
    # prompts, which XLA may round differently: a prefix-cache resume batched with other prompts can differ
    # from a cold prefill alone in the last bits of its logits (as with several `prefill_buckets`), where the
    # default keeps warm resumes bit-identical to cold prefills in a single-program configuration.
    long_prefill_chunk: Optional[int] = 0
    # Admission look-ahead (SGLang's --schedule-conservativeness; serve/scheduler.py): a request is
    # admitted only when the pages left cover the expected growth of those running, at a new-token
    # ratio that starts at 0.7 x this, decays to 0.1 x this over 600 steps without a preemption, and
    # goes back up after one. 0 admits whatever fits now (preempting later if decodes run short).
    schedule_conservativeness: float = 1.0
    # Prefill first (SGLang's schedule without --enable-mixed-chunk; serve/scheduler.py): a step with prompt
    # chunks to run runs only them, and the running requests decode in the steps between. More tokens per
    # second for offline batches (waves of 32 Kimi-Linear prompts on the 2-core CPU host: 8 % sooner, the
    # mixed steps' decodes being ~12 % of a wave), longer inter-token gaps while new prompts prefill. False: every
    # step decodes every running request first (vLLM's chunked-prefill policy).
    prefill_first: bool = False
    # vLLM's --scheduling-policy: "priority" (default; this engine has always honoured `priority`) orders the queue and
    # the preemption victims by each request's priority, then arrival (serve/scheduler.py); "fcfs" (vLLM's default) is
    # arrival order alone, and a request with a nonzero priority is refused naming `priority`, as vLLM refuses it.
    scheduling_policy: str = "priority"
    # Deterministic inference (SGLang's --enable-deterministic-inference, vLLM's batch invariance): a request's
    # logits are the same bits whatever else is in its batch, wherever its row sits, however its prompt's
    # chunks are scheduled, and on a prefix-cache hit (greedy and seeded sampling then repeat exactly: RL
    # rollouts match a replay). By default XLA rounds the same row differently in programs of other shapes
    # (~1e-5 in the logprobs). On the CPU reference path of one device the mode removes the two causes found
    # (tiny-k3 and k3-small): XLA:CPU hands reductions and elementwise fusions to its YNNPACK library or not by
    # the operands' shapes, so every program is compiled with dots alone going there
    # (DETERMINISTIC_XLA_CPU_OPTIONS); and a dot's rounding depends on its row count (the MLA output projection
    # at 32 rows vs 8: 5e-5 apart), so decode programs run the model over tiles of DETERMINISTIC_ROWS rows, one
    # after another (`StepOptions.row_tile`; decode buckets rounded up to whole tiles, two at least). Every
    # decode and context bucket is kept; prefill runs the largest program alone (k3-small: a prompt's chunk in
    # the 1-row and the 4-row program 5e-7 apart). Elsewhere (a mesh, the Pallas paths, scan_layers) one
    # program per kind runs, the largest. No speculative decoding (verify rows are another program) and no
    # long-prefill program.
    enable_deterministic_inference: bool = False
    decode_buckets: Optional[tuple[int, ...]] = None  # default: powers of 4 up to max_num_seqs
    prefill_buckets: Optional[tuple[int, ...]] = None  # default: (1, max_prefill_seqs)
    context_buckets: Optional[tuple[int, ...]] = None  # MLA pages per layer; default: powers of 4
    max_logprobs: int = 20  # vLLM's default (top-n computed only in steps where some row asks)
    # What logprobs (sampled, top-n and prompt) hold (vLLM's --logprobs-mode; serve/sampling.py): "raw_logprobs"
    # (log_softmax of the model's logits), "raw_logits", "processed_logprobs" (log of the distribution the token
    # was drawn from: after bias, penalties, processors, temperature, top-k/top-p/min-p; what RL importance ratios
    # need) or "processed_logits". Prompt positions are scored, never processed: log_softmax of the model's
    # logits in every mode (vLLM's).
    logprobs_mode: str = "raw_logprobs"
    seed: int = 0
    enable_prefix_caching: bool = True
    prefix_hash_unit: int = 16  # tokens per chained-hash block (<= 128)
    checkpoint_interval: int = 512  # KDA checkpoints every N prefill tokens
    decode_checkpoint_interval: int = 256  # KDA checkpoints every N decode tokens
    # Host-memory tier of the prefix cache (serve/host_cache.py; vLLM's --kv-offloading-size, in bytes):
    # pages and KDA checkpoints the arena evicts are kept in this much host RAM and restored on a hit.
    # 0: off.
    host_cache_bytes: int = 0
    # Disaggregated prefill between engines of one process (vLLM's kv_transfer_config shape):
    # {"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "store": serve.host_cache.HostCache(bytes)}.
    # The store is the host tier of every engine given it; a producer publishes each finished request's
    # prompt (pages and deepest KDA checkpoint) into it, and a consumer resumes prompts from it.
    kv_transfer_config: Optional[dict] = None
    # Rollout routing replay (vLLM's --enable-return-routed-experts; serve/routed_experts.py): a finished
    # sequence's CompletionOutput.routed_experts holds the logical expert ids every position it fed through the
    # model was routed to, [len(prompt) + len(output) - 1, MoE layers, experts per token] int32. Prefix-cache hits
    # take the ids of the positions they skip from a host store of `routed_experts_cache_bytes` (None: room for
    # every token the arena and the host tier can hold); a hit whose ids it lost is not taken.
    enable_return_routed_experts: bool = False
    routed_experts_cache_bytes: Optional[int] = None
    # Hidden states (SGLang's --enable-return-hidden-states): the step programs also return every position's
    # final hidden states after the final norm (what the LM head reads), and a request with
    # SamplingParams.return_hidden_states gets them in CompletionOutput.hidden_states once finished: float32
    # [len(prompt) + len(output) - 1, hidden_size]. Such a request computes its whole prompt (no prefix-cache
    # reuse until every position it needs is in, as with prompt_logprobs). Off by default: the programs then
    # read back no hidden states.
    enable_return_hidden_states: bool = False
    measure_moe_time: bool = True  # time the MoE blocks per step shape at warm-up (serve/moe_timing.py)
    # Start-up: the bucket programs are compiled ahead of time in this many threads (XLA compiles outside
    # the GIL; each program's first run then finds it compiled), 1: one after another at their first run.
    # None: min(programs, CPU count, 8) -- every concurrent compile holds its own working memory on the host.
    compile_threads: Optional[int] = None
    # Scan over the model's repeating layers (k3jax/layer_scan.py): the step programs hold one copy of a
    # repeated group of layers instead of one per layer, so their compile time stops growing with depth
    # (K3's 93 layers: 7 groups of 12 scanned, 21 layers unrolled; a 93-layer model's start-up on the 2-core
    # CPU host 199 s -> 52 s). The price is paid every step: the loop slices each layer's dense weights out
    # of the stacked arrays, which XLA:CPU materialises (routed experts are read by id out of the stack):
    # decode 1.18x and prefill 1.38x slower there (benchmarks/layer_scan.py). Off by default. LoRA slots and
    # EPLB's expert moves are written into the stacked weights per group; verify rows keep the scanned layers'
    # inputs as scan outputs and commit them in a second scan over the groups.
    scan_layers: bool = False
    # Decode-step KDA state handling: "in_place" rewrites each row's slot in the arena (the reference
    # recurrence, row by row); "gathered" gathers the batch's states for the batched op (the Pallas
    # decode kernel) and scatters them back; "auto" picks in_place when the kernels resolve to the
    # reference (CPU) and gathered when they resolve to Pallas.
    kda_decode: str = "auto"
    # Decode-step MLA attention: "paged" stores the token's latent in its page and runs the paged MLA
    # kernel (pallas_kernels/mla) over the arena through the page tables; "gathered" gathers each row's
    # pages into a dense copy and attends over it in jnp; "auto" picks paged when the kernels resolve to
    # Pallas (GPU/TPU) and gathered on the reference path (CPU), where XLA needs the dense copy anyway.
    mla_decode: str = "auto"
    # MLA latent cache storage (vLLM's --kv-cache-dtype; serve/latent_codec.py): "auto" keeps the model
    # dtype (bit-exact); "fp8" (or "fp8_e4m3", "fp8_ds_mla") stores the compressed 512 values as
    # float8_e4m3 with a scale per 128 and the rotary 64 in the model dtype: 656 B per token and layer
    # for a bf16 model instead of 1152, so the same budget holds 1.76x the tokens (KDA states: `kda_state_dtype`).
    # The paged MLA kernel dequantises fp8 pages in its tile (pallas_kernels/mla/fp8_latents.py).
    kv_cache_dtype: str = "auto"
    # KDA recurrent state storage (vLLM's --mamba-ssm-cache-dtype): "float32" (or "auto"; the spec's
    # dtype) or "bfloat16", which halves a state slot (K3: 414 -> 207 MiB per sequence, the part of a
    # short request's memory that dominates). A bf16 state is rounded wherever it is stored: after
    # every decode token and at every `min(prefill_chunk, 64)`-token boundary of a prefill (also inside
    # a prefill row), so outputs do not depend on how rows were cut, batched, resumed from the prefix cache or
    # preempted (a recompute runs its decoded tokens again as decode rows: `Engine._replay_total`). Conv windows
    # and all arithmetic stay fp32.
    kda_state_dtype: str = "float32"
    # Routed MXFP4 experts: "packed" keeps them packed (the Pallas grouped matmul dequantises in the
    # tile); "dequantized" expands them once at start-up (exact; to fp32 on CPU, 8x the packed bytes,
    # else to the model dtype), for backends with no fused dequantise-and-multiply; "auto" picks dequantized when the
    # kernels resolve to the reference (CPU) and packed when they resolve to Pallas.
    expert_weights: str = "auto"
    # Dense projection weights: "out_in" as checkpoints store them; "in_out" transposed once at
    # start-up (k3jax/weight_layout.py; same products, logits equal to fp32 rounding), which XLA:CPU
    # multiplies faster at decode batch sizes;
    # "auto" picks in_out when the kernels resolve to the reference (CPU) and out_in otherwise.
    dense_weights: str = "auto"
    # Device mesh: None runs on the default device; otherwise a config in sharding_configs/ (by name,
    # e.g. "tp") or a YAML path. Parameters are placed by its logical-axis rules (k3jax/sharding.py)
    # and every step is one SPMD program over the mesh. The cache arena is split by KDA heads over the
    # `heads` rule's axis when it divides them (each rank: its heads' states, every MLA page; then
    # `cache_bytes` is one rank's arena), otherwise replicated on each device.
    sharding: Optional[str] = None
    # Decode context parallelism (vLLM's --decode-context-parallel-size): 1 keeps every MLA page whole on
    # every rank (MLA has one KV head, so tensor parallelism alone replicates the latent cache); R > 1
    # also splits the pages by position over the R ranks that split the KDA heads (the `heads` rule's
    # axis; R must be its size): each rank stores every R-th token of each page and attends over its
    # share, the partial softmaxes combined across ranks (serve/step.py; at decode with the paged MLA kernel,
    # through its log-sum-exp), so the same per-rank `cache_bytes` holds R times the context.
    decode_context_parallel_size: int = 1
    # Expert-parallel load balancing (vLLM's --enable-eplb with eplb_config window_size / step_interval;
    # serve/eplb.py): with the routed experts split over a mesh axis, every `eplb_step_interval` steps the
    # engine re-places each MoE layer's experts so every rank multiplies about the same share of the tokens
    # routed over the last `eplb_window_size` steps (outputs unchanged, bit for bit). Needs expert parallelism.
    enable_eplb: bool = False
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    # Redundant experts (vLLM's eplb_config num_redundant_experts): each MoE layer holds this many extra
    # copies of its hottest experts (E + X stacked experts, (E + X) / R per rank), placed by the same plans;
    # evens out layers whose hottest expert alone outweighs a rank's share. Costs X experts' weights per layer.
    eplb_num_redundant_experts: int = 0
    # vLLM's --enable-expert-parallel: the routed experts must split over the mesh by expert (the `sharding`
    # config's `experts` rule: `tp`, `ep` and `tp_ep` do), else the engine refuses to start; on one device it
    # changes nothing (vLLM's EP size TP x DP is 1). Not with data-parallel replicas: they share no experts.
    enable_expert_parallel: bool = False
    # Devices the engine runs on, as indices into `jax.devices()`; None: every device under a `sharding`
    # config, the default device without one. Disjoint sets let several engines share a host: data-parallel
    # replicas (serve/data_parallel.py), or a disaggregated prefill engine beside its decode engine. Without
    # `sharding` it names one device (the "single" config's mesh on it).
    devices: Optional[tuple[int, ...]] = None
    # vLLM's tensor_parallel_size (`-tp N`): the engine's mesh spans N devices (the first N, or `devices`, which
    # must then name N), under `sharding` (default "tp" when N > 1: heads, MLP units, vocabulary and routed
    # experts split N ways). With data_parallel_size M, M replicas of N devices each. None: see `devices`.
    tensor_parallel_size: Optional[int] = None
    # Speculative decoding (vLLM's `speculative_config`, e.g. {"method": "ngram", "num_speculative_tokens":
    # 3}): decodes carry n-gram drafts that one step verifies (serve/speculative.py); same outputs,
    # more tokens per step when drafts are accepted. None: off.
    speculative_config: Optional[SpeculativeConfig] = None
    # Multi-LoRA (vLLM's --enable-lora / --max-loras / --max-lora-rank; k3jax/lora.py, serve/lora.py): this
    # many adapters loaded at once, each served to any mix of rows in the same batch, of rank up to
    # max_lora_rank on every dense projection. 0: off (the model has no adapter factors at all).
    max_loras: int = 0
    max_lora_rank: int = 16
    # Adapters held in host memory (vLLM's --max-cpu-loras; None: max_loras): those beyond the device slots
    # wait there and take a slot when a request needs them (the least recently used idle one); loading one
    # more drops the least recently used idle adapter read from a directory, which is read again when used.
    max_cpu_loras: Optional[int] = None
    # Projections that get adapter slots, by name (e.g. ("q_proj", "k_proj", "v_proj", "o_proj")); None: every
    # dense projection. Each projection with slots adds its adapters' term to every step, and an adapter
    # touching a projection without slots is refused, naming it. "all-linear": every dense projection;
    # "experts" (or "w1" / "w3" / "w2"): the routed experts too, per-expert factors of E x a projection's size
    # (k3jax/lora.py), e.g. ("all-linear", "experts").
    lora_target_modules: Optional[tuple[str, ...]] = None
    # Routed-expert adapters with one A per matrix for all experts and a B per expert (miles' K3 LoRA
    # recipe): the A slots take 1/E of the memory; adapters whose experts' A differ are refused.
    lora_experts_shared_a: bool = False
    # Custom logits processors (vLLM's `logits_processors`; serve/logits_processors.py): pure JAX functions over
    # the batch's logits, traced into every step program at start-up and run on the rows whose request sets
    # one of their arguments in `SamplingParams.extra_args`. `LogitsProcessor` objects or import paths
    # ("package.module:attribute"; what the CLI and data-parallel replica processes take).
    logits_processors: tuple = ()
    # The model's default sampling (vLLM's --generation-config; serve/generation_config.py): "auto" reads the
    # checkpoint directory's generation_config.json (K3: temperature 1.0, top_p 0.95), "vllm" ignores it, a
    # directory reads that one's. It fills what a request leaves unset (LLM.generate without sampling
    # parameters; the server's missing temperature / top_p / top_k / min_p / repetition_penalty / max_tokens).
    generation_config: str = "auto"
    # Prompts given as vectors (vLLM's --enable-prompt-embeds; serve/prompt_embeds.py): every step program takes
    # a [rows, tokens, hidden] input beside the token ids, and `add_request` accepts {"prompt_embeds": [L, H]}.
    enable_prompt_embeds: bool = False
    # Async scheduling (vLLM's --async-scheduling): `step()` plans and launches the next device step before it
    # reads back the one in flight, so the host's scheduling, batch building and output processing run while
    # the device computes instead of between its steps. A running request's next input token is the one its
    # step in flight samples, passed on the device (StepBatch.carry); a request that turns out to have finished
    # wastes that one row. Outputs are those of the synchronous engine, token for token; each `step()` returns
    # the outputs of the step before it. Rows whose next step depends on the host seeing the token first
    # (beams, a KDA checkpoint taken at the row's end, drafts being verified) run that step synchronously.
    # With speculative decoding a row whose token is in flight drafts on a guess of that token (the n-gram's
    # first proposal; `Engine._drafts`), and structured-output and bad-words rows run synchronously (their
    # verify masks need every token on the host).
    async_scheduling: bool = False

    def __post_init__(self):
        m = self.max_model_len
        if isinstance(m, numbers.Integral) and not isinstance(m, bool):  # (a NumPy integer as the other sizes)
            object.__setattr__(self, "max_model_len", "auto" if m == -1 else int(m))  # -1: vLLM's spelling of "auto"
        if isinstance(self.speculative_config, dict):  # vLLM's form
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        tp = self.tensor_parallel_size
        if self.sharding is None and isinstance(tp, int) and not isinstance(tp, bool) and tp > 1:
            object.__setattr__(self, "sharding", "tp")

    def mesh_devices(self) -> Optional[tuple[int, ...]]:
        """Indices into `jax.devices()` of the engine's mesh: `devices`, else the first `tensor_parallel_size`;
        None: every device under a `sharding` config, the default device without one."""
        if self.devices is not None:
            return tuple(self.devices)
        if self.tensor_parallel_size is not None and (self.sharding is not None or self.tensor_parallel_size > 1):
            return tuple(range(self.tensor_parallel_size))
        return None

    def check_mesh(self) -> None:
        """Raise unless the `sharding` config's mesh fits the devices the engine gets (`mesh_devices`; all of them
        when unset), naming the option that chose them: checked before the weights load (`k3jax serve` says so
        before it listens), not only once they are placed."""
        if not self.sharding and self.devices is None:
            return
        on = self.mesh_devices()
        try:
            load_sharding_config(self.sharding or "single").mesh_shape(len(jax.devices()) if on is None else len(on))
        except ValueError as e:
            if self.devices is not None:
                raise ValueError(f"devices={list(self.devices)!r}: {e}") from None
            if on is not None:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: {e}") from None
            raise

    def validate(self):
        if self.kda_decode not in ("auto", "in_place", "gathered"):
            raise ValueError(f"kda_decode={self.kda_decode!r}: expected 'auto', 'in_place' or 'gathered'")
        if self.mla_decode not in ("auto", "paged", "gathered"):
            raise ValueError(f"mla_decode={self.mla_decode!r}: expected 'auto', 'paged' or 'gathered'")
        check_logprobs_mode(self.logprobs_mode)  # raises, naming logprobs_mode
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: expected an integer >= 0")
        if self.enable_return_routed_experts and self.kv_transfer_config is not None:
            raise ValueError("enable_return_routed_experts with kv_transfer_config: a decode engine resumes prompts "
                             "another engine computed, whose routed experts are not transferred")
        rb = self.routed_experts_cache_bytes
        if rb is not None and (not isinstance(rb, int) or isinstance(rb, bool) or rb < 0):
            raise ValueError(f"routed_experts_cache_bytes={rb!r}: expected an integer >= 0 (or None)")
        canonical_kv_cache_dtype(self.kv_cache_dtype)  # raises, naming kv_cache_dtype
        state_dtype_name(self.kda_state_dtype)  # raises, naming kda_state_dtype
        if isinstance(self.logits_processors, (str, logits_processors.LogitsProcessor)) or not isinstance(
                self.logits_processors, (collections.abc.Iterable, type(None))):
            raise ValueError("logits_processors: expected a sequence of processors or import paths")
        logits_processors.resolve(self.logits_processors)  # raises, naming logits_processors
        dcp = self.decode_context_parallel_size
        if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
            raise ValueError(f"decode_context_parallel_size={dcp!r}: expected an integer >= 1")
        for key in ("eplb_window_size", "eplb_step_interval"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key}={v!r}: expected an integer >= 1")
        x = self.eplb_num_redundant_experts
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"eplb_num_redundant_experts={x!r}: expected an integer >= 0")
        if x and not self.enable_eplb:
            raise ValueError(f"eplb_num_redundant_experts={x}: redundant experts are placed by expert-parallel load "
                             "balancing; set enable_eplb")
        if self.enable_deterministic_inference:
            if self.speculative_config is not None:
                raise ValueError("enable_deterministic_inference: speculative decoding computes accepted tokens in its "
                                 "verify program, other tokens in the decode program; turn one of them off")
            if self.long_prefill_chunk != 0:
                raise ValueError(f"enable_deterministic_inference: long_prefill_chunk={self.long_prefill_chunk!r} "
                                 f"runs a prompt's chunks in another program when it prefills alone; set 0")
        if self.enable_eplb and not self.sharding:
            raise ValueError("enable_eplb balances routed experts split over a mesh axis: it needs a `sharding` "
                             "config whose `experts` rule splits them (expert parallelism)")
        if dcp > 1 and not self.sharding:
            raise ValueError(f"decode_context_parallel_size={dcp} splits the MLA pages over a mesh axis: it needs a "
                             "`sharding` config whose `heads` rule splits the KDA heads over that many devices")
        if self.expert_weights not in ("auto", "packed", "dequantized"):
            raise ValueError(f"expert_weights={self.expert_weights!r}: expected 'auto', 'packed' or 'dequantized'")
        if self.dense_weights not in ("auto", "out_in", "in_out"):
            raise ValueError(f"dense_weights={self.dense_weights!r}: expected 'auto', 'out_in' or 'in_out'")
        if self.max_model_len == "auto":
            if self.sizes_from_memory:
                raise ValueError("max_model_len='auto': the longest request the arena holds needs the arena's size "
                                 "first; under gpu_memory_utilization that size follows the step programs, whose "
                                 "widths follow max_model_len: give max_model_len, or cache_bytes in place of "
                                 "gpu_memory_utilization")
        elif isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r}: expected an integer >= 2, 'auto' or -1")
        for key in ("page_size", "prefill_chunk", "max_num_seqs", "max_prefill_seqs", "max_num_batched_tokens",
                    "checkpoint_interval", "decode_checkpoint_interval") + (
                        ("cache_bytes",) if self.cache_bytes is not None else ()):
            _check_int(key, getattr(self, key), 1)
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        _check_int("prefix_hash_unit", self.prefix_hash_unit, 1, 128)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        for key in BOOL_OPTIONS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}={getattr(self, key)!r}: expected True or False")
        for key in ("decode_buckets", "prefill_buckets", "context_buckets"):
            _check_buckets(key, getattr(self, key))
        if self.decode_buckets is not None and max(self.decode_buckets) > self.max_num_seqs:
            raise ValueError(f"decode_buckets={self.decode_buckets!r}: the largest is the requests running at once, "
                             f"at most max_num_seqs={self.max_num_seqs}")
        if self.prefill_buckets is not None and max(self.prefill_buckets) > self.max_prefill_seqs:
            raise ValueError(f"prefill_buckets={self.prefill_buckets!r}: the largest is the prompts prefilled in one "
                             f"step, at most max_prefill_seqs={self.max_prefill_seqs}")
        g = self.generation_config  # (an int was taken for a file descriptor: os.path.isdir(0) reads stdin's)
        if g is not None and (not isinstance(g, str) or g not in ("auto", "vllm") and not os.path.isdir(g)):
            raise ValueError(f"generation_config={g!r}: expected 'auto', 'vllm' or a directory")
        _check_int("host_cache_bytes", self.host_cache_bytes, 0)
        if self.host_cache_bytes and not self.enable_prefix_caching:
            raise ValueError("host_cache_bytes: the host tier holds what the prefix cache evicts; it needs "
                             "enable_prefix_caching")
        if self.kv_transfer_config is not None:
            kv = self.kv_transfer_config
            if not isinstance(kv, dict) or set(kv) != {"kv_role", "store"}:
                raise ValueError("kv_transfer_config: expected {'kv_role': ..., 'store': HostCache}")
            if kv["kv_role"] not in KV_ROLES:
                raise ValueError(f"kv_transfer_config.kv_role={kv['kv_role']!r}: expected one of {KV_ROLES}")
            if not isinstance(kv["store"], HostCache):
                raise ValueError("kv_transfer_config.store: expected a serve.host_cache.HostCache shared by the "
                                 "engines")
            if not self.enable_prefix_caching or self.host_cache_bytes:
                raise ValueError("kv_transfer_config: needs enable_prefix_caching, and the store is the host tier "
                                 "(leave host_cache_bytes at 0)")
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: expected 'priority' or 'fcfs'")
        if not isinstance(self.schedule_conservativeness, (int, float)) or not 0 <= self.schedule_conservativeness <= 10:
            raise ValueError(f"schedule_conservativeness={self.schedule_conservativeness!r}: expected a number in "
                             f"[0, 10] (0: no admission look-ahead)")
        if self.compile_threads is not None and (isinstance(self.compile_threads, bool)
                                                 or not isinstance(self.compile_threads, int) or self.compile_threads < 1):
            raise ValueError(f"compile_threads={self.compile_threads!r}: expected a positive integer or None (automatic)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: expected at least max_num_seqs "
                             f"({self.max_num_seqs}), a token for each running request's decode")
        align = min(self.prefill_chunk, KDA_CHUNK)  # prefill rows are cut to multiples of it (serve/scheduler.py)
        if self.max_num_batched_tokens < align:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: a step's prompt rows are cut to "
                             f"multiples of min(prefill_chunk, {KDA_CHUNK}) = {align} tokens, so a prompt longer than "
                             f"the budget could never run; expected at least {align}")
        if self.sharding is not None:
            if not isinstance(self.sharding, str) or not self.sharding:
                raise ValueError(f"sharding={self.sharding!r}: expected a config name in sharding_configs/ or a YAML path")
            sharding = load_sharding_config(self.sharding)  # raises, naming the config key at fault
            fixed = dict(sharding.mesh_axes) if -1 not in dict(sharding.mesh_axes).values() else None
            if self.enable_expert_parallel and (why := expert_parallel_refusal(self.sharding, sharding.rule("experts"),
                                                                               fixed)):
                raise ValueError(why)
        f = self.gpu_memory_utilization
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1):
            raise ValueError(f"gpu_memory_utilization={f!r}: expected a fraction in (0, 1]")
        tp = self.tensor_parallel_size
        if tp is not None:
            if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
                raise ValueError(f"tensor_parallel_size={tp!r}: expected an integer >= 1")
            if tp > len(jax.devices()):
                raise ValueError(f"tensor_parallel_size={tp}: only {len(jax.devices())} devices "
                                 f"({jax.devices()[0].platform})")
            if self.devices is not None and len(self.devices) != tp:
                raise ValueError(f"tensor_parallel_size={tp}: devices={self.devices!r} names {len(self.devices)}; "
                                 f"give {tp} or leave devices unset (the first {tp})")
        if self.devices is not None:
            devs, count = self.devices, len(jax.devices())
            if (isinstance(devs, (str, bytes)) or not hasattr(devs, "__len__") or not devs
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < count for d in devs)):
                raise ValueError(f"devices={devs!r}: expected a non-empty list of indices into jax.devices() "
                                 f"(0..{count - 1})")
            if len(set(devs)) != len(devs):
                raise ValueError(f"devices={devs!r}: an index appears twice")
            if self.sharding is None and len(devs) != 1:
                raise ValueError(f"devices={devs!r}: without a sharding config the engine runs on one device; "
                                 f"name one, or set sharding (e.g. 'tp') to run over several")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise ValueError(f"speculative_config={self.speculative_config!r}: expected a dict or SpeculativeConfig")
            self.speculative_config.validate(self.prefill_chunk)
        if self.lora_target_modules is not None and (
                isinstance(self.lora_target_modules, str) or not isinstance(self.lora_target_modules,
                                                                            collections.abc.Iterable)
                or not self.lora_target_modules
                or not all(isinstance(t, str) and t for t in self.lora_target_modules)):
            raise ValueError(f"lora_target_modules={self.lora_target_modules!r}: expected None or a non-empty "
                             f"tuple of projection names")
        if not isinstance(self.lora_experts_shared_a, bool):
            raise ValueError(f"lora_experts_shared_a={self.lora_experts_shared_a!r}: expected a bool")
        for key, low in (("max_loras", 0), ("max_lora_rank", 1)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= 1024:
                raise ValueError(f"{key}={v!r}: expected an integer in [{low}, 1024]")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or isinstance(
                self.max_cpu_loras, bool) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras!r}: expected an integer >= max_loras "
                             f"({self.max_loras})")
        if self.prefill_chunk % KDA_CHUNK and KDA_CHUNK % self.prefill_chunk:
            raise ValueError(f"prefill_chunk must divide or be a multiple of the KDA chunk ({KDA_CHUNK}) so "
                             f"prefill rows start on KDA chunk boundaries")
        n = self.long_prefill_chunk
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0 or (
                n and (n % self.prefill_chunk or n < 2 * self.prefill_chunk or n > self.max_num_batched_tokens))):
            raise ValueError(f"long_prefill_chunk={n!r}: expected None, 0 (off) or a multiple of prefill_chunk "
                             f"({self.prefill_chunk}) from {2 * self.prefill_chunk} to max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")
        if n and self.speculative_config is not None and self.speculative_config.verify_tokens == n:
            raise ValueError(f"long_prefill_chunk={n} equals the verify rows' tokens (1 + num_speculative_tokens): "
                             f"the two programs would share a shape; pick another")

    @property
    def sizes_from_memory(self) -> bool:
        """Whether the arena is sized from device memory (`gpu_memory_utilization`, not overridden by an explicit
        `cache_bytes` or `num_gpu_blocks_override`)."""
        return (self.gpu_memory_utilization is not None and self.cache_bytes is None
                and self.num_gpu_blocks_override is None)

    @property
    def arena_bytes(self) -> int:
        """The arena's byte budget when no device-memory fraction sizes it: `cache_bytes`, or its default."""
        return self.cache_bytes if self.cache_bytes is not None else DEFAULT_CACHE_BYTES

    def overridden_budget(self) -> Optional[str]:
        """A start-up note when an explicit size (`num_gpu_blocks_override`, or `cache_bytes`) sets the arena beside
        `gpu_memory_utilization`, which it then ignores (as vLLM's kv_cache_memory_bytes and its overridden block
        count do); else None."""
        if self.gpu_memory_utilization is None or self.sizes_from_memory:
            return None
        by = (f"num_gpu_blocks_override={self.num_gpu_blocks_override} sets the arena's units"
              if self.num_gpu_blocks_override is not None else f"cache_bytes={self.cache_bytes} sets the cache's size")
        return f"gpu_memory_utilization={self.gpu_memory_utilization}: ignored, {by}"

    def starved_prompts(self) -> Optional[str]:
        """Why prompts would start only in waves (None: they do not). A prompt row is cut to multiples of
        min(prefill_chunk, 64) (KDA's alignment), so a budget that leaves less than that beside max_num_seqs - 1
        decodes starts no prompt longer than the rest until a running request finishes (vLLM's scheduler fills
        the rest with a partial chunk). Accepted (the engine runs, as vLLM takes any budget >= max_num_seqs) and
        said at start-up."""
        align = min(self.prefill_chunk, KDA_CHUNK)
        need = self.max_num_seqs - 1 + align
        if self.max_num_batched_tokens >= need:
            return None
        rest = self.max_num_batched_tokens - (self.max_num_seqs - 1)
        return (f"max_num_batched_tokens={self.max_num_batched_tokens} leaves {rest} tokens beside the decodes of "
                f"max_num_seqs - 1 = {self.max_num_seqs - 1} running requests, under one prompt row of "
                f"min(prefill_chunk, {KDA_CHUNK}) = {align} tokens: while they decode, a prompt longer than {rest} "
                f"tokens waits until one of them finishes; set max_num_batched_tokens >= {need} or lower max_num_seqs")

    def long_prefill_tokens(self) -> int:
        """The one-row long prefill program's tokens (`long_prefill_chunk` resolved); 0: none."""
        c = self.prefill_chunk
        n = self.long_prefill_chunk
        if n is None:
            n = min(self.max_prefill_seqs * c, self.max_num_batched_tokens // c * c, -(-self.max_model_len // c) * c)
        return n if n >= 2 * c else 0


DETERMINISTIC_ROWS = 8  # deterministic inference: the rows of a decode tile (`StepOptions.row_tile`; EngineConfig above)
# deterministic inference on XLA:CPU: only dots go to the YNNPACK library; its reductions and elementwise fusions
# are taken or not by the operands' shapes and sum in another order (a row's logprobs 1e-6..1e-5 apart between
# programs of 8 and 32 rows, or of 4 and 16 context pages); XLA's own loops sum a row alike in every shape
DETERMINISTIC_XLA_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def _compiler_options_known(options: tuple) -> bool:
    """Whether this XLA compiles with `options` (an experimental flag may be renamed or dropped by another
    jaxlib: the deterministic engine then runs one program per kind, and says so)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(jnp.zeros((), jnp.float32)).compile()
        return True
    except Exception as e:  # (XLA's error for an unknown option)
        log.warning("deterministic inference: this XLA does not take %s (%s); one program per kind", dict(options), e)
        return False


def _alternatives(top_ids: np.ndarray, top_lps: np.ndarray, n: int, dec) -> list[Logprob]:
    """The first `n` top-n alternatives [n'] as Logprobs, each ranked by its place (vLLM's)."""
    return [Logprob(int(a), float(b), dec(int(a)), j + 1) for j, (a, b) in enumerate(zip(top_ids[:n], top_lps[:n]))]


@dataclass
class Sequence:
    rid: str  # engine-internal id (request id + sample index)
    request_id: str
    index: int
    order: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    checker: StopChecker
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0
    slot: Optional[int] = None
    pages: list[list[int]] = field(default_factory=list)  # per MLA layer: units in position order
    logprobs: list = field(default_factory=list)  # with params.logprobs: a TokenLogprobs per generated token
    cum_logprob: float = 0.0  # with params.logprobs: the sum of its sampled tokens' logprobs (vLLM's)
    hasher: Optional[PrefixHasher] = None
    hit: Optional[Hit] = None  # prefix-cache hit planned for admission / pinned until the first step
    read_slot: Optional[int] = None  # slot to read the state from in the next step (a checkpoint)
    read_pin: object = None  # the checkpoint entry pinned for that read
    copies: list = field(default_factory=list)  # (src unit, dst unit) to copy before the next step
    registered_pages: int = 0
    captures: dict = field(default_factory=dict)  # position -> checkpoint kind
    internal: Optional[str] = None  # set on canonical re-prefill rows: the checkpoint kind they produce
    home: tuple = ()  # canonical re-prefill rows: their own (priority, order), behind every real request
    reused: bool = False  # its prompt resumed from the prefix cache (part of a reuse chain)
    cached_tokens: Optional[int] = None  # prompt tokens its first admission took from the prefix cache
    preempted: bool = False  # preempted at least once (its readmissions' lookups are not vLLM's prefix queries)
    prompt_lps: Optional[list] = None  # with params.prompt_logprobs: per prompt position (see RequestOutput)
    priority: int = 0  # lower is scheduled first (serve/scheduler.py)
    guide: Optional[Guide] = None  # structured outputs: the constraint's matcher (serve/structured.py)
    bad_words: tuple = ()  # token sequences never to complete (SamplingParams.bad_words)
    draft: list[int] = field(default_factory=list)  # speculative tokens proposed for the next decode
    # async scheduling: the token its drafts guessed was in flight (the n-gram's first proposal; None: no guess)
    guess: Optional[int] = None
    ngrams: Optional[Union[NgramIndex, SuffixIndex]] = None  # where its n-grams / patterns occurred (drafts' source)
    spec_p: Optional[list[float]] = None  # its own draft acceptance estimates by position (DraftGate)
    tenant: bytes = b""  # its cache_salt and LoRA adapter: what it may share (suffix decoding's cached responses)
    lora: Optional[Adapter] = None  # the LoRA adapter it runs with (None: the base model)
    embeds: Optional[np.ndarray] = None  # prompt embeddings [L, H]: the inputs of positions < L (prompt_ids: zeros)
    beam: Optional[BeamGroup] = None  # set on the beams of a beam-search request (serve/beam_search.py)
    hyp: Hypothesis = Hypothesis()  # a beam's generated tokens and their logprobs
    proposals: Optional[tuple] = None  # a beam's (top ids, top logprobs) awaiting its group's selection
    sent: Optional[tuple[int, int]] = (0, 0)  # output_kind DELTA: tokens and text deltas out (None: all)
    # async scheduling: what launched steps not read back yet will add (see Engine._launch / _land)
    pending: int = 0  # tokens they sample for it, not in output_ids yet
    flight_end: int = 0  # the end of its latest launched row (`computed` once that step is read back)
    carry_at: int = -1  # the carry entry of its latest sampled token (StepBatch.carry)
    epoch: int = 0  # counts releases of its memory: a step launched before one is stale
    # enable_return_routed_experts: its routed ids by position, and those its planned prefix-cache hit skips
    routes: Optional[SequenceRoutes] = None
    hit_routes: Optional[list] = None
    hidden: Optional[PositionRows] = None  # params.return_hidden_states: its final hidden states by position
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    _table: Optional[np.ndarray] = field(default=None, repr=False, compare=False)  # [MLA layers, capacity]
    _table_n: int = field(default=0, repr=False, compare=False)  # pages of `_table` in step with `pages`
    _table_of: tuple = field(default=(), repr=False, compare=False)  # ids of the lists it was read from
    table_gen: int = field(default=0, repr=False, compare=False)  # counts re-reads of `pages` from the start
    # its row of the device page tables (serve/page_tables.py; -1: none) and what that row holds: the pages
    # of `page_table()` as of generation `table_sent_gen`
    table_row: int = field(default=-1, repr=False, compare=False)
    table_sent: int = field(default=0, repr=False, compare=False)
    table_sent_gen: int = field(default=-1, repr=False, compare=False)
    place: int = field(default=0, repr=False, compare=False)  # its entry's number in `Engine.seqs` (their order)
    # `ids()`: the tokens read so far, and the lists they were read from
    _ids: Optional[list] = field(default=None, repr=False, compare=False)
    _ids_of: tuple = field(default=(), repr=False, compare=False)

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output tokens, a new list per read (the caller's to keep or change); per-step paths use
        `num_ids`, `id_at` or `ids` instead (each read copied the whole sequence)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_ids(self) -> int:
        """len(all_ids), without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    def id_at(self, i: int) -> int:
        """all_ids[i] for 0 <= i < num_ids, without building it."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def ids(self) -> list[int]:
        """all_ids kept between reads and extended by the tokens appended since: a read costs what was appended,
        not the whole sequence. Read-only and shared (a prefix hasher holds it): holders see it only grow, as
        output tokens are only ever appended. Lists replaced, or shorter than what was read, are read again into
        a new list."""
        ids, of = self._ids, self._ids_of
        n, k = len(self.prompt_ids), len(self.output_ids)
        if ids is None or of[0] is not self.prompt_ids or of[1] is not self.output_ids or not n <= len(ids) <= n + k:
            self._ids, self._ids_of = self.prompt_ids + self.output_ids, (self.prompt_ids, self.output_ids)
        elif len(ids) < n + k:
            ids += self.output_ids[len(ids) - n:]
        return self._ids

    def page_table(self) -> np.ndarray:
        """`pages` as an array [MLA layers, pages] int32, kept across steps and extended by the pages added
        since it was last read (a decode step adds at most one a layer): converting every row's whole lists
        each step took ~1 s of host time per decode step at K3 sizes (24 MLA layers, 256 rows, 2048 pages).
        Lists replaced (another object) or shorter than what was read are read again; a list cleared and
        refilled in place must be announced with `pages_changed`."""
        n = len(self.pages[0]) if self.pages else 0
        of = tuple(map(id, self.pages))
        if of != self._table_of or n < self._table_n:
            self._table_n, self._table_of = 0, of
            self.table_gen += 1
        if self._table is None or self._table.shape[0] != len(self.pages) or n > self._table.shape[1]:
            grown = np.zeros((len(self.pages), max(16, 2 * n)), np.int32)
            if self._table_n:
                grown[:, :self._table_n] = self._table[:, :self._table_n]
            self._table = grown
        k = self._table_n
        if n > k:
            new = [p[k:n] for p in self.pages]
            if any(len(p) != n for p in self.pages):
                raise AssertionError(f"{self.rid}: MLA layers hold different page counts {[len(p) for p in self.pages]}")
            self._table[:, k:n] = new
            self._table_n = n
        return self._table[:, :n]

    def pages_changed(self) -> None:
        """`pages` were changed other than by appending (the cached `page_table` is read again)."""
        self._table_n = 0
        self.table_gen += 1

    @property
    def num_units(self) -> int:
        return sum(len(p) for p in self.pages)


@dataclass
class _FrozenSlot:
    """A forked beam's parent: its state slot and MLA units, held until every child has read them."""

    slot: int
    units: list[int]
    pins: int = 0  # children that have not yet read the slot


@dataclass
class _Flight:
    """A launched step program not read back yet: what `Engine._land` needs to take its results in."""

    seqs: list[Sequence]
    rows: list[tuple[str, int, int]]  # (request id, start, tokens)
    epochs: list[int]  # each sequence's `epoch` at the launch (another one when read back: stale row)
    samples: list[bool]  # rows that sample their sequence's next token
    t: int
    rows_bucket: int
    targets: np.ndarray  # [B, T] the batch's prompt-logprob targets
    out: tuple  # device results: ((samples, prompt logprobs, drafts accepted), expert counts)
    pins: list  # checkpoint entries pinned until this step has read them
    chainable: bool  # the next step may be launched before this one is read back
    # a decode program whose logits are not sampled yet (async scheduling: `Engine._complete`): its batch's
    # sampling parameters; `out` holds the logits and first MLA layer's page table [B, 1, P] until then
    deferred: Optional[SamplingBatch] = None
    channel_step: int = 0  # its number on a multi-process engine's step channel (names it to the followers)


@dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # a beam search's live beams
    metrics: RequestMetrics
    beam: Optional[BeamGroup] = None
    embeds: bool = False  # its prompt is vectors: outputs carry no prompt token ids
    reported: bool = False  # an output went out (output_kind DELTA: prompt logprobs only in the first)

    @property
    def finished(self) -> bool:
        return self.beam.done if self.beam is not None else all(s.finished for s in self.seqs)


def scan_plan(config: "EngineConfig", cfg) -> Optional[LayerScan]:
    """The layer scan an engine runs (see EngineConfig.scan_layers), or None: every layer unrolled."""
    if not config.scan_layers:
        return None
    plan = layer_scan.plan(cfg)
    if plan is None:
        raise ValueError(f"scan_layers=True: no group of this model's {cfg.num_hidden_layers} layers repeats (the "
                         f"same attention, FFN and AttnRes block position twice in a row)")
    return plan


class Engine:
    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), warmup: bool = True,
                 progress: bool = True):
        config.validate()
        if (starved := config.starved_prompts()) is not None:
            log.warning("%s", starved)
        if (overridden := config.overridden_budget()) is not None:
            log.warning("%s", overridden)
        self.generation_defaults = generation_config.resolve(config.generation_config, model.source)
        reference = resolve_backend("auto") == "reference"
        if config.max_loras:  # adapter factors on the dense projections, before the transforms shard them
            targets = config.lora_target_modules
            if targets is not None:
                unknown = sorted(set(targets) - model_lora.projection_names(model.cfg))
                if unknown:
                    raise ValueError(f"lora_target_modules: this model has no projection named {unknown[0]!r} "
                                     f"(it has {', '.join(sorted(model_lora.projection_names(model.cfg)))})")
                targets = tuple(targets)
            model = model_lora.attach(model, config.max_loras, config.max_lora_rank, targets,
                                      config.lora_experts_shared_a)
        self._dequantize = config.expert_weights == "dequantized" or (config.expert_weights == "auto" and reference)
        # the checkpoint's MXFP4 group when its packed experts are held expanded (weights by name)
        self._expanded_group = (model.cfg.mxfp4_group_size if self._dequantize and model.cfg.expert_format == "mxfp4"
                                else None)
        self._weight_names: Optional[WeightNames] = None
        # expanded to fp32 on CPU even for a bf16 model (k3jax/dequantize.py); else to the model dtype
        self._expert_dtype = jnp.float32 if reference else None
        if self._dequantize:
            model = dequantize_experts(model, self._expert_dtype)
        self.dense_in_out = config.dense_weights == "in_out" or (config.dense_weights == "auto" and reference)
        if self.dense_in_out:
            model = transpose_dense_weights(model)
        if config.enable_eplb:  # initial placement tables (and copies), placed with the weights below
            model = eplb.attach(model, config.eplb_num_redundant_experts)
        self.mesh, self.sharding_config, self.sharding_notes, arena_sharding = None, None, {}, None
        self.state_split = None  # the arena split over a mesh axis by KDA heads (serve/state_split.py)
        on = config.mesh_devices()
        if config.sharding or on is not None:
            self.sharding_config = load_sharding_config(config.sharding or "single")
            devices = None if on is None else [jax.devices()[i] for i in on]
            config.check_mesh()  # raises, naming the option that chose the devices
            self.mesh, model, self.sharding_notes = shard_model(model, self.sharding_config, devices)
            axis = state_axis(self.sharding_config, dict(self.mesh.shape), model.cfg.kda_num_heads)
            self.state_split = StateSplit(self.mesh, axis) if axis is not None else None
            heads = self.sharding_config.rule("heads")
            if axis is None and axes_size(heads, dict(self.mesh.shape)) > 1 and model.cfg.num_kda_layers:
                self.sharding_notes["cache arena"] = [
                    f"{model.cfg.kda_num_heads} KDA heads not divisible by {heads}="
                    f"{axes_size(heads, dict(self.mesh.shape))}: state slots replicated on every device"]
            arena_sharding = self.state_split.sharding() if self.state_split else replicated(self.mesh)
        # one device: the weights, arena, token pages and carry committed to it from the start, whatever the
        # weights' origin (a preset's are uncommitted, an Orbax restore's committed), so every call of a program
        # sees one signature (an uncommitted arena after committed weights' first step compiled it again)
        self._one_device = None if self.mesh is not None else jax.sharding.SingleDeviceSharding(
            next(iter(jax.tree.leaves(model.params)[0].devices())))
        if self._one_device is not None:
            model = dataclasses.replace(model, params=jax.tree.map(
                lambda x: jax.device_put(x, self._one_device), model.params))
        # ranks that share the routed experts (1: no expert parallelism), for the traffic estimate
        physical = model.cfg.num_experts + config.eplb_num_redundant_experts
        self._ep_ranks = (axes_size(expert_axis(self.sharding_config, self.mesh, physical),
                                    dict(self.mesh.shape)) if self.mesh is not None else 1)
        if config.enable_expert_parallel and self.mesh is not None and (why := expert_parallel_refusal(
                self.sharding_config.name, self.sharding_config.rule("experts"), dict(self.mesh.shape),
                model.cfg.num_experts, physical)):
            raise ValueError(why)
        ranks = axes_size(self.sharding_config.rule("experts"), dict(self.mesh.shape)) if self.mesh is not None else 1
        if config.eplb_num_redundant_experts and ranks > 1 and physical % ranks:
            raise ValueError(f"eplb_num_redundant_experts={config.eplb_num_redundant_experts}: the "
                             f"{model.cfg.num_experts} routed experts and their copies ({physical}) must split evenly "
                             f"over the {ranks} ranks of the `experts` rule under sharding={config.sharding!r}")
        self.model, self.config, self.cfg = model, config, model.cfg
        self.tokenizer = model.tokenizer
        dcp, ranks = config.decode_context_parallel_size, self.state_split.ranks if self.state_split else 1
        if dcp > 1 and dcp != ranks:
            raise ValueError(f"decode_context_parallel_size={dcp}: the MLA pages are split over the ranks that split "
                             f"the KDA heads, {ranks} under sharding={config.sharding!r} on {self.mesh.size} devices "
                             f"({self.cfg.kda_num_heads} KDA heads, heads rule {self.sharding_config.rule('heads')!r})")
        layout_for = lambda budget: ArenaLayout.plan(  # noqa: E731
            self.cfg, budget, config.page_size, model.dtype, ranks, config.kv_cache_dtype, config.kda_state_dtype, dcp)
        unsized = layout_for(1 << 60)  # (a layout is arithmetic: nothing is allocated)
        if config.num_gpu_blocks_override is not None:
            blocks = config.num_gpu_blocks_override
            self.layout = ArenaLayout.plan(self.cfg, blocks * unsized.unit_bytes, config.page_size, model.dtype, ranks,
                                           config.kv_cache_dtype, config.kda_state_dtype, dcp,
                                           budget_name=f"num_gpu_blocks_override={blocks}")
        elif not config.sizes_from_memory:
            self.layout = layout_for(config.arena_bytes)
        else:  # the smallest arena for now; _size_arena_from_memory replaces it
            self.layout = layout_for(min_units(unsized.slot_units) * unsized.unit_bytes)
        self.config = config = self._resolve_max_model_len(config)
        self.kda_in_place = config.kda_decode == "in_place" or (config.kda_decode == "auto" and reference)
        # fp8 latents: the paged kernel reads the words and dequantises in the tile; the gathered form after the gather
        # the Pallas kernels read a page (a rank's share of one, with context parallelism) as one tile:
        # Triton's dot needs at least 16 rows (a power of two), TPU tiles multiples of 8
        share = self.layout.rank_page
        small_share = not reference and dcp > 1 and (share < 16 or share & (share - 1))
        if config.mla_decode == "paged" and small_share:
            raise ValueError(f"mla_decode='paged' with decode_context_parallel_size={dcp}: the paged kernel reads each "
                             f"rank's {share}-token share of a page as one tile and needs a power of two >= 16; use "
                             f"page_size >= {16 * dcp} or mla_decode 'gathered'")
        self.mla_paged = config.mla_decode == "paged" or (config.mla_decode == "auto" and not reference
                                                          and not small_share)
        self.spec = config.speculative_config
        # suffix decoding: the responses of finished requests, to draft from (serve/speculative.py)
        self.suffix = SuffixProposer(self.spec) if self.spec is not None and self.spec.method == "suffix" else None
        self.logits_processors = logits_processors.resolve(config.logits_processors)
        self.decode_buckets, self.prefill_buckets, self.context_buckets = default_buckets(
            config.max_num_seqs, config.max_prefill_seqs, config.max_model_len, config.page_size,
            config.decode_buckets, config.prefill_buckets, config.context_buckets)
        # deterministic inference on the CPU reference path of one device: decode programs run their rows in tiles
        # of DETERMINISTIC_ROWS and every program is compiled without XLA:CPU's library fusions of reductions and
        # elementwise ops, which makes a row's bits the same in every decode and context bucket (below)
        self.row_tile = (DETERMINISTIC_ROWS if config.enable_deterministic_inference and reference
                         and self.state_split is None and not self.mla_paged and not config.scan_layers
                         and _compiler_options_known(tuple(DETERMINISTIC_XLA_CPU_OPTIONS.items())) else 0)
        if config.enable_deterministic_inference:  # a row's bits never depend on its batch
            round_up = lambda n: -(-n // DETERMINISTIC_ROWS) * DETERMINISTIC_ROWS  # noqa: E731
            if self.row_tile:  # every decode bucket, in whole tiles (two at least); every context bucket; one prefill
                self.decode_buckets = tuple(sorted({max(round_up(n), 2 * DETERMINISTIC_ROWS) for n in self.decode_buckets}))
                self.prefill_buckets = self.prefill_buckets[-1:]  # (k3-small: 1 and 4 prefill rows 5e-7 apart)
            else:  # one program per kind, the largest (row tiles need the CPU reference path on one device)
                self.decode_buckets, self.prefill_buckets, self.context_buckets = (
                    (round_up(self.decode_buckets[-1]),), self.prefill_buckets[-1:], self.context_buckets[-1:])
        # async scheduling: the samples passed on the device from step to step, decode programs' rows first
        self._carry_size = self.decode_buckets[-1] + self.prefill_buckets[-1] if config.async_scheduling else 0
        self._flight: list[_Flight] = []  # launched steps not read back yet (async scheduling)
        self._landed: set[str] = set()  # sequences with outputs from steps read back outside `step()`
        # (request id, error) of requests whose host-side bookkeeping raised this step: only they end (`step`)
        self._host_failures: list[tuple[str, Exception]] = []
        options = StepOptions(self.kda_in_place, self.mla_paged, self.state_split, self.cfg.num_attention_heads,
                              self.spec.verify_tokens if self.spec else 0,
                              KDA_CHUNK if self.layout.state_dtype == "float32" else min(config.prefill_chunk, KDA_CHUNK),
                              self.logits_processors, config.logprobs_mode, config.enable_return_routed_experts,
                              return_hidden=config.enable_return_hidden_states,
                              carry_offset=self.decode_buckets[-1] if self._carry_size else 0,
                              sample_apart=config.async_scheduling, row_tile=self.row_tile)
        # async scheduling: decode programs leave sampling to this one, launched once the step before is read
        # back, so the rows' masks (structured outputs, bad words) see the token it sampled (`_complete`)
        self._sample = (bind_sample(config.max_logprobs, self.logits_processors, arena_sharding, config.logprobs_mode)
                        if config.async_scheduling else None)
        self.mask_words = mask_words(self.cfg.vocab_size)  # int32 words of a structured-output mask row
        self._arena_sharding = arena_sharding
        # the model's weights as update_weights takes them (per layer), before any stacking
        self._param_treedef = jax.tree.structure(model.params)
        self._param_specs = [(x.shape, x.dtype) for x in jax.tree.leaves(model.params)]
        self.layer_scan = scan_plan(config, self.cfg)
        step_params = per_layer = model.params
        # where each per-layer weight is held among the step programs' leaves: (leaf, None), or (stacked leaf,
        # group) for a scanned layer's (adapter slots and moved experts are written per layer either way)
        self._leaf_at = ([(k, None) for k in range(len(self._param_specs))] if self.layer_scan is None
                         else layer_scan.leaf_map(model.params, self.layer_scan))
        if self.layer_scan is not None:  # the scanned layers' weights stacked; the engine keeps no per-layer copy
            step_params = split_params(model.params, self.layer_scan)
            if self._one_device is not None:  # (its placeholders are new arrays: committed as the weights are)
                step_params = jax.device_put(step_params, self._one_device)
            self.model = model = dataclasses.replace(model, params=step_params[0])
            options = dataclasses.replace(options, scan=self.layer_scan)
        self._step_treedef = jax.tree.structure(step_params)
        compiler_options = DETERMINISTIC_XLA_CPU_OPTIONS if self.row_tile else None
        bind = lambda layout: bind_step(model.graphdef, layout, step_params, config.max_logprobs,  # noqa: E731
                                        options, arena_sharding, compiler_options)
        # each running sequence's MLA page table, on the device, written by the entries that changed: one row per
        # sequence of the largest decode and prefill batches together (serve/page_tables.py)
        self.page_tables = PageTables(self.decode_buckets[-1] + self.prefill_buckets[-1], max(1, self.cfg.num_mla_layers),
                                      self.context_buckets[-1], self.layout.scratch_page,
                                      replicated(self.mesh) if self.mesh is not None else None)
        self._build_arena(self.layout, bind)
        # what the step programs take: each weight's shape, dtype and placement (sleep / update_weights)
        self._leaf_specs = [(x.shape, x.dtype, x.sharding if self.mesh is not None else None) for x in self._leaves]
        # LoRA: the step programs' (lora_a, lora_b) leaves with their projections, and what is loaded in which slot
        factor_paths = model_lora.module_paths(per_layer)
        self._lora_leaves = factor_leaves(factor_paths, self._leaf_at)
        self._lora_indices = {i for t in self._lora_leaves for i in (t.a, t.b)}
        # the model's own weights among the per-layer leaves (no adapter factors): what a host store's fingerprint
        # samples, the same whatever adapter slots or layer scan an engine serves them with
        factors = {i for ab in factor_paths.values() for i in ab}
        self._weight_leaves = [k for k in range(len(self._param_specs)) if k not in factors]
        self.loras = Registry(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        # followers of a multi-process engine: the leader's adapters' factors by uid (and chunks still arriving)
        self._adapter_factors: dict[int, dict] = {}
        self._adapter_parts: dict[int, list[bytes]] = {}
        self._named_parts: list[bytes] = []  # chunks of the tensors of a named write (update_weights_from_tensor)
        self.sleep_level = 0  # vLLM's sleep mode: 0 awake, 1 weights on the host, 2 weights discarded
        self.held = False  # `retract`: requests kept, nothing scheduled until `continue_generation`
        self._host_leaves: Optional[list] = None  # level 1: the weights, copied to host memory
        self._weights_stale = False  # woken from level 2 with placeholder weights: update_weights first
        self._stale_written: set = set()  # what update_weights_from_tensor wrote over the placeholders so far
        self._pending_halves: dict = {}  # update_weights_from_tensor: MXFP4 halves waiting for their partner
        self._written = ""  # update_weights_from_tensor: digest of the writes since the origin last moved
        # One-token decode programs by page-table width: where the paged MLA kernel's work follows each row's
        # own length (GPU), a wider table costs only its entries, so decode compiles at the widest bucket
        # alone (K3 at the default buckets: 7 context buckets -> 1 per decode row count); elsewhere (the
        # gathered form, the reference, TPU's grid over every entry) the width is work and each bucket counts.
        self.decode_context_buckets = (self.context_buckets[-1:] if self.mla_paged and decode_work_follows_length()
                                       else self.context_buckets)
        self.sched_cfg = SchedulerConfig(  # (deterministic row tiles may round the decode buckets past max_num_seqs)
            max_num_seqs=min(config.max_num_seqs, self.decode_buckets[-1]), max_prefill_seqs=self.prefill_buckets[-1],
            prefill_chunk=config.prefill_chunk, align=min(config.prefill_chunk, KDA_CHUNK),
            token_budget=config.max_num_batched_tokens,
            page_size=config.page_size, num_mla_layers=self.cfg.num_mla_layers, slot_units=self.layout.slot_units,
            max_loras=config.max_loras, prefill_first=config.prefill_first,
            long_prefill_chunk=config.long_prefill_tokens())
        self.align = self.sched_cfg.align
        self.memory_plan: Optional[MemoryPlan] = None
        if config.sizes_from_memory:
            self._size_arena_from_memory(layout_for, bind)
        self._check_holds_one_request()
        log.info("%s", self.arena_summary())
        if (few := concurrency_note(self.layout, self.sched_cfg.max_num_seqs, self._budget_name())) is not None:
            log.warning("%s", few)
        self.host_transfers = None  # the host tier's jitted copies (serve/host_cache.py)
        self._host_pieces: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # a follower's host copies, by uid
        host = None
        multi = self.mesh is not None and len(mesh_processes(self.mesh)) > 1
        kv = config.kv_transfer_config
        self.kv_role = kv["kv_role"] if kv is not None else None
        if kv is not None:
            if multi:
                raise ValueError("kv_transfer_config: a store is process-local; not available on a multi-process mesh")
            host = kv["store"]
        elif config.host_cache_bytes and config.enable_prefix_caching:
            host = HostCache(config.host_cache_bytes, track_forgotten=multi)
        fingerprint = self._store_fingerprint() if host is not None and not multi else None
        if kv is not None:
            host.bind(fingerprint)
        if host is not None:
            self.host_transfers = Transfers(max(self.layout.slot_units, 4 * max(1, self.cfg.num_mla_layers)),
                                            self.layout.scratch_page,
                                            (self.arena.sharding, self.token_pages.sharding) if self.mesh else None)
        self.prefix_cache = (PrefixCache(self.allocator, self.layout, self.align, PrefixCacheConfig(
            True, config.prefix_hash_unit, config.checkpoint_interval, config.decode_checkpoint_interval),
            host, self._read_units) if config.enable_prefix_caching else None)
        if fingerprint is not None:  # (a store may be shared: see HostEntry.origin)
            self.prefix_cache.origin = fingerprint["weights (checksum)"]
        # holders of MLA units: prefix-cache entries and requests, or (without a cache) requests and forked beams
        self.refs = self.prefix_cache if self.prefix_cache is not None else UnitRefs(self.allocator)
        self._frozen: list[_FrozenSlot] = []  # forked beams' parents, until their children have read them
        self._beams: dict[str, Request] = {}  # beam searches in progress
        self._beam_ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.stop_ids = tuple(self.cfg.eos_token_ids) + tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.stop_ids)
        self.counters = dict(steps=0, decode_steps=0, prefill_steps=0, long_prefill_steps=0, preemptions=0, requests_retracted=0, eplb_rebalances=0,
                             prompt_tokens=0, prompt_tokens_cached=0,
                             generation_tokens=0, requests_finished=0, requests_aborted=0, requests_rejected=0, canonical_rows=0,
                             structured_output_errors=0, structured_output_requests=0,
                             spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                             spec_decode_num_accepted_tokens=0, weight_updates=0, sleeps=0, retractions=0,
                             lora_swaps=0, lora_evictions=0, beam_search_requests=0, beam_forks=0, beam_fork_recomputes=0,
                             kv_transfer_published=0, failed_steps=0, requests_failed=0, cache_resets=0,
                             programs_compiled_ahead=0, steps_launched_ahead=0,
                             spec_decode_num_guessed_drafts=0, spec_decode_num_guesses_right=0,
                             routed_experts_hits_dropped=0, routed_experts_incomplete=0)
        # accepted drafts by position in the draft (vLLM's spec_decode_num_accepted_tokens_per_pos)
        self.spec_accepted_per_pos = np.zeros(self.spec.num_speculative_tokens if self.spec else 0, np.int64)
        self.new_token_ratio = min(0.7 * config.schedule_conservativeness, 1.0)  # admission look-ahead
        self.gate: Optional[DraftGate] = None  # set at warm-up when spec.adaptive (serve/speculative.py)
        self.mask_seconds = 0.0  # host time computing structured-output masks (serve/structured.py)
        # the latest latencies (seconds; `Recent`: bounded, `total` counts every one): ttft / e2e / queue per
        # finished request, itl per step a sequence got tokens in; and the tokens each step ran (prompt and decode)
        self.latency = {k: Recent(LATENCY_SAMPLES) for k in ("ttft", "itl", "e2e", "queue")}
        self.iteration_tokens = BucketCounts(ITERATION_TOKEN_BUCKETS)
        n_moe = sum(1 for l in range(self.cfg.num_hidden_layers) if self.cfg.is_moe(l))
        self.expert_counts = np.zeros((n_moe, self.cfg.num_experts), np.int64)  # [MoE layer, expert]
        self.routes_store: Optional[RoutesStore] = None  # routed ids of cached prefixes (serve/routed_experts.py)
        if config.enable_return_routed_experts:
            if not n_moe:
                raise ValueError("enable_return_routed_experts: this model has no MoE layers, so no routed experts")
            if self.prefix_cache is not None:
                self.routes_store = RoutesStore(math.gcd(self.align, config.prefix_hash_unit),
                                                self._routes_budget(config, n_moe))
        self.eplb: Optional[eplb.ExpertBalancer] = None
        if config.enable_eplb:
            if self._ep_ranks < 2:
                raise ValueError(f"enable_eplb: sharding={config.sharding!r} does not split the {self.cfg.num_experts} "
                                 f"routed experts over a mesh axis (its `experts` rule, on {self.mesh.size} devices)")
            self.eplb = eplb.ExpertBalancer(n_moe, self.cfg.num_experts, self._ep_ranks, config.eplb_window_size,
                                            config.eplb_step_interval, config.eplb_num_redundant_experts)
            self._eplb_leaves = eplb.expert_leaves(self.model.params, config.lora_experts_shared_a)
        self.moe_step_seconds: dict[int, float] = {}  # tokens per step program -> measured MoE time
        self.moe_dispatch_seconds = 0.0
        self.inter_rank_bytes = 0  # expert-parallel all-reduce traffic (see _moe_exchange_bytes)
        self._canonical_pending: dict[str, bytes] = {}  # internal re-prefill rid -> checkpoint key
        self._waiting_head: list[Sequence] = []  # the waiting sequences the last plan saw (`_queue_head`)
        self._ended: set[str] = set()  # ids of requests a sequence of which ended since the last `_reap`
        # the sequences that may wait, as (priority, arrival, place, seq) in that order (`_waiting`: those that no
        # longer wait are dropped when met), their places with their adapters (uid, 0: none) and the entries of each
        # adapter (`waiting_cut`'s `queued`); and the sequences holding a state slot, by id: so a step finds its
        # running and first waiting sequences without walking every request queued
        self._queue: list[tuple] = []
        self._queued: dict[int, int] = {}
        self._queued_loras: collections.Counter = collections.Counter()
        self._running: dict[str, Sequence] = {}
        self._places = itertools.count(1)
        # finished conversations never reused yet, with their adapter
        self._tails: collections.OrderedDict[str, tuple[PrefixHasher, Optional[Adapter]]] = collections.OrderedDict()
        self.warmed_up = False
        self.compiles_after_warmup = 0
        # A mesh over several processes: process 0 leads, the others replay its steps (serve/multihost.py)
        self.channel = None
        if self.mesh is not None and len(mesh_processes(self.mesh)) > 1:
            if mesh_processes(self.mesh) != set(range(jax.process_count())):
                raise ValueError(f"sharding={config.sharding!r}: the mesh holds the devices of processes "
                                 f"{sorted(mesh_processes(self.mesh))} of {jax.process_count()}; a multi-process "
                                 f"mesh must span every process")
            self.channel = StepChannel(lambda rows, t, pages: self._pad_batch(rows, t, pages, []))
            self.channel.check(self._fingerprint())
            if self.channel.leader:
                atexit.register(_close_engine, weakref.ref(self))
        if warmup:
            self.warmup(progress)

    # ---- start-up -----------------------------------------------------------------------------
    def _build_arena(self, layout: ArenaLayout, bind) -> None:
        """The arena of `layout` (zeroed), its allocator, the token-id pages and the step `bind(layout)` binds."""
        self.layout = layout
        self.allocator = Arena(layout)
        self._zeroed_arena()
        self._step, self._leaves = bind(layout)

    def _zeroed_arena(self) -> None:
        """A zeroed arena of the engine's layout and zeroed token-id pages (token ids at each page position of
        the first MLA layer's units: the penalties' history, serve/step.py), made on their devices."""
        whole = replicated(self.mesh) if self.mesh is not None else self._one_device
        self.arena = self.layout.empty(self._arena_sharding or self._one_device)
        self.token_pages = _zeros((self.layout.num_units, self.layout.page_size), np.int32, whole)
        self._carry = (_zeros((self._carry_size,), np.int32, whole)
                       if self._carry_size else None)  # placed as the token pages are (one program signature)
        self.page_tables.reset()  # the pages they named are gone: every sequence writes its table again

    def _resolve_max_model_len(self, config: EngineConfig) -> EngineConfig:
        """`config` with max_model_len "auto" resolved (the longest request the arena holds, at most the model's
        max_position_embeddings); a max_model_len past max_position_embeddings refused as vLLM does."""
        limit = self.cfg.max_position_embeddings
        if config.max_model_len == "auto":
            n = min(limit, longest_request(self.layout, Arena(self.layout).baseline_free_units, self.cfg.num_mla_layers))
            if n < 2:
                raise ValueError(f"max_model_len='auto': the arena of {self._budget_name()} holds no "
                                 f"request (its longest is {n} tokens): give the cache more memory")
            log.info("max_model_len='auto': %d tokens (%s)", n, "the model's max_position_embeddings" if n == limit
                     else f"the longest request the arena of {self._budget_name()} holds")
            return dataclasses.replace(config, max_model_len=n)
        allow = {os.environ.get(k, "").strip().lower() for k in ("K3JAX_ALLOW_LONG_MAX_MODEL_LEN",
                                                                 "VLLM_ALLOW_LONG_MAX_MODEL_LEN")}
        if config.max_model_len > limit and not allow & {"1", "true"}:  # (vLLM's reading of its variable)
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings "
                             f"({limit}), the longest context it was made for; set K3JAX_ALLOW_LONG_MAX_MODEL_LEN=1 "
                             f"to serve longer contexts anyway")
        return config

    def _check_holds_one_request(self) -> None:
        """vLLM's start-up check: the arena must hold one request of `max_model_len` tokens (its state slot and
        the pages of every position but the last), else a long prompt the context window allows could never run."""
        cfg, lay = self.config, self.layout
        need = lay.slot_units + units_for(cfg.max_model_len - 1, self.sched_cfg)
        have = self.allocator.baseline_free_units
        if need <= have:
            return
        longest = longest_request(lay, have, self.cfg.num_mla_layers)
        budget = self._budget_name()
        raise ValueError(f"max_model_len={cfg.max_model_len}: one request that long needs {need} cache units "
                         f"({need * lay.unit_bytes} bytes: its KDA state slot and MLA pages) but the arena of {budget} "
                         f"holds {have}; the longest request it holds is {longest} tokens: lower max_model_len or "
                         f"give the cache more memory")

    def arena_summary(self) -> str:
        """What the arena holds, said at start-up: its units and vLLM's maximum concurrency at max_model_len."""
        return arena_summary(self.layout, self.config.max_model_len, self._budget_name())

    def _budget_name(self) -> str:
        """The option the arena was sized by, with its value (start-up messages)."""
        cfg = self.config
        return (f"num_gpu_blocks_override={cfg.num_gpu_blocks_override}" if cfg.num_gpu_blocks_override is not None
                else f"gpu_memory_utilization={cfg.gpu_memory_utilization}" if cfg.sizes_from_memory
                else f"cache_bytes={cfg.arena_bytes}")

    def _size_arena_from_memory(self, layout_for, bind) -> None:
        """Replace the provisional (smallest) arena by the largest that `gpu_memory_utilization` of each device
        holds beside what is on it now (weights, adapters) and the largest step programs' temporaries, measured
        by compiling those programs against the provisional arena (serve/memory_budget.py). Those two programs
        compile again at warm-up for the final arena (the compilation cache keeps both across starts). On a
        multi-process mesh each process plans from its own devices and all take the smallest arena."""
        devices = [d for d in (self.mesh.devices.flat if self.mesh is not None else self.arena.devices())
                   if d.process_index == jax.process_index()]  # this process's (a multi-process mesh: min below)
        device_memory(devices)  # before compiling: a backend without statistics fails at once
        temp = self._step_temp_bytes()
        jax.block_until_ready(self._leaves)
        stats = device_memory(devices)
        lay = self.layout
        freed = max(sum(s.data.nbytes for x in (self.arena, self.token_pages) for s in x.addressable_shards
                        if s.device == d) for d in devices)  # what the provisional arena holds on the fullest device
        budget = plan_cache_bytes(self.config.gpu_memory_utilization, stats, freed, temp, lay.unit_bytes,
                                  lay.page_size * 4, min_units(lay.slot_units))
        if self.mesh is not None and len(mesh_processes(self.mesh)) > 1:  # one arena for all: the smallest
            units = multihost_utils.process_allgather(np.int32(budget.cache_bytes // lay.unit_bytes))
            budget = dataclasses.replace(budget, cache_bytes=int(np.min(units)) * lay.unit_bytes)
        self.arena = self.token_pages = None  # freed before the real arena is made
        self._build_arena(layout_for(budget.cache_bytes), bind)
        self.memory_plan = budget
        log.info("gpu_memory_utilization=%s: %.2f GiB arena (%d units) beside %.2f GiB in use and %.2f GiB of step "
                 "temporaries per device", budget.utilization, budget.cache_bytes / 2**30, self.layout.num_units,
                 budget.bytes_in_use / 2**30, budget.step_temp_bytes / 2**30)

    def _step_temp_bytes(self) -> int:
        """The largest step programs' temporaries, compiled against the current arena (nothing runs)."""
        return max(self._program_temp_bytes(*shape) for shape in largest_programs(self.bucket_shapes()))

    def _program_temp_bytes(self, rows: int, t: int, pages: int) -> int:
        """The temporaries of one (rows, t, pages) step program. A decode program sampling apart (async
        scheduling) counts its sample program's too: its logits (an output, counted) stay on the device until
        that program has run."""
        batch = self._pad_batch(rows, t, pages, [])
        lowered = self.lower_step(batch)
        n = step_temp_bytes(lowered.compile())
        if self._sample is not None and t == 1:
            logits, table = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in lowered.out_info[2][0])  # [rows, V], [rows, 1, P]
            n += step_temp_bytes(self._sample.lower(self.token_pages, logits, batch.sampling, table,
                                                    self._carry).compile())
        return n

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, pages per layer) program this engine may run."""
        return program_shapes(self.decode_buckets, self.prefill_buckets, self.context_buckets,
                              self.decode_context_buckets, self.config.prefill_chunk,
                              self.spec.verify_tokens if self.spec else 0, self.sched_cfg.long_prefill_chunk)

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket (`compile_threads` at a time) and run each once, on padding rows that touch
        only the scratch slot and page."""
        shapes = self.bucket_shapes()
        batches = [self._pad_batch(rows, t, p, []) for rows, t, p in shapes]
        moe_tokens = (sorted({rows * t for rows, t, _ in shapes})
                      if self.config.measure_moe_time and self.expert_counts.shape[0] else [])
        ahead = self._compile_ahead(batches, moe_tokens, progress)
        self.page_tables.warmup()
        for (rows, t, p), batch in zip(tqdm(shapes, desc="running step buckets" if ahead else "compiling step buckets",
                                            disable=not progress), batches):
            (res, _, _), _ = self._step_fn(batch)
            if self._sample is not None and t == 1:  # the decode program's sample program
                self._sample_fn(*res, batch.sampling)
            if self.channel is not None:
                self.channel.prime((rows, t, p), sample=self._sample is not None and t == 1)
        if self.host_transfers is not None:  # compile the host tier's two copies (on the scratch page)
            pad = [self.layout.scratch_page]
            rows, toks = self.host_transfers.read(self.arena, self.token_pages, pad)
            self.arena, self.token_pages = self.host_transfers.write(self.arena, self.token_pages, pad, rows, toks)
        jax.block_until_ready(self.arena)
        if not self.is_follower and not self.grammars.prepare() and self.tokenizer is not None:
            log.warning("structured outputs unavailable: llguidance is not installed")
        if self.spec is not None and self.spec.adaptive:
            self.gate = DraftGate(self.spec.num_speculative_tokens, self._verify_cost())
        if moe_tokens:
            for n in tqdm(moe_tokens, desc="timing MoE blocks", disable=not progress):
                self.moe_step_seconds[n] = time_moe_blocks(self.model.graphdef, self._step_params(),
                                                           self.cfg.hidden_size, self.model.dtype, n,
                                                           scan=self.layer_scan)
        self.warmed_up = True

    def _compile_ahead(self, batches: list[StepBatch], moe_tokens: list[int], progress: bool) -> bool:
        """Compile the step programs of `batches` and the MoE timing programs (`moe_tokens`) in
        `compile_threads` threads (lowered on the engine's own arrays, nothing runs) -> whether it did.
        The first call of each program then finds it in JAX's compilation cache. Start-up is mostly
        compilation, and a bucket set is tens of programs (decode rows x context pages, prefill rows x
        context pages), each compiled mostly on one core: a many-core host compiles them side by side.
        On the 2-core CPU host, where XLA:CPU's compile already keeps both cores busy, it
        gains little or nothing (benchmarks/startup.py: k3-small's 5 programs 53-62 s in one thread, 58-64 s
        in two)."""
        jobs = [lambda b=b: self.lower_step(b).compile() for b in batches]
        jobs += [lambda n=n: compile_moe_blocks(self.model.graphdef, self._step_params(), self.cfg.hidden_size,
                                                self.model.dtype, n, scan=self.layer_scan) for n in moe_tokens]
        threads = self.config.compile_threads or min(len(jobs), os.cpu_count() or 1, 8)
        if threads <= 1 or len(jobs) <= 1:
            return False
        with ThreadPoolExecutor(threads, thread_name_prefix="k3jax-compile") as pool, \
                tqdm(total=len(jobs), desc=f"compiling programs ({threads} threads)", disable=not progress) as bar:
            for done in as_completed([pool.submit(job) for job in jobs]):
                done.result()
                bar.update()
        self.counters["programs_compiled_ahead"] = len(jobs)
        return True

    def _verify_cost(self, reps: int = 5) -> dict[int, float]:
        """Per decode bucket: a verify step's time over a plain decode step's (medians of `reps`
        alternating runs on padding rows of random tokens, so the MoE routes as real tokens do). Every
        process of a multi-process engine runs the same calls."""
        rng, cost = np.random.default_rng(0), {}
        p = self.decode_context_buckets[0]  # a width both the decode and the verify programs have
        for rows in self.decode_buckets:
            batches = {}
            for t in (1, self.spec.verify_tokens):
                batch = self._pad_batch(rows, t, p, [])
                batch.tokens = rng.integers(0, self.cfg.vocab_size, batch.tokens.shape).astype(np.int32)
                batches[t] = batch
            runs = {t: [] for t in batches}
            for i in range(reps + 1):
                for t, batch in batches.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(self._step_fn(batch))
                    if i:  # the first round warms caches
                        runs[t].append(time.perf_counter() - t0)
            cost[rows] = float(np.median(runs[self.spec.verify_tokens]) / np.median(runs[1]))
        return cost

    def _step_fn(self, batch: StepBatch):
        """Run the compiled step on the engine's cache (updated) -> ((sampled tokens, prompt logprobs, drafts
        accepted), expert counts); a call that grows the jit cache after warm-up counts as a compile.

        The leader of a multi-process engine sends the step (and the page-table entries it writes first) once
        its own launch returned (launches are asynchronous): a launch that raises on the leader alone (device
        memory, an interrupt) is never sent, so no follower runs a program whose collectives wait for it."""
        leader = self.channel is not None and self.channel.leader and self.warmed_up
        quads = self.page_tables.pending_quads()  # the page-table entries the batch's rows lack
        before = self._step._cache_size()
        try:
            if quads is not None:
                self._count_compiles(self.page_tables.apply(quads) > 0, "page-table update")
            if self._carry is not None:
                batch.carry = self._carry  # the latest samples (the batch may have been built before the last step)
            self.arena, self.token_pages, (res, prompt, accepted, carry), counts = self._step(
                self._leaves, self.arena, self.token_pages, self.page_tables.array, batch)
            if leader:
                self._send_forgotten()
                if quads is not None:
                    self.channel.command(TABLES, quads.reshape(-1))
                self.channel.send(batch, batch.tokens.shape + (batch.pages,))
        except BaseException:
            if leader or quads is not None:  # entries may be missing (here or on the followers): every sequence
                self.page_tables.reset()    # writes its table again
            raise
        if carry is not None:  # (a decode program sampling apart returns none: its sample program will)
            self._carry = carry
        self._count_compiles(self._step._cache_size() > before, f"step shape {batch.tokens.shape}")
        return (res, prompt, accepted), counts

    def lower_step(self, batch: StepBatch):
        """The step program of `batch`'s bucket, lowered (tests and benchmarks read its HLO)."""
        return self._step.lower(self._leaves, self.arena, self.token_pages, self.page_tables.array, batch)

    def _routes_budget(self, config: EngineConfig, n_moe: int) -> int:
        """The routes store's bytes: `routed_experts_cache_bytes`, else the ids of every token the arena's MLA
        units and the host tier could hold at once (what the prefix cache can hit)."""
        if config.routed_experts_cache_bytes is not None:
            return config.routed_experts_cache_bytes
        per_token = n_moe * self.cfg.num_experts_per_token * ids_dtype(self.cfg.num_experts).itemsize
        tokens = self.layout.num_units * self.layout.page_size // max(1, self.cfg.num_mla_layers)
        arena = max(1, self.layout.num_units * self.layout.unit_bytes)
        return int(tokens * (1 + config.host_cache_bytes / arena) * per_token)

    def _store_fingerprint(self) -> dict:
        """What engines sharing a host store (`kv_transfer_config`) must agree on for its entries to mean the
        same: the model, its weights (`_weights_digest`), the arena layout and the prefix hashing."""
        return {"model": repr(self.cfg), "weights (checksum)": self._weights_digest(),
                "arena layout": repr(self.layout),
                "prefix hashing (unit, alignment)": (self.config.prefix_hash_unit, self.align)}

    def _weights_digest(self) -> str:
        """The weights a host store's entries are computed with (its fingerprint, `PrefixCache.origin`): a checksum
        of every per-layer weight's whole content (`named_weights.checksum`, on the devices: one read of the weights),
        adapter slots left out, so engines that differ only in `max_loras`, `scan_layers` or sharding (which change
        the step programs' leaves, not what an entry holds) share a store, and any change of any weight (a sample
        of three arrays missed most) tells the weights apart."""
        sums, cpu = [], jax.default_backend() == "cpu"
        for k in self._weight_leaves:
            leaf, group = self._leaf_at[k]
            x = self._leaves[leaf]
            # (read back one by one: a mesh's sums are all-reduces, and on CPU's devices a few hundred of them in
            # flight at once deadlocked; on one CPU device row by row: see `checksum`)
            by_rows = cpu and len(x.sharding.device_set) == 1
            sums.append((tuple(x.shape[group is not None:]), str(x.dtype), int(named_weights.checksum(
                x, None if group is None else np.int32(group), by_rows=by_rows))))
        return hashlib.sha256(repr(sums).encode()).hexdigest()[:16]

    def _fingerprint(self) -> str:
        """What every process of a multi-process engine must agree on (model, config, layout, buckets)."""
        shapes = [(tuple(x.shape), str(x.dtype)) for x in self._leaves]
        return (f"{self.config!r} {self.layout!r} {self.bucket_shapes()} "
                f"params={hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]}")

    # ---- multi-process (serve/multihost.py) ---------------------------------------------------
    @property
    def is_follower(self) -> bool:
        """True on the processes other than 0 of a multi-process engine: they only run `follow()`."""
        return self.channel is not None and not self.channel.leader

    def follow(self) -> int:
        """Follower processes: run the leader's steps until it closes the engine; -> steps run.

        A step that fails here fails on the leader too (same program, same inputs); the follower logs
        it and keeps following, as the leader keeps serving."""
        if not self.is_follower:
            raise RuntimeError("follow() is for processes 1.. of a multi-process engine; process 0 serves")
        if not self.warmed_up:
            raise RuntimeError("warm the engine up (as the leader does) before following")
        n = 0
        unsampled: dict[int, tuple] = {}  # async scheduling: channel step -> (logits, table) of a decode program
        while (got := self.channel.receive()) is not None:
            cmd, batch = got
            try:
                if cmd in (SPILL, RESTORE, FORGET):
                    self._follow_copy(cmd, batch)
                    continue
                if cmd == TABLES:  # the page-table entries the leader's next step writes first
                    self.page_tables.apply(batch.reshape(4, -1))
                    continue
                if cmd == EPLB:  # the experts the leader moves before its next step: rows (layer, placement)
                    rows = batch.reshape(-1, 1 + self.eplb.placement.shape[1])
                    self._move_experts({int(r[0]): r[1:].copy() for r in rows}, {})
                    continue
                if cmd == SLEEP:  # (level, weights?, kv_cache?)
                    self._release_device_memory(int(batch[0]), frozenset(
                        t for t, on in zip(("weights", "kv_cache"), batch[1:3]) if on))
                    continue
                if cmd == WAKE:
                    self._take_back_device_memory({t for t, on in zip(("weights", "kv_cache"), batch) if on})
                    continue
                if cmd == UPDATE:  # every process loads the checkpoint and installs it where all could
                    self._load_weights_together(payload_text(batch))
                    continue
                if cmd == ADAPTER:
                    self._receive_adapter(batch)
                    continue
                if cmd in (NAMED_WRITE, NAMED_READ):
                    self._receive_named(cmd, batch)
                    continue
                if cmd == LORA:
                    slot, uid = batch.tolist()
                    self._write_lora_factors(slot, self._adapter_factors[uid] if uid else {})
                    continue
                if cmd == LORA_DROP:
                    self._adapter_factors.pop(int(batch[0]), None)
                    continue
                if cmd == SAMPLE:  # the leader samples a decode step launched earlier (`_complete`)
                    step, sampling = batch
                    for k in [k for k in unsampled if k < step]:  # steps the leader never sampled (failed)
                        del unsampled[k]
                    if step not in unsampled:
                        raise RuntimeError(f"no logits kept for step {step} (it failed here)")
                    self._sample_fn(*unsampled.pop(step), sampling)
                    continue
                (res, _, _), _ = self._step_fn(batch)
                if self._sample is not None and batch.tokens.shape[1] == 1:  # sampled apart: keep its logits
                    unsampled[self.channel.steps] = res
            except Exception:
                log.exception("step %d failed on process %d", n, self.channel.process)
                self._renew_arena_if_lost()  # as the leader does (serve/engine.py Engine._step_failed)
            n += 1
        jax.block_until_ready(self.arena)
        return n

    def _follow_copy(self, cmd: int, payload: np.ndarray) -> None:
        """A follower's part of a host-tier copy: keep, write back or drop its pieces of the entries."""
        if cmd == FORGET:
            for uid in payload.tolist():
                self._host_pieces.pop(uid, None)
            return
        n = int(payload[0])
        units = payload[1:1 + n].tolist()
        segments = payload[1 + n:].reshape(-1, 2).tolist()  # (uid, units)
        if cmd == SPILL:
            rows, toks = self.host_transfers.read(self.arena, self.token_pages, units)
            at = 0
            for uid, k in segments:
                self._host_pieces[uid] = (own_rows(rows, at, k), own_rows(toks, at, k))
                at += k
        else:
            pieces = [self._host_pieces[uid] for uid, _ in segments]
            self.arena, self.token_pages = self.host_transfers.write(
                self.arena, self.token_pages, units, np.concatenate([r for r, _ in pieces]),
                np.concatenate([t for _, t in pieces]))

    def _send_adapter(self, adapter: Adapter) -> None:
        """The leader sends a loaded adapter's factors (host arrays, as npz bytes, in chunks of ADAPTER_CHUNK) to the
        followers, which keep them by uid until LORA_DROP: every process writes them into its own slot shards."""
        buf = io.BytesIO()
        np.savez(buf, **{f"{m}|{i}": x for m, pair in adapter.factors.items() for i, x in enumerate(pair)})
        self._send_in_chunks(ADAPTER, [adapter.uid], buf.getvalue())

    def _send_in_chunks(self, cmd: int, head: list[int], raw: bytes) -> None:
        """The leader sends `raw` to the followers as `cmd` messages of ADAPTER_CHUNK bytes each, headed
        `[*head, chunk, chunks]` (a payload may exceed one message)."""
        n = max(1, -(-len(raw) // ADAPTER_CHUNK))
        for k in range(n):
            self.channel.command(cmd, bytes_payload([*head, k, n], raw[k * ADAPTER_CHUNK:(k + 1) * ADAPTER_CHUNK]))

    def _receive_adapter(self, payload: np.ndarray) -> None:
        """A follower's part of `_send_adapter`: one chunk; the last one makes the factors."""
        (uid, k, n), raw = payload_bytes(payload, 3)
        parts = self._adapter_parts.setdefault(uid, [])
        parts.append(raw)
        if k < n - 1:
            return
        data = np.load(io.BytesIO(b"".join(self._adapter_parts.pop(uid))))
        factors: dict[str, list] = {}
        for key in data.files:
            module, i = key.rsplit("|", 1)
            factors.setdefault(module, [None, None])[int(i)] = data[key]
        self._adapter_factors[uid] = {m: tuple(pair) for m, pair in factors.items()}

    def _send_copy(self, cmd: int, units: list[int], segments: list[tuple[int, int]]) -> None:
        """The leader of a multi-process engine names a host-tier copy to the followers, then the entries
        its store dropped since the last one. In that order: a restore may read entries the store has just
        dropped (the host copies of pages a request takes back onto the device are discarded as it is
        admitted, before its restore runs), and a spill may name entries the store refused at once."""
        if self.channel is None or not self.channel.leader:
            return
        self.channel.command(cmd, np.asarray([len(units), *units, *[x for seg in segments for x in seg]], np.int32))
        self._send_forgotten()

    def _send_forgotten(self) -> None:
        """The leader tells the followers which host entries its store dropped (they free their pieces)."""
        host = self.prefix_cache.host if self.prefix_cache is not None else None
        if host is not None and host.forgotten:
            self.channel.command(FORGET, np.asarray(host.forgotten, np.int32))
            host.forgotten.clear()

    def close(self) -> None:
        """Release the follower processes of a multi-process engine (a no-op otherwise); after it the
        leader can no longer step. Also run at interpreter exit."""
        if self.channel is not None and self.channel.leader:
            self.channel.close()

    def idle(self) -> None:
        """Call when there is nothing to step (the async engine does): an idle multi-process engine pings its
        followers now and then (serve/multihost.py), which shows them the leader alive."""
        if self.channel is not None and self.channel.leader and not self.channel.closed:
            self.channel.keepalive()

    def _leader_only(self, what: str) -> None:
        """Refuse what only an open leader may do: a follower, or a leader whose `close()` released the followers
        (a step launched then would wait for them forever: the leader launches before it sends)."""
        if self.is_follower:
            raise RuntimeError(f"{what}: process {self.channel.process} follows process 0's steps "
                               f"(call follow()); requests go to process 0")
        if self.channel is not None and self.channel.closed:
            raise RuntimeError(f"{what}: this multi-process engine was closed (close() released its follower "
                               f"processes); build a new one")

    def _warmed_together(self, what: str) -> None:
        """Refuse, on a multi-process leader not warmed up yet, what runs device programs every process must run
        alike (a step, an expert move, a weight update or read and its verdicts): the followers replay them only
        from `follow()`, after their own warm-up, so one run before would run on the leader alone (its collectives
        waiting for processes still compiling, or its experts placed apart from theirs)."""
        if self.channel is not None and self.channel.leader and not self.warmed_up:
            raise RuntimeError(f"{what}: this multi-process engine is not warmed up; call warmup() first (every "
                               f"process warms up, then process 0 serves and the others follow)")

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None, priority: int = 0, cache_salt: Optional[str] = None,
                    lora_request=None) -> str:
        """Queue a request; `priority`: lower values are scheduled first and may preempt running
        requests of higher values (vLLM's convention); equal priorities are first come, first served.
        `cache_salt` (vLLM's): only requests with the same salt share cached prefixes (tenants that must
        not learn from each other's cache hits use different salts). `lora_request`: the adapter to run
        with, by name or as a `LoRARequest` (loaded from its path on first use); None: the base model.
        `params` may be a `BeamSearchParams` (serve/beam_search.py): the request then runs a beam search
        and finishes with its `beam_width` best hypotheses, best first. `arrival_time` (vLLM's): when the request
        arrived, as `time.time()` (default: now), for its queue time, TTFT and latency metrics; the queue's
        order among equal priorities stays the order of `add_request` calls (vLLM's default FCFS queue)."""
        self._leader_only("add_request")
        self._check_awake("add_request")
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        beam = None
        try:
            if not isinstance(params, (SamplingParams, BeamSearchParams)):  # (a dict, another library's params)
                raise RequestError(f"sampling_params: expected serve.types.SamplingParams (or BeamSearchParams), "
                                   f"got {type(params).__module__}.{type(params).__name__}")
            if isinstance(params, BeamSearchParams):
                params.validate(self.config.max_logprobs)
                if self.config.logprobs_mode.endswith("_logits"):
                    raise RequestError(f"beam_width: beams are ranked by summed logprobs, but this engine returns "
                                       f"logits (logprobs_mode={self.config.logprobs_mode!r})")
                if params.beam_width > self.sched_cfg.max_num_seqs:
                    raise RequestError(f"beam_width: {params.beam_width} beams exceed max_num_seqs="
                                       f"{self.sched_cfg.max_num_seqs}, the most sequences a step decodes")
                beam, params = params, params.step_params()
            if request_id in self.requests:
                raise RequestError(f"request_id: {request_id!r} is already in use")
            if (not isinstance(priority, numbers.Integral) or isinstance(priority, bool)
                    or abs(priority) >= INTERNAL_PRIORITY):
                raise RequestError(f"priority: must be an integer of magnitude < {INTERNAL_PRIORITY}, got {priority!r}")
            priority = int(priority)  # (a NumPy integer: LLM.generate(priority=np.array(...)))
            if priority and self.config.scheduling_policy == "fcfs":
                raise RequestError(f"priority: got {priority}, but this engine schedules first come, first served "
                                   f"(scheduling_policy='fcfs'; 'priority' honours it)")
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > 256):
                raise RequestError("cache_salt: must be a non-empty string of at most 256 characters")
            text, ids, embeds = self._prompt(prompt)
            params.validate(self.cfg.vocab_size, self.config.max_logprobs)
            if params.return_hidden_states and not self.config.enable_return_hidden_states:
                raise RequestError("return_hidden_states: this engine was started without "
                                   "enable_return_hidden_states (--enable-return-hidden-states)")
            logits_processors.check_request(self.logits_processors, params.extra_args)
            keep = params.truncate_prompt_tokens
            keep = self.config.max_model_len if keep == -1 else keep  # (vLLM's -1: the context window)
            if keep is not None and keep > self.config.max_model_len:
                raise RequestError(f"truncate_prompt_tokens: {keep} exceeds the context window of "
                                   f"{self.config.max_model_len} tokens")
            if keep is not None and len(ids) > keep:
                text, ids = None, ids[-keep:]
                embeds = embeds[-keep:] if embeds is not None else None
            if embeds is not None:
                self._check_embeds_params(params)
            if params.penalized and not self.cfg.num_mla_layers:
                raise RequestError("presence_penalty, frequency_penalty, repetition_penalty: this model has no "
                                   "MLA layers, whose pages hold the token history the penalties need")
            if params.min_tokens and len(set(params.stop_token_ids) | set(self.stop_ids)) > MIN_TOKENS_STOP_IDS:
                raise RequestError(f"stop_token_ids: at most {MIN_TOKENS_STOP_IDS} stop tokens (with EOS) when "
                                   f"min_tokens is set")
            check_min_tokens_allowed(params, self.stop_ids)
            window = self.config.max_model_len
            if len(ids) > window:
                raise RequestError(f"prompt: {len(ids)} prompt tokens exceed the context window of {window} tokens")
            if beam is not None and len(ids) + params.max_tokens > window:
                raise RequestError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                   f"context window of {window} tokens")
            # vLLM's: generation ends ("length") where the window does, whatever max_tokens asks (the HTTP server
            # refuses such a request itself, with OpenAI's error, as vLLM's does)
            max_tokens = min(params.max_tokens or window, window - len(ids))
            if max_tokens < 1:
                raise RequestError(f"prompt: {len(ids)} prompt tokens leave no room for a completion in the context "
                                   f"window of {window} tokens")
            # the cache holds every position but the last token's (sampled, never fed back); the n samples of a
            # request are scheduled apart (one may wait for another), a beam search's beams run together
            need = self.layout.slot_units + units_for(len(ids) + max_tokens - 1, self.sched_cfg)
            width = beam.beam_width if beam is not None else 1
            if need * width > self.allocator.baseline_free_units:
                raise RequestError(f"request needs {need * width} cache units but the arena has "
                                   f"{self.allocator.baseline_free_units}; it can never fit")
            guides = ([self.grammars.guide(params.structured_outputs) for _ in range(params.n)]
                      if params.structured_outputs is not None else [None] * params.n)
            bad_words = self._bad_word_ids(params.bad_words) if params.bad_words else ()
            adapter = self._resolve_lora(lora_request)
        except RequestError:
            self.counters["requests_rejected"] += 1
            raise
        self.counters["structured_output_requests"] += params.structured_outputs is not None
        now = time.monotonic()  # (the metrics' clock)
        if arrival_time is not None:  # vLLM's: a wall-clock time.time() of when the request arrived
            now -= max(0.0, time.time() - arrival_time)
        metrics = RequestMetrics(arrival_time=now)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2 ** 62))
        config_unit = self.config.prefix_hash_unit
        # an adapter changes every cached page and state: its requests share prefixes only among
        # themselves, and only with this load of it (the uid), never with the base model's
        # (prompt embeds: placeholder ids, the vectors themselves decide what may be shared)
        salt = prefix_salt(cache_salt, adapter.uid if adapter is not None else None,
                           prompt_embeds.digest(embeds) if embeds is not None else None)
        # suffix decoding drafts only from responses of the same salt and adapter
        tenant = prefix_salt(cache_salt, adapter.uid if adapter is not None else None, None)
        group = (BeamGroup(beam, len(ids), frozenset() if beam.ignore_eos else frozenset(self.stop_ids), [])
                 if beam is not None else None)
        self.counters["beam_search_requests"] += group is not None
        seqs = []
        for i in range(1 if group is not None else params.n):  # a beam search starts from one sequence
            seq = Sequence(rid=f"{request_id}#{i}", request_id=request_id, index=i, order=next(self._order),
                           priority=priority, guide=guides[i], bad_words=bad_words,
                           prompt_ids=list(ids), params=params, seed=base_seed + i,
                           checker=StopChecker(params, self.tokenizer if params.detokenize else None,
                                               self.stop_ids, max_tokens),
                           metrics=metrics if group is not None else RequestMetrics(arrival_time=now),
                           prompt_lps=[None] * len(ids) if params.prompt_logprobs is not None and i == 0 else None,
                           pages=[[] for _ in range(self.cfg.num_mla_layers)],
                           hasher=PrefixHasher(config_unit, salt) if self.prefix_cache else None, lora=adapter,
                           embeds=embeds, beam=group, tenant=tenant)
            if self.config.enable_return_routed_experts and group is None:  # (beam hypotheses carry none)
                seq.routes = SequenceRoutes(self.expert_counts.shape[0], self.cfg.num_experts_per_token,
                                            ids_dtype(self.cfg.num_experts), len(ids) + 16)
            if params.return_hidden_states:
                seq.hidden = PositionRows((self.cfg.hidden_size,), np.float32, np.nan, len(ids) + 16)
            seqs.append(seq)
        self._register(Request(request_id, text, list(ids), params, seqs, metrics, group, embeds is not None))
        return request_id

    def _register(self, req: Request) -> None:
        """Make a built request known: the request first, then its sequences, so that a Ctrl-C between any two
        of these lines leaves nothing `abort(request_id)` misses (a sequence without its request was scheduled,
        and its output's lookup failed every later step)."""
        self.requests[req.request_id] = req
        for seq in req.seqs:
            if seq.lora is not None:
                seq.lora.requests.add(seq.rid)
            self._seat(seq)
        if req.beam is not None:
            self._beams[req.request_id] = req

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenisation of bad words: each as written (left-stripped) and, when that makes
        different tokens of the same count, with a leading space."""
        if self.tokenizer is None:
            raise RequestError("bad_words: this model has no tokenizer")
        out = []
        for w in words:
            try:
                plain = tuple(self.tokenizer.encode(w.lstrip()))
            except UnicodeEncodeError as e:  # a lone surrogate: no text to tokenize
                raise RequestError(f"bad_words: {w!r} is not valid Unicode text ({e.reason})") from None
            out.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + w.lstrip()))
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        tokens = sum(map(len, out))
        if tokens > MAX_BAD_WORD_TOKENS:
            raise RequestError(f"bad_words: at most {MAX_BAD_WORD_TOKENS} tokens in all (each word's leading-space "
                               f"variant included), got {tokens}")
        return tuple(w for w in out if w)

    def _prompt(self, prompt) -> tuple[Optional[str], list[int], Optional[np.ndarray]]:
        """A string, token ids, or vLLM's prompt dicts (`{"prompt": str}`, `{"prompt_token_ids": [...]}`,
        `{"prompt_embeds": [L, H]}`) -> (text, ids, embeddings); an embeddings prompt has L placeholder ids."""
        if isinstance(prompt, dict):
            if sorted(prompt) not in (["prompt"], ["prompt_token_ids"], ["prompt_embeds"]):
                raise RequestError(f"prompt: a prompt dict holds 'prompt' (text), 'prompt_token_ids' or "
                                   f"'prompt_embeds', got keys {sorted(prompt)}")
            if "prompt_embeds" in prompt:
                if not self.config.enable_prompt_embeds:
                    raise RequestError("prompt_embeds: this engine was started without enable_prompt_embeds "
                                       "(--enable-prompt-embeds)")
                embeds = prompt_embeds.as_prompt_embeds(prompt["prompt_embeds"], self.cfg.hidden_size,
                                                        self.model.dtype)
                return None, [0] * len(embeds), embeds
            (key, prompt), = prompt.items()
            if (key == "prompt") != isinstance(prompt, str):  # text under 'prompt', ids under 'prompt_token_ids'
                raise RequestError(f"{key}: expected {'a string' if key == 'prompt' else 'a list of token ids'}, "
                                   f"got {type(prompt).__name__}")
        return (*self._prompt_ids(prompt), None)

    def _check_embeds_params(self, params) -> None:
        """What an embeddings prompt cannot do: its token ids are placeholders."""
        if params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs: a prompt given as embeddings has no tokens to score")
        if params.repetition_penalty != 1:
            raise RequestError("repetition_penalty: it counts the prompt's tokens, and a prompt given as "
                               "embeddings has none (presence and frequency penalties count generated tokens)")

    def _prompt_ids(self, prompt) -> tuple[Optional[str], list[int]]:
        """A string or token ids (a list, or a 1-D NumPy, JAX or torch array)."""
        if not isinstance(prompt, (str, list, tuple)) and hasattr(prompt, "__array__"):
            prompt = np.asarray(prompt)
            if prompt.ndim != 1:
                raise RequestError(f"prompt: token ids must be a 1-D array, got shape {prompt.shape}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: this model has no tokenizer; pass token ids")
            # a prompt's text is the caller's whole input, often a chat rendered by the client: the text of a
            # special token is that token, as the Kimi tokenizers (and vLLM with them) read it; chat messages are
            # encoded by serve/chat.py, which keeps such text in a message's content plain
            check_text(prompt, "prompt")  # (a lone surrogate: UnicodeEncodeError, naming no field)
            ids = self.tokenizer.encode(prompt, allow_special=True)
            text = prompt
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            try:  # integers only (int() would truncate 1.5, or fail naming no field)
                ids, text = [operator.index(t) for t in prompt], None
            except TypeError:
                wrong = next((t for t in prompt if not hasattr(t, "__index__")), prompt)
                raise RequestError(f"prompt: token ids must be integers, got {wrong!r}") from None
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(f"prompt: token id {bad[0]} is outside [0, {self.cfg.vocab_size})")
        else:
            raise RequestError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt: empty prompt")
        return text, ids

    # ---- LoRA adapters ----------------------------------------------------------------------------
    def _resolve_lora(self, lora_request) -> Optional[Adapter]:
        """A request's adapter: one held, or registered with requests waiting for it, as it is; one to load (a
        `LoRARequest`'s new directory, or one dropped from host memory) read now where host memory has room,
        else registered unread (its directory checked) and read when the request is admitted (`max_cpu_loras`
        holds: vLLM reads adapters when it schedules their requests)."""
        if lora_request is None:
            return None
        if not self.config.max_loras:
            raise RequestError("lora_request: this engine serves no LoRA adapters (start it with max_loras >= 1)")
        name, path, int_id = lora_request, "", 0
        if isinstance(lora_request, LoRARequest):
            name, path, int_id = lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id
        if path:  # (a registration no request read: this load takes its place)
            self.loras.forget_unread(name)
        known = self.loras.by_name.get(name) if isinstance(name, str) else None
        if known is not None and (known.factors is not None or (known.requests and path in ("", known.path))):
            return known
        if known is None and not path:
            loaded = ", ".join(sorted(self.loras.by_name)) or "none"
            raise RequestError(f"lora_request: no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        request = LoRARequest(name, int_id if path else known.int_id, path or known.path)
        try:
            if self.loras.has_room(self._running_adapters()):
                return self._read_for_request(request)
            return self._register_unread(request)
        except LoRAError as e:
            if path:
                raise RequestError(f"lora_request: {e}") from None
            raise RequestError(f"lora_request: adapter {name!r} was dropped from host memory (max_cpu_loras) and "
                               f"could not be read again: {e}") from None

    def _running_adapters(self, internal: bool = False) -> set:
        """The adapters of the requests admitted and not finished (their rows hold slots), which host memory keeps;
        `internal`: those of the prefix cache's own rows too (unloading an adapter ends these rows). From `_running`
        (every row holding a slot): walking every request queued made each LoRA admission cost host time growing
        with the queue."""
        return {s.lora for s in self._running.values()
                if s.lora is not None and s.slot is not None and not s.finished and (internal or not s.internal)}

    def _register_unread(self, request: LoRARequest) -> Adapter:
        """A request's adapter when host memory has no room now (every held adapter serves running requests): its
        name and directory checked, registered unread; `_read_admitted` reads it once its request is admitted."""
        self._lora_room(request.lora_name, request.lora_path, spill=True)
        if not self.loras.can_ever_hold():
            raise LoRAError(f"max_cpu_loras={self.loras.capacity} adapters loaded from tensors fill host memory "
                            f"({', '.join(sorted(a.name for a in self.loras.held()))}); unload one first")
        check_peft_dir(request.lora_path)
        self.loras.by_name.pop(request.lora_name, None)  # (a dropped registration of this name: this load's place)
        return self.loras.add(request.lora_name, request.lora_path, 0, None, request.lora_int_id)

    def _read_admitted(self, adapter: Adapter, running: set) -> None:
        """Read an adapter not in host memory whose request is being admitted, first dropping held adapters that
        no running request uses (`running`: the adapters of rows holding slots, the prefix cache's included) to
        stay within max_cpu_loras. Only when the held ones are all running or loaded from tensors is it held
        beyond. Raises LoRAError (its directory changed since)."""
        victim = self.loras.victim(running, spill=True)
        while victim is not None:
            self._drop_from_host(victim)
            victim = self.loras.victim(running, spill=True)
        adapter.rank, adapter.factors = self._read_adapter(lambda *a: read_peft(adapter.path, *a))
        if self.channel is not None:
            self._send_adapter(adapter)

    def _drop_from_host(self, adapter: Adapter) -> None:
        """`adapter` (no row holding a slot uses it: nothing in flight reads its slot) leaves its slot and host
        memory; requests waiting for it read it again when admitted (the same load: its cached prefixes stay)."""
        self.loras.drop(adapter)
        for rid in [r for r, (_, a) in self._tails.items() if a is adapter]:
            del self._tails[rid]
        self.counters["lora_evictions"] += 1
        if self.channel is not None:
            self.channel.command(LORA_DROP, np.asarray([adapter.uid], np.int32))

    def add_lora(self, lora_request: LoRARequest) -> Adapter:
        """Load a PEFT adapter directory into a free slot (vLLM's `add_lora`): its factors are checked
        against the model's projections before anything is written; no compile. Raises `LoRAError`."""
        return self._load_adapter("add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path,
                                  lambda *a: read_peft(lora_request.lora_path, *a),
                                  replace=getattr(lora_request, "load_inplace", False))

    def _read_for_request(self, lora_request: LoRARequest) -> Adapter:
        """`add_lora` for a request naming the adapter, where host memory has room (`_resolve_lora`)."""
        return self._load_adapter("lora_request", lora_request.lora_name, lora_request.lora_int_id,
                                  lora_request.lora_path, lambda *a: read_peft(lora_request.lora_path, *a), spill=True)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict,
                                       lora_int_id: int = 0) -> Adapter:
        """SGLang's `load_lora_adapter_from_tensors`: an adapter from tensors in memory, named as PEFT saves them
        (`[(name, tensor), ...]` or a dict; numpy, JAX or torch, bf16 included) with its PEFT config as a dict,
        the same checks and slots as `add_lora`; what an RL trainer pushes after each step (unload the previous
        version first, as SGLang's clients do). Raises `LoRAError`."""
        from serve.named_weights import as_numpy  # noqa: PLC0415

        items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
        try:
            named = {str(n): as_numpy(t) for n, t in items}
        except (TypeError, ValueError) as e:
            raise LoRAError(f"tensors: expected (name, tensor) pairs or a dict of tensors ({e})") from None
        return self._load_adapter("load_lora_adapter_from_tensors", lora_name, lora_int_id, "",
                                  lambda *a: parse_peft(config_dict, named, *a, cfg_where="config_dict"))

    def _load_adapter(self, what: str, name, int_id: int, path: str, read, spill: bool = False,
                      replace: bool = False) -> Adapter:
        """`spill`: a request needs the adapter (`_read_for_request`): no LoRAError when none can go. `replace`
        (vLLM's load_inplace): the adapter loaded under `name` goes once the new one has been read. A registration
        of `name` whose requests wait for it (dropped, or registered unread) takes the factors (the same load)."""
        self._leader_only(what)
        # the weights' adapter slots must be there; the KV cache need not be (an RL loop resumes the weights,
        # syncs its adapter, then resumes the cache); base weights still to be loaded after sleep(2) are fine
        self._weights_present(what, stale_ok=True)
        # raises when none can go (unless spill), or the name is in use, before reading anything
        victim = self._lora_room(name, path, spill, replace)
        known = self.loras.by_name.get(name)
        rank, factors = self._read_adapter(read)
        if replace and known is not None:  # read: the old load goes (its cached prefixes with it: a new uid)
            self.remove_lora(name)
            known, victim = None, self.loras.victim(self._running_adapters(), spill=True)
        while victim is not None:  # (more than one after a spill: back within max_cpu_loras as far as requests allow)
            self._unload_adapter(victim)
            self.counters["lora_evictions"] += 1
            victim = self.loras.victim(self._running_adapters(), spill=True)
        if known is not None and known.requests:  # its waiting requests' registration: read in place
            known.rank, known.factors, adapter = rank, factors, known
        else:
            if known is not None:  # a dropped registration of this name: this load takes its place
                del self.loras.by_name[name]
            adapter = self.loras.add(name, path, rank, factors, int_id, spill=True)
        if self.channel is not None:
            self._send_adapter(adapter)
        if len(self.loras.in_slot) < self.loras.slots:  # a free slot: take it now (else when first needed)
            self._write_lora(self.loras.place(adapter, set()), adapter)
        return adapter

    def _read_adapter(self, read) -> tuple[int, dict]:
        """`read(shapes, max_rank, prefix, targets, experts)` (`read_peft` / `parse_peft`) against this model's
        adapter slots -> (rank, factors)."""
        shapes = {m: (self._leaves[t.b].shape[-1], self._leaves[t.a].shape[-2 if t.experts else -3])
                  for t in self._lora_leaves for m in t.modules}  # (out, in)
        experts = {m: (self.cfg.num_experts, self.config.lora_experts_shared_a)
                   for t in self._lora_leaves if t.experts for m in t.modules}  # (experts, shared A)
        prefix = "language_model." if self.cfg.family == "kimi_k3" else ""
        return read(shapes, self.config.max_lora_rank, prefix, self.config.lora_target_modules, experts)

    def _lora_room(self, name, path: Optional[str] = None, spill: bool = False,
                   replace: bool = False) -> Optional[Adapter]:
        """Whether adapter `name` (from `path`) can be loaded now -> the held adapter its load drops (None: there
        is room, or with `spill` none can go, or it replaces the adapter of its name); LoRAError when the name is
        bad or loaded already (unless `replace`: while requests use it), or (unless `spill`) no held adapter can
        be dropped. A name dropped from host memory (max_cpu_loras) is still registered: only its own directory
        reads it again."""
        if not self.config.max_loras:
            raise LoRAError("this engine serves no LoRA adapters (start it with max_loras >= 1)")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise LoRAError(f"lora_name {name!r}: expected a non-empty string of at most 256 characters")
        self.loras.forget_unread(name)  # (a registration no request read: this load takes its place)
        known = self.loras.by_name.get(name)
        if known is not None and replace:  # (its victims are found once it is unloaded)
            self.loras.check_unused(name, besides=self._canonical_rids(known))
            return None
        if known is not None and (known.factors is not None or path != known.path):
            raise LoRAError(f"lora_name {name!r}: an adapter of that name is loaded already"
                            + ("" if known.factors is not None else f" (from {known.path!r}, dropped from host "
                               "memory and read again on use): unload it first"))
        return self.loras.victim(self._running_adapters(), spill)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (vLLM's `remove_lora`); refused while requests use it. Its slot is zeroed
        and its cached prefixes can never be hit again (their hashes name this load of it)."""
        self._leader_only("remove_lora")
        self._drain()
        adapter = self.loras.get(name)
        self.loras.check_unused(name, besides=self._canonical_rids(adapter))  # before their work is thrown away
        if adapter.factors is not None:
            self._unload_adapter(adapter)
        self.loras.remove(name)

    def _canonical_rids(self, adapter: Optional[Adapter] = None) -> set:
        """The prefix cache's own rows in flight (of `adapter`, or of any): unloading their adapter ends them."""
        return {s.rid for s in self.seqs.values()
                if s.internal and not s.finished and s.lora is not None and (adapter is None or s.lora is adapter)}

    def _unload_adapter(self, adapter: Adapter) -> None:
        """`adapter` leaves its slot (zeroed) and host memory: the prefix cache's rows with it end, its cached
        prefixes can never be hit again (their hashes name this load of it), followers forget its factors."""
        self._drain()
        for rid in self._canonical_rids(adapter):
            self._finish(self.seqs[rid], "abort")
        slot = adapter.slot
        self.loras.drop(adapter)
        for rid in [r for r, (_, a) in self._tails.items() if a is adapter]:
            del self._tails[rid]
        if self._leaves is not None and slot is not None:
            self._write_lora(slot, None)
        if self.channel is not None:
            self.channel.command(LORA_DROP, np.asarray([adapter.uid], np.int32))

    def list_loras(self) -> list[str]:
        return sorted(self.loras.by_name)

    @property
    def lora_bytes(self) -> int:
        """Bytes of every projection's adapter factors, all slots (fixed at start-up)."""
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for i, (s, d, _) in enumerate(self._leaf_specs)
                   if i in self._lora_indices)

    def _place_adapters(self, admitted: list[str]) -> dict[str, LoRAError]:
        """Give the adapters of the requests just admitted a device slot, swapping one in from host memory
        where needed (the scheduler kept the running requests' adapters within the slots), read first where host
        memory does not hold it (`_read_admitted`). -> {admitted row: the error} of adapters that failed to read."""
        need = [self.seqs[r].lora for r in admitted if self.seqs[r].lora is not None]
        if not need:
            return {}
        busy = self._running_adapters(internal=True)  # (the admitted rows' included: they hold slots)
        failed: dict[Adapter, LoRAError] = {}
        for adapter in need:
            if adapter in failed:
                continue
            if adapter.factors is None:
                try:
                    self._read_admitted(adapter, busy)
                except LoRAError as e:
                    failed[adapter] = e
                    continue
            slot = self.loras.place(adapter, busy)
            if slot is not None:
                self._write_lora(slot, adapter)
                self.counters["lora_swaps"] += 1
        return {r: failed[self.seqs[r].lora] for r in admitted if self.seqs[r].lora in failed}

    def _write_lora(self, slot: int, adapter: Optional[Adapter]) -> None:
        """Write one slot of every projection's factors: `adapter`'s (zeros where it has no entry; None: all
        zeros). The leader of a multi-process engine first names the slot and adapter to the followers."""
        if self.channel is not None and self.channel.leader:
            self.channel.command(LORA, np.asarray([slot, adapter.uid if adapter is not None else 0], np.int32))
        self._write_lora_factors(slot, adapter.factors if adapter is not None else {})

    def _write_lora_factors(self, slot: int, factors: dict) -> None:
        if self.mesh is not None:  # one replicated value on every device of the mesh (every process: the same)
            factors = {m: tuple(put(x, replicated(self.mesh)) for x in pair) for m, pair in factors.items()}
        leaves = list(self._leaves)
        for t in self._lora_leaves:
            pairs = [factors.get(m, (None, None)) for m in t.modules]
            if t.experts and self.eplb is not None:  # each physical expert (moved, copied) takes its expert's rows
                pairs = [self._physical_factors(m, a, b) for m, (a, b) in zip(t.modules, pairs)]
            a, b = model_lora.stack_slot(pairs, leaves[t.a], leaves[t.b], t.experts) if t.stacked else pairs[0]
            write = model_lora.write_expert_slot if t.experts else model_lora.write_slot
            leaves[t.a], leaves[t.b] = write(leaves[t.a], leaves[t.b], slot, a, b)
        self._set_leaves(leaves)

    def _physical_factors(self, module: str, a, b) -> tuple:
        """A routed-expert matrix's slot contents by logical expert (A [E or 1, in, R], B [E, R, out]) -> by physical
        expert under the layer's current EPLB placement (a shared A as it is)."""
        if b is None:
            return a, b
        layer = int(module.split(".")[1])
        moe = [l for l in range(self.cfg.num_hidden_layers) if self.cfg.is_moe(l)]
        at = np.asarray(self.eplb.placement[moe.index(layer)])  # [P]: the expert each physical place holds
        return (a if a.shape[0] == 1 else a[at]), b[at]

    def abort(self, request_id: str) -> bool:
        """End a request (finish_reason "abort", its memory freed) -> whether it was unfinished."""
        return self._abort(request_id, count=True)

    def _abort(self, request_id: str, count: bool) -> bool:
        """`abort`, counted in `requests_aborted` if `count` (never taken back: a scrape from another thread
        must never see that counter go down)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        if req.beam is not None:
            g = req.beam  # (a failed search, count False, reports nothing: its hypotheses may be what failed)
            g.final, g.aborted = aborted_hypotheses(g, [s.hyp for s in req.seqs]) if count else [], True
            self._ended.add(request_id)
            for s in req.seqs:
                self._drop_beam(s)
            req.seqs = []
            self._beams.pop(request_id, None)
            self._sweep_frozen()
        else:
            for s in req.seqs:
                if not s.finished:
                    if count:  # text held back as a possible stop string comes out (a failed request's is not read)
                        s.checker.abort()
                    self._finish(s, "abort")
        self.counters["requests_aborted"] += count
        return True

    def load_options(self) -> dict:
        """`k3jax.load_model` options that read weights straight into this engine's placement (each device its
        shards; `{}` on one device without a mesh), as `update_weights_from_disk` loads them."""
        if self.mesh is None:
            return {}
        return dict(sharding=self.config.sharding, devices=self.config.mesh_devices())

    def update_weights(self, model: Model) -> None:
        """Swap in new weights of the same model: an RL loop's policy update, a fine-tuned checkpoint.
        `model` must have this engine's config and parameter shapes; it gets the engine's start-up
        transforms (experts expanded, dense weights transposed, placement on the mesh), the compiled step
        programs are reused (no compile), and the prefix cache is cleared (its pages and states came from
        the old weights). Requests must not be in flight (finish or abort them first). On a multi-process
        mesh every process must load the weights: `update_weights_from_disk`."""
        self._leader_only("update_weights")
        if self.channel is not None:
            raise RuntimeError("update_weights: on a multi-process mesh every process loads the new weights itself; "
                               "call update_weights_from_disk(path) with a checkpoint directory they all can read")
        self._check_idle("update_weights")
        self._install_weights(self._engine_leaves(model))
        self._forget_cached("update_weights")
        self.counters["weight_updates"] += 1

    def update_weights_from_disk(self, path: str) -> None:
        """`update_weights` with the weights of a checkpoint directory (SGLang's `update_weights_from_disk`),
        read straight into this engine's placement. On a multi-process mesh every process loads `path` itself
        (each its own shards; the directory must hold the same checkpoint on every host): all first check
        that they can read its config, then load together; the weights change only if every process
        loaded them, else the leader raises naming the processes that failed (their logs say why)."""
        self._leader_only("update_weights_from_disk")
        self._warmed_together("update_weights_from_disk")
        self._check_idle("update_weights_from_disk")
        path = os.path.abspath(path)
        read_config(path)  # a missing or unreadable directory here raises before any process is told
        if self.channel is not None:
            self.channel.command(UPDATE, text_payload(path))
        self._load_weights_together(path)
        self._forget_cached("update_weights_from_disk")
        self.counters["weight_updates"] += 1

    # ---- weights by checkpoint name (serve/named_weights.py) --------------------------------------------------
    @property
    def weight_names(self) -> WeightNames:
        """The checkpoint names of this engine's weights and where each is held (built on first use)."""
        if self._weight_names is None:
            params = jax.tree.unflatten(self._param_treedef, [jax.ShapeDtypeStruct(s, d) for s, d in self._param_specs])
            self._weight_names = WeightNames(dataclasses.replace(self.model, params=params), self._expanded_group)
        return self._weight_names

    def get_weights_by_name(self, name: str, truncate_size: Optional[int] = 100) -> np.ndarray:
        """SGLang's `get_weights_by_name`: the checkpoint tensor `name` as this engine serves it now, in the
        checkpoint's layout (however the engine holds it: transposed, expert-balanced, layer-stacked, on a mesh),
        its first `truncate_size` rows (all of it with None) -> numpy. An RL loop checks a weight sync with it.
        Names as `load_model` reads them (serve/named_weights.py); an unknown name raises `WeightNameError`
        naming it and its neighbours. On a multi-process mesh every process reads its own shards of it."""
        self._leader_only("get_weights_by_name")
        self._warmed_together("get_weights_by_name")
        if truncate_size is not None and (isinstance(truncate_size, bool) or not isinstance(truncate_size, int)
                                          or truncate_size < 0):
            raise ValueError(f"truncate_size: expected an integer >= 0 or None, got {truncate_size!r}")
        entry, _ = self.weight_names.resolve(name)
        if entry.packed_half is not None:
            raise WeightNameError(f"tensor {name}: this engine holds its MXFP4 routed experts expanded "
                                  f"(expert_weights={self.config.expert_weights!r} on this backend); read "
                                  f"{name[:-len(entry.packed_half)]}weight, their dense value")
        self._weights_present("get_weights_by_name")
        if self.channel is not None:
            self.channel.command(NAMED_READ, text_payload(json.dumps([name, truncate_size])))
        return self._read_named(name, truncate_size)

    def _read_named(self, name: str, truncate_size: Optional[int]) -> np.ndarray:
        """(every process, together) `get_weights_by_name`'s read: each process copies the rows asked for from
        its own shards; on a multi-process mesh they are put together (an all-gather of the rows and of which
        process held each)."""
        names = self.weight_names
        entry, expert = names.resolve(name)
        leaf, group = self._leaf_at[entry.leaf]
        lead = (() if group is None else (group,)) + (
            () if expert is None else (int(self._expert_places(entry.moe_layer, expert)[0]),))
        held = self._leaves[leaf]
        # only the rows asked for leave the device (the checkpoint's rows are the held columns when transposed)
        rows_axis = held.ndim - len(lead) - 1 if entry.transposed else 0
        out, mine = named_weights.read(held, lead, None if entry.a_log else truncate_size, rows_axis)
        if self.channel is not None:
            from jax.experimental import multihost_utils

            every = np.asarray(multihost_utils.process_allgather(out.view(np.uint8)))  # (bytes: any dtype)
            owner = np.asarray(multihost_utils.process_allgather(mine))
            for values, there in zip(every, owner):
                out = np.where(there, values.view(out.dtype).reshape(out.shape), out)
        out = names.to_checkpoint(entry, out)
        return out if truncate_size is None else out[:truncate_size]

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        """SGLang's `update_weights_from_tensor`: write some weights, given as (checkpoint name, tensor) pairs (or a
        dict; numpy, JAX or torch CPU tensors) in the checkpoint's layout and shapes: an RL trainer's weight
        sync, often in buckets of tensors, one call each. Each tensor gets the engine's start-up transforms and
        goes where the engine holds it (every physical copy of an expert); the others stay. Everything is
        checked before anything is written (a bad name, shape or dtype raises naming the tensor, weights
        unchanged). No compile. `flush_cache` (default) forgets the prefix cache, whose states came from the
        old weights. Requests must not be in flight (or be retracted). After `sleep(level=2)` and
        `wake_up(["weights"])` the engine serves again once every checkpoint tensor has been written. On a
        multi-process mesh the leader sends the tensors to every process, each writes its own shards, and the
        leader raises naming any process that could not."""
        self._leader_only("update_weights_from_tensor")
        self._warmed_together("update_weights_from_tensor")
        self._check_idle("update_weights_from_tensor")
        self._weights_present("update_weights_from_tensor", stale_ok=True)
        items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        if not items:
            raise ValueError("update_weights_from_tensor: no tensors given")
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"update_weights_from_tensor: expected (name, tensor) pairs, got {type(item).__name__}")
        items = [(name, named_weights.as_numpy(value)) for name, value in items]
        writes = self._named_writes(items)  # raises before anything is sent or written
        if self.channel is not None:
            self._send_in_chunks(NAMED_WRITE, [], named_weights.pack_tensors(items))
        err = None
        try:
            self._apply_named(writes)
        except Exception as e:  # noqa: BLE001 - reported with the other processes' verdicts
            err = e
        failed = self._processes_failed(err is None)
        if failed and self.channel is None:
            raise err
        if failed:
            raise RuntimeError(f"update_weights_from_tensor: process(es) {failed} could not write the tensors (their "
                               f"logs say why); the processes' weights may now differ: write them again") from err
        if self.prefix_cache is not None and self.prefix_cache.origin:  # (a host store: folded into its origin)
            self._written = named_weights.digest(items, self._written)
        if flush_cache:
            self._forget_cached("update_weights_from_tensor")
        self.counters["weight_updates"] += 1

    def _named_writes(self, items: list) -> list:
        """(name, array) pairs -> checked writes (name, where, expert, value in the held layout); raises naming a
        tensor that is unknown or of the wrong shape or dtype."""
        names = self.weight_names
        out = []
        for name, value in items:
            entry, expert = names.resolve(name)
            out.append((name, entry, expert, names.to_held(name, entry, value)))
        return out

    def _apply_named(self, writes: list) -> None:
        """(every process) Write checked named tensors where this process holds them: MXFP4 halves paired (a lone
        half waits), each tensor at every place its weight is held, then placed as the step programs expect."""
        names = self.weight_names
        pending = {k: dict(v) for k, v in self._pending_halves.items()}  # (kept only once the writes are made)
        if names.expanded_group:  # MXFP4 halves -> dense once both came (a lone half waits for a later call)
            writes = pair_expanded(writes, names.expanded_group, [d for _, d in self._param_specs], pending)
        per_leaf: dict[int, dict] = {}  # step leaf -> {index: value} (a later write of the same place wins)
        for _, entry, expert, value in writes:
            leaf, group = self._leaf_at[entry.leaf]
            at = () if group is None else (group,)
            places = [None] if expert is None else self._expert_places(entry.moe_layer, expert)
            for p in places:
                per_leaf.setdefault(leaf, {})[at if p is None else at + (int(p),)] = value
        leaves = list(self._leaves)
        for leaf, by_index in per_leaf.items():
            leaves[leaf] = named_weights.write(leaves[leaf], by_index.items())
        self._set_leaves(leaves)
        jax.block_until_ready(self._leaves)
        self._pending_halves = pending
        if self._weights_stale:
            self._stale_written |= {(entry.leaf, expert) for _, entry, expert, _ in writes}
            if self._stale_written >= names.keys():
                self._weights_stale, self._stale_written = False, set()

    def _receive_named(self, cmd: int, payload: np.ndarray) -> None:
        """A follower's part of a named write (the last chunk writes, then every process's verdict) or read."""
        if cmd == NAMED_READ:
            name, truncate_size = json.loads(payload_text(payload))
            self._read_named(name, truncate_size)
            return
        (k, n), raw = payload_bytes(payload, 2)
        self._named_parts.append(raw)
        if k < n - 1:
            return
        raw, self._named_parts = b"".join(self._named_parts), []
        ok = True
        try:
            self._apply_named(self._named_writes(named_weights.unpack_tensors(raw)))
        except Exception:  # noqa: BLE001 - the leader names this process
            log.exception("update_weights_from_tensor: process %d could not write the tensors", self.channel.process)
            ok = False
        self._processes_failed(ok)

    def _expert_places(self, moe_layer: int, expert: int) -> np.ndarray:
        """The physical positions of a routed expert in its MoE layer's stacked weights (EPLB: maybe several)."""
        if self.eplb is None:
            return np.asarray([expert])
        return np.flatnonzero(self.eplb.placement[moe_layer] == expert)

    def _weights_present(self, what: str, stale_ok: bool = False) -> None:
        if self._leaves is None:
            raise EngineSleeping(f"{what}: the weights were released by sleep(level={self.sleep_level}); call "
                                 f"wake_up(['weights']) first")
        if self._weights_stale and not stale_ok:
            raise EngineSleeping(f"{what}: sleep(level=2) discarded the weights; load new ones first")

    def _load_weights_together(self, path: str) -> None:
        """(every process, in step) Load a checkpoint's weights and install them where every process could.
        Two rounds, each closed by every process's verdict: reading the config (host only: a process
        without the directory fails before any device program, which the others would wait in), then
        loading and transforming the weights. Raises on the leader when any process failed."""
        from k3jax.runtime import load_model

        err, leaves = None, None
        for attempt in ("config", "weights"):
            try:
                if attempt == "config":
                    read_config(path)
                else:
                    leaves = self._engine_leaves(load_model(path, dtype=self.model.dtype, **self.load_options()))
            except Exception as e:  # noqa: BLE001 - reported to the leader through the verdict
                err = e
                if self.is_follower:
                    log.exception("update_weights_from_disk: process %d could not load %s", self.channel.process, path)
            failed = self._processes_failed(err is None)
            if failed:
                if self.is_follower:
                    return
                if err is not None:
                    raise err
                raise RuntimeError(f"update_weights_from_disk: process(es) {failed} could not load the weights of "
                                   f"{path} (their logs say why); the weights are unchanged")
        self._install_weights(leaves)

    def _check_idle(self, what: str) -> None:
        """Sleep and weight updates: read back the step in flight; raise if requests are still running (requests
        `retract` holds without memory may wait)."""
        self._drain()
        busy = [s.request_id for s in self.seqs.values() if not s.finished and not s.internal
                and not (self.held and s.slot is None and not any(s.pages))]
        if busy:
            raise RuntimeError(f"{what}: {len(busy)} requests in flight (e.g. {busy[0]!r}); finish or abort "
                               f"them first")

    def _engine_leaves(self, model: Model) -> list:
        """`model`'s weights with the engine's start-up transforms, checked against the engine's -> the leaves
        the step programs take (not placed yet). Raises ValueError naming what differs."""
        # a tied model's export (save_hf_checkpoint) carries its head, read untied: tied again (`tie_head`)
        new = tie_head(model) if self.cfg.tie_word_embeddings and not model.cfg.tie_word_embeddings else model
        if self.config.max_loras:  # the same adapter slots; the loaded adapters are written back later
            targets = self.config.lora_target_modules
            new = model_lora.attach(new, self.config.max_loras, self.config.max_lora_rank,
                                    tuple(targets) if targets is not None else None, self.config.lora_experts_shared_a)
        new = dequantize_experts(new, self._expert_dtype) if self._dequantize else new
        new = transpose_dense_weights(new) if self.dense_in_out else new
        # checkpoint order, then the initial copies
        new = eplb.attach(new, self.config.eplb_num_redundant_experts) if self.eplb is not None else new
        diff = [f.name for f in dataclasses.fields(self.cfg) if getattr(new.cfg, f.name) != getattr(self.cfg, f.name)]
        if diff:
            raise ValueError(f"update_weights: the model's config differs from the engine's in {', '.join(diff)}")
        flat, treedef = jax.tree.flatten_with_path(new.params)
        if treedef != self._param_treedef:
            raise ValueError("update_weights: the model's parameter tree differs from the engine's")
        for (path, a), (shape, dtype) in zip(flat, self._param_specs):
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} is {a.dtype}{list(a.shape)}, the "
                                 f"engine's {dtype}{list(shape)}")
        params = new.params if self.layer_scan is None else split_params(new.params, self.layer_scan)
        return jax.tree.leaves(params)

    def _install_weights(self, leaves: list) -> None:
        """(every process) Place new weights: experts back at their initial placement, loaded adapters written
        over them again; the engine is awake once its cache is too."""
        self._set_leaves(leaves)
        if self.eplb is not None:
            self.eplb.reset()
        for slot, adapter in self.loras.in_slot.items():  # loaded adapters stay loaded over new weights
            self._write_lora(slot, adapter)
        self._host_leaves, self._weights_stale, self._pending_halves = None, False, {}
        if self.sleep_level and self.arena is not None:
            self.sleep_level = 0  # the cache was woken already: the engine is awake again

    def _forget_cached(self, what: str) -> None:
        """(leader; sleep, weight updates) Forget what the cache holds: canonical rows in flight, shared tails,
        the prefix cache (both tiers; the followers drop their host-tier pieces of it too)."""
        for s in [s for s in self.seqs.values() if s.internal and not s.finished]:
            self._finish(s, "abort")  # canonical rows of the cached prefixes
        for s in self.seqs.values():  # requests waiting (`retract`): their planned prefix hits go with the cache
            if not s.finished and s.slot is None:
                s.hit = s.hit_routes = None
        self._tails.clear()
        if self.prefix_cache is not None and not self.prefix_cache.clear():
            raise RuntimeError(f"{what}: the prefix cache could not be cleared")  # nothing holds it
        if self.routes_store is not None:
            self.routes_store.clear()  # (computed with the old weights)
        if self.prefix_cache is not None and self.prefix_cache.origin and what.startswith("update_weights"):
            # a store shared with engines still on the old weights, which may publish into it: this engine now
            # serves only entries of its new weights (named writes chain onto the origin; a whole update is summed)
            self.prefix_cache.origin = (named_weights.digest([], self.prefix_cache.origin + self._written)
                                        if what == "update_weights_from_tensor" else self._weights_digest())
        if what.startswith("update_weights"):
            self._written = ""
        if self.channel is not None:
            self._send_forgotten()

    def _processes_failed(self, ok: bool) -> list[int]:
        """(every process of a multi-process engine, together) -> the processes that report `ok` False."""
        if self.channel is None:
            return [] if ok else [0]
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))).reshape(-1)
        return [i for i, x in enumerate(every) if not x]

    def rebalance_experts(self) -> dict:
        """Expert-parallel load balancing now (the engine also runs it every `eplb_step_interval` steps):
        plan each MoE layer's placement from the routed-token counts of the last `eplb_window_size` steps and
        move the layers that gain (serve/eplb.py). Outputs do not change. -> the plan's summary (mean busiest
        rank / mean rank load over the MoE layers before and after, layers moved)."""
        self._leader_only("rebalance_experts")
        if self.eplb is None:
            raise RuntimeError("rebalance_experts: the engine was built without enable_eplb")
        self._warmed_together("rebalance_experts")
        self._weights_present("rebalance_experts", stale_ok=True)  # (placeholders move like weights)
        moves, summary = self.eplb.plan()
        t0 = time.perf_counter()
        send = None
        if moves and self.channel is not None:  # every process moves the same experts
            rows = np.asarray([[layer, *new] for layer, new in moves.items()], np.int32).reshape(-1)
            send = lambda: self.channel.command(EPLB, rows)  # noqa: E731
        self._move_experts(moves, summary, send)
        summary["seconds"] = time.perf_counter() - t0
        return summary

    def _scheduled_rebalance(self) -> None:
        """`rebalance_experts` every `eplb_step_interval` steps, inside a step's read-back. A move that fails leaves
        the weights, the placement and the stats as they were (`_move_experts`), and is no request's doing: it is
        logged and counted (`stats()["eplb"]["failed_moves"]`), the step's outputs and requests go on, and the next
        plan comes an interval later."""
        try:
            self.rebalance_experts()
        except Exception as e:  # noqa: BLE001 - (an interrupt goes on)
            self.eplb.failed_moves += 1
            log.warning("expert move failed, the experts stay where they were: %s: %s", type(e).__name__, e)

    def _move_experts(self, moves: dict[int, np.ndarray], summary: dict, send: Optional[Callable] = None) -> None:
        """Gather each moved MoE layer's expert weights into their new places ({layer: placement}), write its
        placement tables and wait until they landed; only then count the move. Index and tables go in as numpy
        values (the same on every process of a multi-process mesh, whose followers run this on the leader's EPLB
        command). A move that raises leaves the weights, the placement and the `eplb` stats as they were.

        `send` (a multi-process leader's: the moves to the followers) runs once this process's move is launched
        (launches are asynchronous), as a step is sent (`_step_fn`): a move that fails on the leader alone before
        it is sent is never sent, so no follower waits in its gathers' collectives. XLA:CPU runs a program as cheap
        as a gather in the caller's thread (its collectives would wait for followers not told yet): there the
        gathers are compiled first and launched once sent. Once sent, every process waits for its own gathers and
        all exchange their verdicts (vLLM's EPLB likewise switches its expert maps only after the weight exchange
        completed): the move is kept on every process or on none (a failure that surfaces only as the gathers
        finish, e.g. device memory, would otherwise have moved the others and left this one's weights broken)."""
        leaves, at = list(self._leaves), self._leaf_at
        taken: dict[int, dict] = {}  # step leaf -> {group (None: not stacked): gather index}
        for layer, new in moves.items():
            index = eplb.moved_index(self.eplb.placement[layer], new)
            for i in self._eplb_leaves[layer][2]:
                leaf, group = at[i]
                taken.setdefault(leaf, {})[group] = index
        together = self.is_follower  # whether the processes decide the move's fate together (a follower: always)
        err, kept = None, (self._leaves, self.model)
        before = self.eplb.place(moves)
        try:
            host = jax.default_backend() == "cpu"
            gathers = {}
            for leaf, index in taken.items():  # a scanned run's stacked leaf: every moved group in one gather
                x = leaves[leaf]
                if host and getattr(x, "is_fully_addressable", True):  # XLA:CPU, one process: see eplb.take_on_host
                    leaves[leaf] = eplb.take_on_host(x, index)
                else:
                    gathers[leaf] = eplb.gather_program(x, index)
            inline = host and bool(gathers)  # (XLA:CPU: they would run here, waiting for the followers)
            if send is not None and inline:
                send()
                together = True  # (only once sent: a follower never told would not join the verdicts)
            for leaf, launch in gathers.items():
                leaves[leaf] = launch()
            self._write_placement_tables(leaves, moves)
            if moves:
                self._set_leaves(leaves)
            if send is not None and not inline:
                send()
                together = True
            jax.block_until_ready(self._leaves)  # landed (a failure on the devices surfaces here)
        except BaseException as e:  # noqa: BLE001 - the move is undone below, then raised (or reported)
            err = e
        failed = self._processes_failed(err is None) if together else ([] if err is None else [0])
        if failed:
            self._leaves, self.model = kept
            self.eplb.place(before)
            if err is not None and not isinstance(err, Exception):
                raise err  # (an interrupt: the verdicts were exchanged first)
            if self.is_follower:
                if err is not None:
                    log.error("expert move: process %d could not move its experts (the experts stay where they "
                              "were on every process): %s: %s", self.channel.process, type(err).__name__, err)
                return
            if err is not None:
                raise err
            raise RuntimeError(f"expert move: process(es) {failed} could not move their experts (their logs say "
                               f"why); the experts stay where they were on every process")
        self.eplb.applied(moves, summary)  # (stats count only the moves that landed)
        self.counters["eplb_rebalances"] += 1

    def _write_placement_tables(self, leaves: list, layers) -> None:
        """Write the EPLB placement tables (`ExpertPlacement`, `ExpertCopies`) of these MoE layers' current
        placement into `leaves`."""
        for layer in layers:
            for i, table in zip(self._eplb_leaves[layer][:2], self.eplb.tables(layer)):
                leaf, group = self._leaf_at[i]
                leaves[leaf] = table if group is None else jnp.asarray(leaves[leaf]).at[group].set(table)

    def _set_leaves(self, leaves: list) -> None:
        """Place `leaves` where the step programs expect the weights: on a mesh, each with its sharding; on
        one device committed to it like the originals, so the programs see the same signature."""
        def place(a, sh):
            if isinstance(a, HostCopy):
                a = a.restore(sh)
            return put(a, sh) if sh is not None else jax.device_put(a, self._one_device)
        self._leaves = [place(a, sh) for a, (_, _, sh) in zip(leaves, self._leaf_specs)]
        params = self._step_params()
        self.model = dataclasses.replace(self.model, params=params if self.layer_scan is None else params[0])

    def _step_params(self):
        """The weights as the step programs take them: the model's state, or with a layer scan (its state
        with the scanned layers hollow, their stacked weights)."""
        return jax.tree.unflatten(self._step_treedef, self._leaves)

    @property
    def is_sleeping(self) -> bool:
        """True from `sleep` until `wake_up` has brought back both parts and the weights are real ones."""
        return self.sleep_level > 0 or self._weights_stale

    def _check_awake(self, what: str) -> None:
        if self.sleep_level and (self._leaves is None or self.arena is None):
            asleep = [k for k, v in (("weights", self._leaves), ("kv_cache", self.arena)) if v is None]
            raise EngineSleeping(f"{what}: the engine is sleeping ({' and '.join(asleep)} released by "
                                 f"sleep(level={self.sleep_level})); call wake_up() first")
        if self._weights_stale:
            raise EngineSleeping(f"{what}: sleep(level=2) discarded the weights; load new ones with "
                                 f"update_weights() first")

    def sleep(self, level: int = 1, tags: Optional[list[str]] = None) -> None:
        """vLLM's sleep mode, for RL loops that share the device between training and generation: release
        the device memory the engine holds (the arena, and its references to the weights: weights the
        caller's `Model` also holds stay until the caller drops it; `LLM.sleep` does). Level 1 copies the
        weights to host memory and frees them and the cache arena; level 2 discards the weights too (load new
        ones with `update_weights`, asleep or after `wake_up(["weights"])`). `tags` ("weights", "kv_cache";
        default both; SGLang's `release_memory_occupation`) releases only those parts. Cached prefixes are
        forgotten (both tiers) whatever is released. The compiled programs stay: `wake_up` needs no compile.
        Requests must not be in flight. On a multi-process mesh every process releases its own devices'
        memory (level 1: each keeps its own shards in host memory)."""
        self._leader_only("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 (weights to host memory) or 2 (weights discarded), got {level!r}")
        tags = _memory_tags("sleep", tags)
        self._check_idle("sleep")
        self._forget_cached("sleep")
        assert self.allocator.free_units == self.allocator.baseline_free_units
        if self.channel is not None:
            self.channel.command(SLEEP, np.asarray([level, "weights" in tags, "kv_cache" in tags], np.int32))
        self._release_device_memory(level, tags)
        self.counters["sleeps"] += 1

    def _release_device_memory(self, level: int, tags: frozenset = frozenset({"weights", "kv_cache"})) -> None:
        """(every process) Sleep's device side: weights to host memory (level 1) or dropped, the arena freed
        (each where `tags` names it)."""
        if self._leaves is not None and "weights" in tags:
            if level == 1 and not self._weights_stale:
                self._host_leaves = [HostCopy.of(x) for x in self._leaves]
            # dropped, not deleted: leaves the caller's Model shares (those no start-up transform copied)
            # stay with it; what only the engine held is freed (LLM drops its Model too)
            self._leaves = None
            self.model = dataclasses.replace(self.model, params=None)
        if level == 2 and "weights" in tags:
            self._host_leaves = None
        if self.arena is not None and "kv_cache" in tags:
            self.arena.delete()
            self.token_pages.delete()
            self.page_tables.array.delete()  # made again with the arena
            self.arena = self.token_pages = None
        self.sleep_level = max(self.sleep_level, level if "weights" in tags else 1)  # (2: weights discarded)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take back what `sleep` released: `tags` "weights" and / or "kv_cache" (vLLM's; default both).
        Weights come back from host memory (level 1) or, after level 2, as zeros to be overwritten by
        `update_weights` before any request; the arena comes back empty."""
        self._leader_only("wake_up")
        tags = _memory_tags("wake_up", tags)
        if self.channel is not None:
            self.channel.command(WAKE, np.asarray(["weights" in tags, "kv_cache" in tags], np.int32))
        self._take_back_device_memory(tags)

    def _take_back_device_memory(self, tags: set[str]) -> None:
        """(every process) wake_up's device side."""
        if "weights" in tags and self._leaves is None:
            if self._host_leaves is not None:
                self._set_leaves(self._host_leaves)
            else:
                # placeholders for the checkpoint tensors (update_weights_from_tensor writes them); what no
                # checkpoint tensor holds comes back now: the experts' placement tables, the loaded adapters
                leaves = [np.zeros(shape, dtype) for shape, dtype, _ in self._leaf_specs]
                if self.eplb is not None:
                    self._write_placement_tables(leaves, range(len(self.eplb.placement)))
                self._set_leaves(leaves)
                for slot, adapter in self.loras.in_slot.items():
                    self._write_lora(slot, adapter)
                self._weights_stale, self._stale_written = True, set()
            self._host_leaves = None
        if "kv_cache" in tags and self.arena is None:
            self._zeroed_arena()
        if self._leaves is not None and self.arena is not None:
            self.sleep_level = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, device and host tier (vLLM's `reset_prefix_cache`) -> True when
        the cache is empty now; entries that requests in flight still read stay until they finish
        (call again once idle). Outputs do not change: every resume is bit-identical to a cold prefill."""
        self._leader_only("reset_prefix_cache")
        self._drain()
        if self.prefix_cache is None:
            return True
        self._tails.clear()
        if self.routes_store is not None:
            self.routes_store.clear()
        return self.prefix_cache.clear()

    def _drain(self) -> None:
        """Read back the step in flight (async scheduling) before changing what it ran on; its outputs go out
        with the next `step()`'s."""
        if self._flight:
            self._land_flight(self._landed)

    def retract(self) -> int:
        """SGLang's `pause_generation(mode="retract")`, for RL weight updates in the middle of a rollout: read
        back the step in flight, free the cache every unfinished request holds (a preemption: prompt and
        tokens so far are kept) and schedule nothing until `continue_generation`. Meanwhile the requests wait
        holding no memory, so `update_weights` / `sleep` may run; afterwards each recomputes its prompt and
        tokens so far under the weights then served and goes on generating. -> the requests retracted."""
        self._leader_only("retract")
        self._drain()
        was_held, self.held = self.held, True
        retracted = set()
        for s in self.seqs.values():
            if not s.finished and not s.internal:
                if s.slot is not None or any(s.pages):
                    self._preempt(s, counted=False)
                    retracted.add(s.request_id)
                elif not was_held:  # (waiting; one a retract before this one holds is not counted again)
                    retracted.add(s.request_id)
        self._sweep_frozen()  # forked beams' parents: their children gave them up
        self.counters["requests_retracted"] += len(retracted)
        return len(retracted)

    def continue_generation(self) -> None:
        """End `retract`: the waiting requests are scheduled again (an engine still asleep, or without weights
        since a level-2 sleep, raises `EngineSleeping` and stays held)."""
        self._check_awake("continue_generation")
        self.held = False

    def has_unfinished(self) -> bool:
        """Requests not finished, a launched step not read back yet (async scheduling), or outputs owed: a call
        between steps (`reset_prefix_cache`, `sleep`, ...) read that step back and the next `step()` returns what
        it produced (the last output of a request it finished, which an `AsyncEngine` stream still waits for)."""
        return bool(self._flight) or bool(self._landed) or any(not s.finished for s in self.seqs.values())

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return outputs of requests that made progress. With async scheduling the
        step is launched before the one the call before launched is read back, and the outputs are that one's.

        A request whose host-side bookkeeping raises (reading back its row, its stop checks and detokenizing, its
        beam search's selection) ends alone: StepFailed names it and carries every other output; the rest of
        the step is processed as usual."""
        self._leader_only("step")
        self._warmed_together("step")
        self._host_failures = []
        try:
            outs = self._run_step()
        except StepFailed as e:  # (already counted as a failed step)
            if self._host_failures:
                more = self._end_host_failures()
                e.causes.update({rid: err for rid, err in more.items() if rid not in e.request_ids})  # (their own)
                e.request_ids = sorted(set(e.request_ids) | set(more))
                e.outputs = [o for o in e.outputs if o.request_id not in more]
            raise
        if not self._host_failures:
            return outs
        first = self._host_failures[0][1]
        self.counters["failed_steps"] += 1
        causes = self._end_host_failures()
        err = StepFailed(sorted(causes), first, [o for o in outs if o.request_id not in causes], own=True,
                         causes=causes)
        raise err from first

    def _end_host_failures(self) -> dict[str, Exception]:
        """End the requests in `_host_failures` -> {request id: the first error of its own} (each request's
        client is told its own error, not another request's)."""
        causes: dict[str, Exception] = {}
        for rid, err in self._host_failures:
            causes.setdefault(rid, err)
        self._host_failures = []
        self._end_failed(sorted(causes))
        self._reap()
        return causes

    def _end_failed(self, request_ids: list[str]) -> None:
        """End requests a failure took with it: aborted (their memory freed), counted as failed, not aborted."""
        for request_id in request_ids:
            if self._abort(request_id, count=False):
                self.counters["requests_failed"] += 1

    def _host_failed(self, request_id: str, err: Exception) -> None:
        log.error("request %s failed in the engine's bookkeeping", loggable(request_id), exc_info=err)
        self._host_failures.append((request_id, err))

    def _run_step(self) -> list[RequestOutput]:
        touched, self._landed = self._landed, set()
        ended: set[str] = set()
        if self.held:  # (`retract`): nothing runs; aborted requests still leave
            return self._step_outputs(touched, ended)
        if self._flight and (not all(f.chainable for f in self._flight) or self._masks_block_drafts()):
            self._land_flight(touched)  # a row whose next step needs the host to see its results first
            ended = self._select_beams() if self._beams else set()
        plan = self._plan()
        try:
            if not plan.empty:
                self._allocate(plan)
                if plan.empty and self.sched_cfg.prefill_first:
                    # every admission of a prompts-only step waits (its hit pins memory the scheduler counted
                    # as evictable): the running requests decode instead, or nothing would free that memory
                    plan = self._plan(mixed=True)
                    if not plan.empty:
                        self._allocate(plan)
        except BaseException as e:  # a host-tier copy failed (a restore may have consumed the arena): as a failed
            self._land_flight(touched, failed=(list(plan.admit), e))  # step, of the requests it admitted
        self._decode_last_tokens(plan)
        if plan.empty:
            if self._flight:
                self._land_flight(touched)
            # (also beams parked by a step that failed after reading them back: nothing else selects them)
            ended |= self._select_beams() if self._beams else set()
            return self._step_outputs(touched, ended)  # aborted requests leave even when nothing runs
        unread = self._place_adapters(plan.admit)
        if unread:  # their adapter could not be read as they were admitted: they end (StepFailed), the rest runs
            for rid, err in unread.items():
                if self.seqs[rid].internal:  # a canonical row (no request: StepFailed could not end it) is dropped
                    self._finish(self.seqs[rid], "abort")
                else:
                    self._host_failed(self.seqs[rid].request_id, err)
            plan.admit = [r for r in plan.admit if r not in unread]
            plan.prefill = [row for row in plan.prefill if row[0] not in unread]
            plan.decode = [r for r in plan.decode if r not in unread]  # (`_decode_last_tokens`' admissions)
        now = time.monotonic()
        for rid in plan.admit:
            seq = self.seqs[rid]
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
            if seq.hit_routes is not None:  # it resumes from a cached prefix: that prefix's routed ids
                seq.routes.fill_from(seq.hit_routes)
                seq.hit_routes = None
        chain = self.config.async_scheduling
        launched, running = [], list(plan.decode)
        self.counters["steps_launched_ahead"] += bool(self._flight)  # this step overlaps the one in flight
        try:
            if plan.decode:
                rows = [(rid, self._view_computed(self.seqs[rid]), 1 + plan.draft.get(rid, 0)) for rid in plan.decode]
                launched.append(self._launch(plan.decode, rows, self.spec.verify_tokens if plan.draft else 1,
                                             decoding=True))
                if not chain:
                    self._land(launched.pop(), touched)
                self.counters["decode_steps"] += 1
            if plan.prefill:
                running = [r for r, _, _ in plan.prefill]
                launched.append(self._launch(running, plan.prefill, self.config.prefill_chunk, decoding=False))
                if not chain:
                    self._land(launched.pop(), touched)
                self.counters["prefill_steps"] += 1
                self.counters["long_prefill_steps"] += bool(self.sched_cfg.long_prefill_chunk) and len(running) == 1
        except BaseException as e:  # read back what ran, then end the failed part's requests
            self._land_flight(touched, failed=(running, e), then=launched)
        # the step launched before this one is read back; this one stays in flight unless a row of it needs
        # the host before anything else is planned, or it only computes rows of requests that ended meanwhile
        self._land_flight(touched, then=launched)
        self._complete_flight(touched)
        if self._flight and (not all(f.chainable for f in self._flight)
                             or all(s.finished for f in self._flight for s in f.seqs)):
            self._land_flight(touched)
        ended |= self._select_beams() if self._beams else set()
        self.counters["steps"] += 1
        # tokens the step ran (vLLM's iteration tokens: its prompt tokens and its decode rows', drafts included)
        self.iteration_tokens.observe(sum(n for _, _, n in plan.prefill)
                                      + sum(1 + plan.draft.get(r, 0) for r in plan.decode))
        return self._step_outputs(touched, ended)

    def _complete_flight(self, touched: set[str]) -> None:
        """Launch the sample programs of the decode steps in flight (async scheduling; `_complete`), now that
        the steps before them are read back. One that fails ends its requests, as a failed launch does."""
        for f in [f for f in self._flight if f.deferred is not None]:
            try:
                self._complete(f)
            except BaseException as e:
                self._flight.remove(f)
                for seq, sampled in zip(f.seqs, f.samples):
                    seq.pending -= sampled
                self._land_flight(touched, failed=([r for r, _, _ in f.rows], e))

    def _step_outputs(self, touched: set[str], ended: set[str] = frozenset()) -> list[RequestOutput]:
        outs = self._outputs({self.seqs[r].request_id for r in touched if r in self.seqs} | ended)
        self._reap()
        return outs

    def _plan(self, mixed: bool = False) -> StepPlan:
        """The scheduler's plan for the next step. Sequences in a step still in flight count with what it adds:
        its positions computed and the token it samples (their next row takes that token on the device).
        `mixed`: plan the decodes even with `prefill_first`."""
        self._unpark_for_laggards()
        free_units, free_slots = self.allocator.free_units, self._free_slots()
        if self.prefix_cache:
            eu, es = self.prefix_cache.evictable()
            free_units, free_slots = free_units + eu, free_slots + es
        live, deferred = self._queue_head(free_slots)
        if self.spec:
            decoding = [s for s in live if self._decodes_next(s)]
            off = self._drafting_off(len(decoding))
            for s in live:
                s.draft = [] if off else self._drafts(s)
            if any(self._masked_in_flight(s) for s in decoding):  # (`step` reads such rows back when others draft)
                for s in decoding:
                    s.draft = []
            drafting = [s for s in decoding if s.draft]
            if drafting and self.gate is not None:
                rows = min(len(decoding), self.decode_buckets[-1])
                for s in drafting:
                    s.spec_p = s.spec_p or self.gate.prior()
                if not self.gate.allow(_fit(rows, self.decode_buckets), rows, [len(s.draft) for s in drafting],
                                       [s.spec_p for s in drafting]):
                    for s in decoding:
                        s.draft = []
        views = [SeqView(s.rid, s.order, self._replay_total(s), self._view_computed(s), s.slot is not None,
                         self._held_units(s), self._next_stop(s), s.priority, len(s.draft),
                         len(s.prompt_ids) + s.checker.max_tokens, s.lora.uid if s.lora is not None else 0,
                         self._decode_rows(s))
                 for s in live if s.rid not in deferred]
        cfg = dataclasses.replace(self.sched_cfg, prefill_first=False) if mixed else self.sched_cfg
        plan = schedule(views, Memory(free_units, free_slots), cfg, self.new_token_ratio)
        if plan.empty and not plan.preempt and not self._flight and self._beams and self._unpark_for_laggards(True):
            return self._plan(mixed)  # (a parked beam held what its laggard sibling needs: see there)
        self._adapt_new_token_ratio(plan)
        for rid in plan.preempt:
            self._preempt(self.seqs[rid])
        return plan

    def _queue_head(self, free_slots: int) -> tuple[list[Sequence], set[str]]:
        """The sequences the scheduler sees this step, each waiting one matched against the prefix cache ->
        (them, in `self.seqs`' order; the waiting ones among them that sit out: `_deferred`). Every running
        sequence and canonical row, and as many waiting requests, in the scheduler's order (priority, arrival), as
        the scheduler may look at (`waiting_cut`; those that sit out do not count). The requests behind them are
        not matched or viewed until they move up (their prefix-cache plans are not kept from eviction, nor do they
        start a canonical row meanwhile). Running sequences and waiting ones come from `_running` and the ordered
        queue (`_waiting`): walking, matching and viewing every request queued every step made an offline batch of
        N prompts cost host time quadratic in N."""
        def fixed() -> list[Sequence]:  # the running sequences and the canonical rows
            rows = [self.seqs[r] for r in self._canonical_pending if r in self.seqs and self.seqs[r].slot is None]
            return [s for s in list(self._running.values()) + rows if not s.finished and s.proposals is None]

        def shown(n: int) -> list[Sequence]:  # in `self.seqs`' order
            return sorted(held + [e[3] for e in self._waiting(n)], key=operator.attrgetter("place"))

        held = fixed()
        running = [(s.priority, s.lora.uid if s.lora is not None else 0) for s in held if s.slot is not None]
        first = self._waiting(1)
        n = waiting_cut(self.sched_cfg, free_slots, running, itertools.repeat((first[0][0], 0, True))) if first else 1
        while True:
            head = shown(n)
            for s in head:
                if s.slot is None:
                    self._match(s)
            if self._canonicalize_shared_tails(head):
                held = fixed()  # (with the rows spawned)
                head = shown(n)
                for s in head:
                    if s.slot is None and s.hit is None:
                        self._match(s)
            deferred = self._deferred(head, self._waits_at)
            # (as the scheduler sees them: `_deferred` moved a canonical row to a place it borrows, or back to its own)
            running = [(s.priority, s.lora.uid if s.lora is not None else 0) for s in held if s.slot is not None]
            pending = [s.lora.uid for s in held if s.slot is None and s.lora is not None]  # (canonical rows)
            queue = self._waiting(n)
            cut = ((s.priority, s.lora.uid if s.lora is not None else 0, s.rid not in deferred) for *_, s in queue)
            if len(queue) < n or waiting_cut(self.sched_cfg, free_slots, running, cut, self._queued_loras,
                                             pending) is not None:
                self._waiting_head = [s for s in head if s.slot is None]
                return head, deferred
            n *= 2

    @staticmethod
    def _view_total(seq: Sequence) -> int:
        """Tokens of `seq` once every launched step is read back, less a last token in flight that ends it at
        max_tokens: it runs (holding its memory, row and adapter) with nothing left to compute."""
        n = seq.num_ids + seq.pending
        last = seq.checker.max_tokens is not None and len(seq.output_ids) + seq.pending >= seq.checker.max_tokens
        return n - 1 if seq.pending and last else n

    def _replay_total(self, seq: Sequence) -> int:
        """`_view_total`, cut where a recompute with bf16 KDA states stops prefilling: at the prompt's end, then
        one token past its computed positions, so the tokens it had decoded run again as decode rows (one a
        step, their samples dropped; `_land`) and its state is rounded after each of them as when they were
        decoded (prompt rows round at the prefill points only), which keeps the recompute bit-identical to the
        request alone. fp32 states (exact) recompute them as prompt rows."""
        total = self._view_total(seq)
        if self.layout.state_dtype == "float32" or seq.internal:
            return total
        return min(total, max(len(seq.prompt_ids), self._view_computed(seq) + 1))

    @staticmethod
    def _view_computed(seq: Sequence) -> int:
        """Positions of `seq` computed once every launched step is read back."""
        return max(seq.computed, seq.flight_end)

    def _land_flight(self, touched: set[str], failed: Optional[tuple[list[str], BaseException]] = None,
                     then: list = ()) -> None:
        """Read back every launched step (in launch order) into the requests' state; `then` (steps launched
        after them) stays in flight. A step that fails here, or the launch `failed` names ((its request ids,
        the error)), ends the requests it ran, and `then` is read back too (it ran on what failed): raises
        StepFailed carrying every other output (the KeyboardInterrupt itself for a Ctrl-C, once consistent)."""
        flights, self._flight = self._flight, []
        rids, first = (list(failed[0]), failed[1]) if failed else ([], None)
        for f in flights:
            try:
                self._land(f, touched)
            except BaseException as e:
                rids += [r for r, _, _ in f.rows]
                first = first if first is not None else e
        if first is None:
            self._flight = list(then)
            return
        for f in then:
            try:
                self._land(f, touched)
            except BaseException:
                rids += [r for r, _, _ in f.rows]
        err = self._step_failed(rids, first)
        done = {self.seqs[r].request_id for r in touched if r in self.seqs} - set(err.request_ids)
        err.outputs = self._outputs(done)
        self._reap()
        if not isinstance(first, Exception):
            raise first  # Ctrl-C in a notebook: the engine is consistent again, the interrupt goes on
        raise err from first

    def _outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        """The step's outputs of these requests, as each request's `output_kind` asks (FINAL_ONLY: finished
        ones only; DELTA: none where nothing is new)."""
        outs = []
        for rid in sorted(request_ids):
            req = self.requests[rid]
            kind = req.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not req.finished:
                continue
            out = self._output(req)
            if kind != RequestOutputKind.DELTA or out.outputs or out.finished:
                outs.append(out)
        return outs

    def _step_failed(self, rids: list[str], err: BaseException) -> StepFailed:
        """A compiled step (or its host side) raised: end the requests it ran -- they may be what broke it --
        and keep everything else. If the call had already consumed the donated cache, every request
        holding cache state lost it: those are preempted (recomputed from their tokens, like any
        preemption), the prefix cache is emptied and a fresh arena takes the old one's place, so the next
        step runs as on a cold engine. -> the error to raise (its `request_ids` are the ended requests)."""
        log.error("engine step failed: %s: %s", type(err).__name__, err, exc_info=err)  # (its one traceback)
        self.counters["failed_steps"] += 1
        ended = sorted({self.seqs[r].request_id for r in rids if r in self.seqs})
        self._end_failed(ended)
        if self._renew_arena_if_lost():
            for s in self.seqs.values():
                if not s.finished and (s.slot is not None or any(s.pages)):
                    self._preempt(s)
            self._tails.clear()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
        return StepFailed(ended, err)

    def _renew_arena_if_lost(self) -> bool:
        """Replace an arena (or token-page array) a failed call consumed by empty ones -> whether it did."""
        if self.arena is None or not (self.arena.is_deleted() or self.token_pages.is_deleted()):
            return False
        if not self.arena.is_deleted():
            self.arena.delete()
        if not self.token_pages.is_deleted():
            self.token_pages.delete()
        self._zeroed_arena()
        self.counters["cache_resets"] += 1
        return True

    def _adapt_new_token_ratio(self, plan: StepPlan) -> None:
        """SGLang's schedule: back to the initial ratio after decodes ran out of pages (the estimate was
        too low), otherwise decay towards the floor (requests finish earlier than their max_tokens)."""
        c = self.config.schedule_conservativeness
        init, floor = min(0.7 * c, 1.0), min(0.1 * c, 1.0)
        if plan.retracted:
            self._note_retractions(plan.retracted)
        elif not plan.empty:
            self.new_token_ratio = max(floor, self.new_token_ratio - (init - floor) / 600)

    def _note_retractions(self, n: int) -> None:
        """`n` running requests were preempted because decodes ran out of pages (the scheduler's plan, or a
        decode that found no room at allocation): count them and raise the admission look-ahead back to its
        initial ratio, as SGLang does on a retraction."""
        self.new_token_ratio = max(self.new_token_ratio, min(0.7 * self.config.schedule_conservativeness, 1.0))
        self.counters["retractions"] += n

    @staticmethod
    def _masked_in_flight(seq: Sequence) -> bool:
        """A row of `seq` would need masks built from a token still in flight (a verify step builds masks at
        launch; a plain decode step of async scheduling builds them once that token is read back)."""
        return bool(seq.pending) and (seq.guide is not None or bool(seq.bad_words))

    def _masks_block_drafts(self) -> bool:
        """Speculative decoding with async scheduling: whether the steps in flight must be read back before the
        next is planned so that it may draft -- a masked row with its token in flight would otherwise keep the
        next decode program a plain one. Proposals are cheap (dictionary probes); the gate is not consulted."""
        if self.spec is None or not any(self._masked_in_flight(s) for f in self._flight for s in f.seqs):
            return False
        decoding = [s for s in self.seqs.values() if not s.finished and s.proposals is None and self._decodes_next(s)]
        return not self._drafting_off(len(decoding)) and any(self._drafts(s) for s in decoding)

    def _decodes_next(self, seq: Sequence) -> bool:
        """Whether `seq`'s next row is a decode: its last token (on the host or in flight) is all it has left."""
        return seq.slot is not None and self._view_computed(seq) == seq.num_ids + seq.pending - 1

    def _drafting_off(self, decoding: int) -> bool:
        cap = self.spec.disable_by_batch_size
        return cap is not None and decoding >= cap

    def _drafts(self, seq: Sequence) -> list[int]:
        """Drafts for a running request about to decode, within its max_tokens and the context window.
        A structured-output request drafts once its constraint is active, and only the drafts its
        grammar accepts (each verify position then gets its own mask, see _pad_batch). Requests whose
        next tokens depend on host state the drafts would bypass (bad words, a min_tokens ban, a
        constraint still waiting for the end of reasoning) decode one token at a time.

        Async scheduling: a request whose input token is still in flight drafts on a guess of it, the
        n-gram's first proposal (`seq.guess`), and its verify row takes the real token from the device.
        Verification is exact either way; a wrong guess only costs the drafts (they follow the guess)."""
        ahead = seq.pending  # tokens in flight (0 or 1 at planning: a verify row is always read back first)
        if (seq.internal or seq.beam is not None or ahead > 1 or not self._decodes_next(seq) or seq.bad_words
                or len(seq.output_ids) + ahead < seq.params.min_tokens
                or (seq.guide is not None and (ahead or not seq.guide.active))):
            seq.guess = None
            return []
        k = min(self.spec.num_speculative_tokens, seq.checker.max_tokens - len(seq.output_ids) - ahead - 1,
                self.config.max_model_len - seq.num_ids - ahead)
        d = self._propose(seq, k + ahead)[:k + ahead] if k > 0 else []
        seq.guess = d[0] if ahead and len(d) > 1 else None
        d = d[ahead:]
        if d and seq.guide is not None:
            d = d[:seq.guide.matcher.validate_tokens(d)]
        return d

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k drafts (serve/speculative.py): n-gram, or suffix decoding (own tokens and finished responses)."""
        if self.spec.method == "suffix":
            if seq.ngrams is None:
                seq.ngrams = SuffixIndex()
            return self.suffix.propose(seq.ngrams, seq.ids(), k, seq.tenant)
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        return seq.ngrams.propose(seq.ids(), k)

    def _free_slots(self) -> int:
        return len(self.allocator._free_slot_bases(self.sched_cfg.max_num_seqs + self.sched_cfg.max_prefill_seqs))

    # ---- prefix cache ---------------------------------------------------------------------------
    def _match(self, seq: Sequence) -> None:
        """Plan a waiting request's start from the deepest cached prefix, and its capture points."""
        ids = seq.ids()
        seq.captures = {}
        seq.hit, seq.computed = None, 0
        if self.prefix_cache is None:
            return
        seq.hasher.extend(ids)
        # prompt logprobs (hidden states) need every prompt position (every position) computed: no reuse until
        # they are all in
        scored = ((seq.prompt_lps is not None and any(x is None for x in seq.prompt_lps[1:]))
                  or (seq.hidden is not None and seq.hidden.end < len(ids) - 1))
        # (a recompute with bf16 states resumes at most from its prompt's end: `_replay_total`)
        reach = len(ids) if self.layout.state_dtype == "float32" else min(len(ids), len(seq.prompt_ids) + 1)
        hit = Hit(0, None, [], None, 0) if scored else self.prefix_cache.match(seq.hasher, reach)
        if hit.pos and not self._hit_fits(seq, hit):  # (a request near the arena's size) it starts cold instead
            hit = Hit(0, None, [], None, 0)
        seq.hit_routes = None
        if hit.pos and seq.routes is not None and self.routes_store is not None:  # the skipped positions' ids
            seq.hit_routes = self.routes_store.take(seq.hasher, hit.pos)
            if seq.hit_routes is None:  # not held (evicted, or the hit ends inside a granule): compute them
                self.counters["routed_experts_hits_dropped"] += 1
                hit = Hit(0, None, [], None, 0)
        seq.hit, seq.computed = hit, hit.pos
        a, n = self.align, len(ids)
        interval = self.prefix_cache.interval
        seq.captures = {p: CHUNK_END for p in range(interval, n, interval)}
        if len(seq.prompt_ids) >= a:
            seq.captures[len(seq.prompt_ids) // a * a] = seq.internal or PROMPT_END
            if self.kv_role in ("kv_producer", "kv_both") and not seq.internal:
                # a consumer resumes this very prompt, whose last token it computes itself: a checkpoint
                # short of the end too when the prompt ends on an aligned position
                seq.captures.setdefault((len(seq.prompt_ids) - 1) // a * a, PROMPT_END)
        b = (hit.mla_tokens // a) * a
        if b - hit.pos >= a and self.prefix_cache.ckpts.get(seq.hasher.key(b"K", b)) is None:
            seq.captures[b] = BRANCH  # a branch seen before: capture it this time
        seq.captures = {p: k for p, k in seq.captures.items() if p > hit.pos}

    def _canonicalize_shared_tails(self, live: list[Sequence]) -> bool:
        """Decode checkpoints for conversations that turn out to be shared.

        A request that did not resume from the cache gets no decode checkpoints (a workload without
        reuse would only pay for them). When a waiting request then reuses a prefix of such a
        finished conversation, the conversation is evidently part of a shared family (an agent's
        system prompt, a common document), so its whole tail is canonicalised now: requests that
        continue it wait for that row (see `_deferred`) and resume at its end."""
        if not self._tails or self.prefix_cache is None:
            return False
        spawned = False
        for s in live:
            if s.slot is not None or s.internal or s.hit is None or s.hit.mla_tokens == 0:
                continue
            q = s.hit.mla_tokens
            for rid, (h, adapter) in list(self._tails.items()):
                ids = h.tokens
                if len(ids) > q and h.key(b"K", q) == s.hasher.key(b"K", q):
                    del self._tails[rid]
                    self._spawn_canonical_ids(ids, h, (len(ids) - 1) // self.align * self.align, DECODE, rid, adapter)
                    spawned = True
        return spawned

    def _deferred(self, live: list[Sequence], lent: Callable[[tuple], bool]) -> set[str]:
        """Waiting requests that should sit out this step because another request is about to
        checkpoint a deeper point of their prefix.

        Requests that share a prefix beyond the deepest checkpoint (a branch point) and arrive
        together would otherwise all recompute from the same shallower checkpoint, each planning
        the same capture that none of them can use. The first (running, or first waiting in the
        scheduler's order: priority, then arrival) one computes and registers the checkpoint; the
        others wait until it exists, then resume from it. A capture that is dropped (preemption, no
        free slot) disappears from the pending set, so nobody waits on it for more than the step
        that would have produced it.

        Nobody waits for a request the scheduler serves after it: a running one of a lower
        priority (a stream of requests between the two would hold it back) is not waited for, and
        a canonical re-prefill row (`_spawn_canonical_ids`; those come first) takes the place in
        the queue (priority, arrival) of the first request that waits for it, so requests that
        arrive later hold neither back. The row's place follows the requests that wait for it now: it goes back
        to its own once they are gone (an aborted urgent request's priority let it preempt user requests). A
        running row keeps the place while the request that gave it still waits, even when it no longer plans
        the capture that request waits for (no slot to keep it): else the waiting row that plans it next takes
        that place and preempts it, and two such rows preempt each other forever. `lent`: whether a waiting request
        has a place (priority, arrival) (`_waits_at`: `_queue_head` gives `live` fewer of them)."""
        if self.prefix_cache is None:
            return set()
        for s in live:
            if s.home and not (s.slot is not None and lent((s.priority, s.order))):
                s.priority, s.order = s.home
        a, pending, out = self.align, {}, set()
        for s in sorted(live, key=lambda s: (s.slot is None, s.internal is None, s.priority, s.order)):
            if s.slot is None and s.hit is not None:
                n = s.num_ids - 1
                owners = {pending.get(s.hasher.key(b"K", p), s.rid) for p in range(n // a * a, s.computed + a - 1, -a)}
                ahead = [o for o in map(self.seqs.get, owners - {s.rid}) if o.internal or o.priority <= s.priority]
                for o in ahead:
                    if o.internal:
                        o.priority, o.order = min((o.priority, o.order), (s.priority, s.order))
                if ahead:
                    out.add(s.rid)
                    continue
            for p in s.captures:
                if p > s.computed:
                    pending.setdefault(s.hasher.key(b"K", p), s.rid)
        return out

    @staticmethod
    def _decode_rows(seq: Sequence) -> int:
        """Decode rows `seq` takes while running (the scheduler's cap of max_num_seqs running rows)."""
        if seq.internal:
            return 0
        return seq.beam.params.beam_width if seq.beam is not None and seq.beam.rounds == 0 else 1

    def _held_units(self, seq: Sequence) -> int:
        """MLA units a request holds; for a waiting one, the device pages its hit shares (the pages of a
        host hit are restored into units it is given like any it computes)."""
        if seq.slot is None and seq.hit is not None:
            return sum(1 for e in seq.hit.pages if not isinstance(e, HostEntry)) * self.cfg.num_mla_layers
        return seq.num_units

    def _next_stop(self, seq: Sequence) -> Optional[int]:
        later = [p for p in seq.captures if p > seq.computed]
        return min(later) if later else None

    def _admit(self, seq: Sequence, restore: list) -> int:
        """Give an admitted request its slot and what its hit shares -> MLA units it got beyond that
        (pages restored from the host tier and the copy-on-write page, which come out of the units the
        plan grows it by). Host parts to write before the step are appended to `restore` as (units, host
        entry)."""
        seq.slot = self.allocator.alloc_slot()
        self._running[seq.rid] = seq
        hit, pc = seq.hit, self.prefix_cache
        if seq.cached_tokens is None:  # a preempted sequence's recompute does not change what it reports
            seq.cached_tokens = hit.pos if hit is not None else 0
        if pc is None or hit is None:
            return 0
        if not seq.internal:
            pc.record_query(seq.num_ids, hit, preempted=seq.preempted)
        if hit.pos == 0:
            seq.hit = None
            return 0
        seq.reused = True
        lm = self.cfg.num_mla_layers  # the hit was pinned (acquired) by _allocate
        pages, entries, given, first = [], [], 0, len(restore)
        for e in hit.pages:
            if isinstance(e, HostEntry):
                units = self.allocator.alloc_pages(lm)
                pc.ref(units)  # the request's hold
                restore.append((units, e))
                # shared again, unless the device tier has that page by now (then this copy stays private)
                entries.append(pc.adopt_page(e, units) or e)
                pages.append(units)
                given += lm
            else:
                entries.append(e)
                pages.append(e.units)
        for l in range(lm):
            seq.pages[l] = [units[l] for units in pages]
        if hit.partial is not None:
            fresh = self.allocator.alloc_pages(lm)
            pc.ref(fresh)
            given += lm
            if isinstance(hit.partial, HostEntry):
                restore.append((fresh, hit.partial))  # straight into the private copy
            else:
                seq.copies = list(zip(hit.partial.units, fresh))
            for l in range(lm):
                seq.pages[l].append(fresh[l])
        if isinstance(hit.ckpt, HostEntry):  # straight into the request's working slot, read from there
            restore.append((list(range(seq.slot, seq.slot + self.layout.slot_units)), hit.ckpt))
        else:
            seq.read_slot = hit.ckpt.slot  # pinned through `seq.hit` until the first step has read it
        seq.registered_pages = len(hit.pages)
        if len(restore) > first:  # the rows stay referenced by `restore` until they are written
            pc.unpin_host(hit)
            seq.hit = Hit(hit.pos, None if isinstance(hit.ckpt, HostEntry) else hit.ckpt, entries,
                          None if isinstance(hit.partial, HostEntry) else hit.partial, hit.mla_tokens, hit.device_pos)
        return given

    def _read_units(self, units: list[int], segments: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of arena units and their token rows (the host tier's spill; `segments`: the entries'
        (uid, units), which the followers of a multi-process engine keep their pieces under)."""
        t, t0 = self.host_transfers, time.perf_counter()
        self._send_copy(SPILL, units, segments)
        before = t.cache_size()
        out = t.read(self.arena, self.token_pages, units)
        self._count_compiles(t.cache_size() > before, "host tier read")
        self.prefix_cache.host.metrics["host_spill_seconds"] += time.perf_counter() - t0
        return out

    def _write_units(self, restore: list[tuple[list[int], HostEntry]]) -> None:
        """Write host entries' rows (and token rows) over the units given to them: one batch of copies for
        all of a step's admissions."""
        t, host = self.host_transfers, self.prefix_cache.host
        units = [u for us, _ in restore for u in us]
        rows = np.concatenate([e.rows for _, e in restore])
        toks = np.concatenate([e.tokens for _, e in restore])
        before, t0 = t.cache_size(), time.perf_counter()
        self._send_copy(RESTORE, units, [(e.uid, len(us)) for us, e in restore])
        self.arena, self.token_pages = t.write(self.arena, self.token_pages, units, rows, toks)
        # the step that follows reads these units; waiting here only moves that wait, and times the copy
        jax.block_until_ready(self.arena)
        self._count_compiles(t.cache_size() > before, "host tier write")
        host.metrics["host_restore_seconds"] += time.perf_counter() - t0
        for _, e in restore:
            host.restored(e)

    def _count_compiles(self, grew: bool, what) -> None:
        if self.warmed_up and grew:
            self.compiles_after_warmup += 1
            log.warning("%s compiled after warm-up", what)

    def _count_drafts(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if drafted:
            c = self.counters
            c["spec_decode_num_drafts"] += 1
            c["spec_decode_num_draft_tokens"] += drafted
            c["spec_decode_num_accepted_tokens"] += accepted
            self.spec_accepted_per_pos[:accepted] += 1
            if self.gate is not None:
                self.gate.observe(drafted, accepted, seq.spec_p)

    def _after_row(self, seq: Sequence, decoded: bool, prev: Optional[int] = None, ahead: list[int] = ()) -> None:
        """Bookkeeping after a step computed rows of `seq` (from position `prev` on a decode; `ahead`: accepted
        drafts in the cache, not yet appended to its output): share pages, capture states."""
        pc = self.prefix_cache
        if pc is None:
            return
        if seq.hit is not None:
            pc.unpin(seq.hit)
            seq.hit = None
        seq.hasher.extend(seq.ids() + list(ahead) if ahead else seq.ids())
        if decoded:
            # Decode writes latents and states through the token-by-token recurrence, which rounds
            # differently from the chunked prefill a cold request runs; none of it is shared.
            # Every `decode_interval` tokens a canonical re-prefill row recomputes the span since the
            # deepest shared checkpoint and registers its pages and state instead.
            # Only requests that themselves resumed from the cache get them: continuing conversations
            # and shared-prefix traffic reuse their tails, while a workload without reuse pays nothing.
            mark = seq.computed // pc.decode_interval * pc.decode_interval
            prev = seq.computed - 1 if prev is None else prev
            if seq.reused and mark > prev and not seq.finished:
                self._spawn_canonical_ids(seq.all_ids + list(ahead), seq.hasher, mark, DECODE, seq.rid, seq.lora,
                                          seq.embeds)
            return
        seq.registered_pages = pc.register_pages(seq.hasher, seq.pages, seq.computed, seq.registered_pages)
        kind = seq.captures.pop(seq.computed, None)
        if kind is None or not self._room_to_capture(seq):
            return
        pc.evict_for(0, 1, keep=self._wanted())
        try:
            new_slot = self.allocator.alloc_slot()
        except OutOfMemory:
            return
        if pc.register_checkpoint(seq.hasher, seq.computed, seq.slot, kind, seq.pages):
            ck = pc.ckpts[seq.hasher.key(b"K", seq.computed)]
            ck.pins += 1  # until the next step has read it into the new working slot
            seq.read_slot, seq.read_pin, seq.slot = seq.slot, ck, new_slot
        else:
            self.allocator.free_slot(new_slot)

    def _room_to_capture(self, seq: Sequence) -> bool:
        """Whether `seq` can still run its next row after a capture: the checkpoint keeps its slot, pinned until
        that row has read it, and `seq` takes a new one. A request that nearly fills the arena would otherwise
        wait forever for memory only its own next step frees."""
        n = seq.num_ids
        if seq.computed < n:  # a prompt chunk next
            end = chunk_end(seq.computed, n, self.sched_cfg)
        else:  # a decode next, unless the token sampled now is its last
            last = seq.checker.max_tokens is not None and len(seq.output_ids) + 1 >= seq.checker.max_tokens
            end = n if seq.internal or last else n + 1
        return self._fits_beside(end, self.layout.slot_units)

    def _hit_fits(self, seq: Sequence, hit: Hit) -> bool:
        """Whether `seq` can ever be admitted resuming from `hit`: the hit's checkpoint slot and partial page on
        the device stay pinned until its first row has read them."""
        end = chunk_end(hit.pos, seq.num_ids, self.sched_cfg)
        return self._fits_beside(end, (self.layout.slot_units if isinstance(hit.ckpt, CkptEntry) else 0)
                                 + (self.cfg.num_mla_layers if isinstance(hit.partial, PageEntry) else 0))

    def _fits_beside(self, end: int, pinned: int) -> bool:
        """Whether a request's slot and its pages up to position `end` fit in the arena beside `pinned` units
        (everything else could be evicted, preempted or finished by then)."""
        return self.layout.slot_units + units_for(end, self.sched_cfg) + pinned <= self.allocator.baseline_free_units

    def _spawn_canonical_ids(self, all_ids: list[int], hasher: PrefixHasher, pos: int, kind: str, base: str,
                             adapter: Optional[Adapter] = None, embeds: Optional[np.ndarray] = None) -> None:
        """Queue an internal prefill-only row set over the first `pos` of `all_ids` that registers the
        canonical (chunked-prefill) pages and KDA state at `pos`. It queues behind every real
        request (and is preempted first) until a request waits for it, which it then stands in
        for (see `_deferred`); it never produces output, and is dropped with its memory when it
        finishes."""
        if pos < self.align:
            return
        key = hasher.key(b"K", pos)
        if key in self.prefix_cache.ckpts or key in self._canonical_pending.values():
            return
        ids = all_ids[:pos]
        rid = f"{base}@{pos}"
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        order = CANONICAL_ORDER + next(self._order)
        shadow = Sequence(rid=rid, request_id=rid, index=0, order=order, priority=INTERNAL_PRIORITY,
                          home=(INTERNAL_PRIORITY, order),
                          prompt_ids=list(ids), params=params, seed=0,
                          checker=StopChecker(params, self.tokenizer, (), 1), metrics=RequestMetrics(time.monotonic()),
                          pages=[[] for _ in range(self.cfg.num_mla_layers)],
                          hasher=hasher.fresh(), internal=kind, lora=adapter, embeds=embeds)
        if adapter is not None:
            adapter.requests.add(rid)
        self._seat(shadow)
        self._canonical_pending[rid] = key
        self.counters["canonical_rows"] += 1

    @staticmethod
    def _defer_admission(plan: StepPlan, rid: str) -> None:
        """Take an admission out of this step's plan (the request stays waiting)."""
        plan.admit.remove(rid)
        plan.prefill = [r for r in plan.prefill if r[0] != rid]
        plan.grow.pop(rid, None)

    def _allocate(self, plan: StepPlan) -> None:
        """Carry out the plan's memory: evict, admit (slot, shared pages, copy-on-write page), grow.

        Running requests grow first (the scheduler counted on all evictable memory for them); an admission
        whose planned hit lost an entry to that eviction waits (its prefix is matched again next step). The
        others pin what they will read before the eviction made for them, so eviction never frees a page
        or state a request is about to read. Pinning may leave eviction short of what the scheduler
        counted on; an admission that then does not fit is dropped from this step (the request stays
        waiting), never half-done."""
        pc = self.prefix_cache
        running = [r for r in plan.grow if r not in plan.admit]
        if pc is not None and pc.host is not None:  # host entries to restore stay in the store meanwhile
            for rid in plan.admit:
                hit = self.seqs[rid].hit
                if hit is not None and hit.pos:
                    pc.pin_host(hit)
        if pc is not None:  # running requests first: the scheduler counted on all evictable memory
            pc.evict_for(sum(plan.grow[r] for r in running), 0, keep=self._wanted())
        for rid in running:
            if not self.allocator.can_fit(plan.grow[rid], 0):
                # the plan's estimate of what preemption frees counts units forked beams share (freed only
                # with the last of them): a decode that finds no room is preempted instead of failing the step
                self._preempt(self.seqs[rid])
                self._note_retractions(1)
                plan.decode = [r for r in plan.decode if r != rid]
                plan.prefill = [r for r in plan.prefill if r[0] != rid]
                plan.grow.pop(rid)
                plan.draft.pop(rid, None)
                continue
            self._grow(self.seqs[rid], plan.grow[rid])
        if pc is not None and plan.admit:
            for rid in list(plan.admit):
                hit = self.seqs[rid].hit
                if hit is not None and hit.pos and not pc.holds(hit):
                    # the running requests' eviction took part of what the hit reads: the request waits and
                    # its prefix is matched again next step (it would have read freed units)
                    if pc.host is not None:
                        pc.unpin_host(hit)
                    self._defer_admission(plan, rid)
                elif hit is not None and hit.pos:
                    pc.acquire(hit)
            units = sum(plan.grow.get(r, 0) for r in plan.admit)  # (copy-on-write and restored pages included)
            pc.evict_for(units + len(plan.admit) * self.layout.slot_units, len(plan.admit), keep=self._wanted())
        restore: list[tuple[list[int], HostEntry]] = []
        for rid in list(plan.admit):
            seq = self.seqs[rid]
            if not self.allocator.can_fit(plan.grow.get(rid, 0), 1):
                if pc is not None and seq.hit is not None and seq.hit.pos:
                    pc.release_hit(seq.hit)
                self._defer_admission(plan, rid)
                continue
            given = self._admit(seq, restore)
            if plan.grow.get(rid, 0) > given:
                self._grow(seq, plan.grow[rid] - given)
        if restore:
            self._write_units(restore)

    def _decode_last_tokens(self, plan: StepPlan) -> None:
        """Admissions whose row computes only their last token, past position 0 (a prefix-cache hit one token
        short of the end), decode it: a cold prefill whose rows end there decodes it too (a running request with
        one token left decodes), and a one-token prefill row rounds differently from a decode row."""
        last = [r for r in plan.prefill if r[0] in plan.admit and r[1] > 0 and r[2] == 1
                and r[1] + 1 == self._replay_total(self.seqs[r[0]]) and not self.seqs[r[0]].internal]
        if last:
            plan.prefill = [r for r in plan.prefill if r not in last]
            plan.decode += [rid for rid, _, _ in last]

    def _wanted(self) -> set[bytes]:
        """Checkpoints that the waiting requests the last plan saw (`_queue_head`) plan to resume from (evicted
        last)."""
        return {s.hit.ckpt.key for s in self._waiting_head
                if s.slot is None and not s.finished and s.hit is not None and s.hit.ckpt is not None}

    def _grow(self, seq: Sequence, units: int) -> None:
        """Give `seq` `units` more MLA units (the same number of pages in every MLA layer)."""
        got = self.allocator.alloc_pages(units)
        self.refs.ref(got)
        per = units // self.cfg.num_mla_layers
        for j in range(self.cfg.num_mla_layers):
            seq.pages[j].extend(got[j * per:(j + 1) * per])

    def _launch(self, rids: list[str], rows: list[tuple[str, int, int]], t: int, decoding: bool) -> "_Flight":
        """Build the batch of `rows` ((request id, start, tokens)) and launch its step program; the device
        results stay where they are until `_land` reads them. What the batch consumed (checkpoint reads,
        copy-on-write copies) is taken off the sequences here, so a next step launched before this one is read
        back does not repeat it."""
        seqs = [self.seqs[r] for r in rids]
        need_pages = max(-(-(s + n) // self.config.page_size) for _, s, n in rows)
        long = not decoding and bool(self.sched_cfg.long_prefill_chunk) and len(rows) == 1
        if long:  # every one-row prefill runs in the long program (scheduler.py: `_plan_rows`)
            t = self.sched_cfg.long_prefill_chunk
        rows_bucket = 1 if long else _fit(len(rows), self.decode_buckets if decoding else self.prefill_buckets)
        pages_bucket = _fit(need_pages, self.decode_context_buckets if decoding and t == 1 else self.context_buckets)
        apart = self._sample is not None and t == 1  # sampled once the step before is read back (`_complete`)
        batch = self._pad_batch(rows_bucket, t, pages_bucket, [(self.seqs[r], s, n) for r, s, n in rows],
                                masks=not apart)
        with step_annotation(rows_bucket, t, pages_bucket):  # a profile's name for the call (serve/profiler.py)
            out = self._step_fn(batch)
        pins = [s.read_pin for s in seqs if s.read_pin is not None]
        offset = 0 if decoding else self.decode_buckets[-1]  # where the program puts its samples in the carry
        samples, epochs = [], []
        for i, (seq, (_, start, n)) in enumerate(zip(seqs, rows)):
            seq.read_slot = seq.read_pin = None
            seq.copies = []
            sampled = start + n >= seq.num_ids + seq.pending  # the row's last position is the sequence's
            if sampled:
                seq.pending += 1
                seq.carry_at = offset + i
            seq.flight_end = start + n
            samples.append(sampled)
            epochs.append(seq.epoch)
        chainable = self._carry is not None and all(self._chains(seq, s + n) for seq, (_, s, n) in zip(seqs, rows))
        return _Flight(seqs, rows, epochs, samples, t, rows_bucket, batch.targets, out, pins, chainable,
                       batch.sampling if apart else None, self.channel.steps if self.channel is not None else 0)

    def _complete(self, f: "_Flight") -> None:
        """Sample a launched decode program's logits (async scheduling), its rows' masks built now that the
        step before it is read back: a structured-output row's constraint and a row's bad words have seen the
        token that step sampled, which was this row's input on the device. Rows of sequences that finished
        meanwhile sample unconstrained (their tokens are dropped when read back)."""
        sampling = f.deferred
        live = [(i, seq, start, n) for i, (seq, (_, start, n)) in enumerate(zip(f.seqs, f.rows)) if not seq.finished]
        allowed = np.full((f.rows_bucket, self.mask_words), -1, np.int32)
        bias_ids, bias_values = np.array(sampling.bias_ids), np.array(sampling.bias_values)
        constrained = self._fill_allowed(allowed, bias_ids, bias_values, live, 1)
        ((logits, table), prompt, accepted), counts = f.out
        sampling = dataclasses.replace(sampling, allowed=allowed, constrained=constrained, bias_ids=bias_ids,
                                       bias_values=bias_values)
        res = self._sample_fn(logits, table, sampling, f.channel_step)
        f.out, f.deferred = ((res, prompt, accepted), counts), None

    def _sample_fn(self, logits, table, sampling, channel_step: int = 0):
        """Run the sample program on a decode program's logits and its rows' first-layer page tables (its
        outputs; the carry updated) -> its SampleResult; a call that grows the jit cache after warm-up counts
        as a compile. The leader of a multi-process engine then sends `sampling` to the followers (once its own
        launch returned, as `_step_fn`), naming the step by its channel number (`channel_step`): each runs the
        same program on the logits it kept."""
        before = self._sample._cache_size()
        res, self._carry = self._sample(self.token_pages, logits, sampling, table, self._carry)
        if self.channel is not None and self.channel.leader and self.warmed_up:
            self.channel.sample(channel_step, sampling)
        self._count_compiles(self._sample._cache_size() > before, f"sample shape {tuple(logits.shape)}")
        return res

    def _chains(self, seq: Sequence, end: int) -> bool:
        """Whether a step may be launched after a row of `seq` ending at `end` before that row is read back:
        not when its next inputs depend on the host seeing the sampled token (beams, drafts; structured outputs
        and bad words unless decode programs sample apart, `_complete`) or when reading it back changes the
        sequence's slot (a KDA checkpoint taken at `end`) or ends an internal row."""
        masks = self._sample is None and (seq.guide is not None or bool(seq.bad_words))  # else: `_complete`
        return (not masks and seq.beam is None and not seq.draft
                and end not in seq.captures and not (seq.internal and end >= seq.num_ids))

    def _land(self, f: "_Flight", touched: set[str]) -> None:
        """Read a launched step's results back: advance its sequences, append their tokens, share pages and
        capture states. A row whose sequence released its memory since the launch (finished, aborted or
        preempted) only gives a preempted sequence the token it sampled."""
        if f.deferred is not None:  # (a failed step's read-back) sample it first
            self._complete(f)
        for ck in f.pins:  # the step has read them (device order: anything launched later runs after it)
            ck.pins -= 1
        (res, prompt, accepted), counts = f.out
        routes = hidden = None
        if self.config.enable_return_routed_experts or self.config.enable_return_hidden_states:
            counts, routes, hidden = counts  # [B, T, L_moe, k] and [B, T, H] (each None unless enabled)
            routes = None if routes is None else np.asarray(routes)
            hidden = np.asarray(hidden) if any(s.hidden is not None for s in f.seqs) else None
        seqs, rows, t, rows_bucket = f.seqs, f.rows, f.t, f.rows_bucket
        tokens, lps, ranks = np.asarray(res.tokens), np.asarray(res.logprob), np.asarray(res.rank)
        if (f.targets >= 0).any():
            self._record_prompt_logprobs(seqs, rows, f.targets, prompt)
        counts = np.asarray(counts)
        self.expert_counts += counts
        if self.eplb is not None and self.eplb.observe(counts):
            self._scheduled_rebalance()
        top_ids, top_lps = np.asarray(res.top_ids), np.asarray(res.top_logprobs)
        verify = tokens.ndim == 2
        accepted = np.asarray(accepted) if verify else None
        self.moe_dispatch_seconds += self.moe_step_seconds.get(rows_bucket * t, 0.0)
        self.inter_rank_bytes += self._moe_exchange_bytes(rows_bucket * t)
        now = time.monotonic()
        for i, (seq, (_, start, n)) in enumerate(zip(seqs, rows)):
            if f.samples[i]:
                seq.pending -= 1
            try:
                if seq.epoch != f.epochs[i]:
                    if f.samples[i] and not (seq.finished or seq.internal or seq.beam is not None or verify):
                        touched.add(seq.rid)
                        self._record_positions(seq, start, routes, hidden, i, n)  # (it may finish on this token)
                        self._append(seq, int(tokens[i]), float(lps[i]), int(ranks[i]), top_ids[i], top_lps[i], now)
                    continue
                if verify:  # (never chained) the drafts rejected were launched but are not computed
                    seq.flight_end = start + 1 + (0 if seq.beam is not None else int(accepted[i]))
                if verify and seq.beam is not None:  # a beam never drafts: its row verified nothing
                    seq.computed = start + 1
                    self._after_row(seq, decoded=True, prev=start)
                    self._park(seq, top_ids[i, 0], top_lps[i, 0])
                    continue
                if verify:  # the input token and the accepted drafts are in the cache; emit those drafts + 1
                    a = int(accepted[i])
                    self._count_drafts(seq, n - 1, a)
                    if seq.guess is not None and n > 1:  # its drafts followed a guess of its input token
                        self.counters["spec_decode_num_guessed_drafts"] += 1
                        self.counters["spec_decode_num_guesses_right"] += seq.id_at(start) == seq.guess
                    seq.guess = None
                    seq.computed = start + 1 + a
                    self._record_positions(seq, start, routes, hidden, i, 1 + a, ahead=seq.draft[:a])
                    if seq.slot is not None:
                        self._after_row(seq, decoded=True, prev=start, ahead=seq.draft[:a])
                    for j in range(a + 1):
                        if seq.finished:
                            break
                        touched.add(seq.rid)
                        self._append(seq, int(tokens[i, j]), float(lps[i, j]), int(ranks[i, j]), top_ids[i, j],
                                     top_lps[i, j], now)
                    seq.draft = []
                    continue
                seq.computed = start + n
                self._record_positions(seq, start, routes, hidden, i, n)
                if seq.internal:
                    self._after_row(seq, decoded=False)
                    if seq.computed == seq.num_ids:
                        self._finish(seq, "canonical")
                    continue
                # Share pages and capture states before the sampled token is appended: a request that
                # finishes on this token (max_tokens=1, a stop) releases its memory in `_append`.
                if seq.slot is not None:
                    self._after_row(seq, decoded=t == 1)
                if not seq.finished and seq.computed == seq.num_ids and seq.beam is not None:
                    self._park(seq, top_ids[i], top_lps[i])
                elif not seq.finished and seq.computed == seq.num_ids:
                    touched.add(seq.rid)
                    self._append(seq, int(tokens[i]), float(lps[i]), int(ranks[i]), top_ids[i], top_lps[i], now)
            except Exception as e:  # this request's bookkeeping only: it ends, the others go on
                self._host_failed(seq.request_id, e)

    def _record_positions(self, seq: Sequence, start: int, routes: Optional[np.ndarray],
                          hidden: Optional[np.ndarray], row: int, n: int, ahead: list[int] = ()) -> None:
        """Keep the hidden states and routed ids of the n positions from `start` that row `row` of a read-back
        step computed for `seq` (if it asked: return_hidden_states, enable_return_routed_experts), and give the
        routes store the granules they complete. `ahead`: a verify row's accepted drafts, computed but not
        appended to the sequence yet."""
        if seq.hidden is not None and hidden is not None:
            seq.hidden.write(start, hidden[row, :n])
        if routes is None or seq.routes is None:
            return
        seq.routes.write(start, routes[row, :n])
        store = self.routes_store
        if store is not None and seq.hasher is not None and (start + n) // store.granule > start // store.granule:
            seq.hasher.extend(seq.ids() + list(ahead) if ahead else seq.ids())
            store.put(seq.hasher, seq.routes.ids, start, start + n)

    def _record_prompt_logprobs(self, seqs: list[Sequence], rows, targets: np.ndarray, prompt) -> None:
        """Store the chunk's prompt logprobs: position k of a row starting at s scores prompt token s+k+1."""
        lp, rank = np.asarray(prompt.logprob), np.asarray(prompt.rank)
        top_ids, top_lps = np.asarray(prompt.top_ids), np.asarray(prompt.top_logprobs)
        for i, (seq, (_, start, _)) in enumerate(zip(seqs, rows)):
            if seq.prompt_lps is None:
                continue
            dec = self._token_text(seq.params)
            n = seq.params.prompt_logprobs
            for k in np.flatnonzero(targets[i] >= 0):
                tok = int(targets[i, k])
                seq.prompt_lps[start + k + 1] = TokenLogprobs(
                    Logprob(tok, float(lp[i, k]), dec(tok), int(rank[i, k])),
                    _alternatives(top_ids[i, k], top_lps[i, k], n, dec))

    def _pad_batch(self, rows: int, t: int, pages: int, items: list[tuple[Sequence, int, int]],
                   masks: bool = True) -> StepBatch:
        """The padded batch of `items` ((sequence, start, tokens)) for a (rows, t, pages) program; with
        `masks` False the rows' allowed-token masks are left open (a deferred sample builds them)."""
        lay, lm = self.layout, max(1, self.cfg.num_mla_layers)
        tokens = np.zeros((rows, t), np.int32)
        valid = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        read = np.full(rows, -1, np.int32)
        write = np.full(rows, lay.scratch_slot, np.int32)
        tables = self.page_tables
        tables.begin_batch()
        table_rows = np.full(rows, tables.pad_row, np.int32)
        copies = []
        params, seeds, steps, plens, bans = [], [], [], [], []
        targets = np.full((rows, t), -1, np.int32)
        lora_slots = np.zeros(rows, np.int32)  # 0: the base model
        splice = np.full(rows, -1, np.int32)  # async scheduling: the carry entry holding a row's first token
        pos = t if self.spec is not None and t == self.spec.verify_tokens else 1  # verify: a mask per position
        allowed = np.full((rows * pos, self.mask_words), -1, np.int32)
        embeds = embed_mask = None
        if self.config.enable_prompt_embeds:  # every program takes them: any row may hold prompt positions
            embeds = np.zeros((rows, t, self.cfg.hidden_size), self.model.dtype)
            embed_mask = np.zeros((rows, t), bool)
        for i, (seq, start, n) in enumerate(items):
            ids = seq.ids()
            if seq.embeds is not None and start < len(seq.embeds):
                k = min(n, len(seq.embeds) - start)
                embeds[i, :k], embed_mask[i, :k] = seq.embeds[start:start + k], True
            row = ids[start:start + n]
            if start == len(ids) and seq.pending:  # its input token is still on the device, sampled in flight
                if n - 1 > len(seq.draft) or seq.carry_at < 0:
                    raise AssertionError(f"{seq.rid}: a row of {n} tokens at {start} after a token in flight")
                row, splice[i] = [0], seq.carry_at
            tokens[i, :n] = row + seq.draft[:n - len(row)]  # a verify row: the last token, then its drafts
            if seq.prompt_lps is not None and start + 1 < len(seq.prompt_ids):  # the next prompt tokens
                nxt = seq.prompt_ids[start + 1:start + n + 1]
                targets[i, :len(nxt)] = nxt
            valid[i], lengths[i], write[i] = n, start, seq.slot
            lora_slots[i] = seq.lora.slot if seq.lora is not None else 0
            read[i] = seq.read_slot if seq.read_slot is not None else (-1 if start == 0 else seq.slot)
            copies += seq.copies
            if self.cfg.num_mla_layers:
                table_rows[i] = tables.row_of(seq, seq.page_table())
            params.append(seq.params)
            seeds.append(seq.seed)
            steps.append(len(seq.output_ids) + seq.pending)
            plens.append(len(seq.prompt_ids))
            bans.append(seq.checker.min_tokens_ban() if len(seq.output_ids) + seq.pending < seq.params.min_tokens
                        else None)
        sb = SamplingBatch.from_params(params, seeds, steps, rows, plens, bans, BIAS_WIDTH, allowed,
                                       processors=self.logits_processors)
        if masks:
            constrained = self._fill_allowed(allowed, sb.bias_ids, sb.bias_values,
                                             [(i, seq, start, n) for i, (seq, start, n) in enumerate(items)], pos)
            sb = dataclasses.replace(sb, constrained=constrained)
        ncopy = rows * lm
        src = np.full(ncopy, lay.scratch_page, np.int32)
        dst = np.full(ncopy, lay.scratch_page, np.int32)
        if copies:
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
        # numpy leaves: the jitted step transfers them in its C++ dispatch (jnp.asarray would cost a
        # Python-level primitive call per array, ~0.4 ms per step)
        return StepBatch(tokens, valid, lengths, read, write, table_rows, src, dst, sb, targets, lora_slots, embeds,
                         embed_mask, self._carry, splice if self._carry is not None else None, pages)

    def _fill_allowed(self, allowed: np.ndarray, bias_ids: np.ndarray, bias_values: np.ndarray,
                      rows: list[tuple[int, Sequence, int, int]], pos: int) -> np.ndarray:
        """Write the next-token masks of `rows` ((batch row, sequence, start, tokens)) into `allowed`
        [B * pos, W] (`pos` masks a row: a verify batch's positions): the structured-output constraint of each
        row that samples its sequence's next token (and, for verify rows, after each draft), then bad words.
        -> [B] bool: the rows masked by an active constraint (their raw logprobs are taken after the mask).

        Bad words go where raw logprobs do not see them (vLLM bans them in its sampler, after its logprobs):
        an unconstrained row's into its mask (its logprobs are the raw logits'), a constrained row's into its
        logit bias (`bias_ids` / `bias_values` [B, N], in place; a mask would change its logprobs), the few
        that find no room there into the mask. A constraint whose every continuation is banned keeps them (the
        output stays valid: the constraint wins over the bans, as `sample` makes it win over min_tokens')."""
        guided = [(seq.guide, i * pos) for i, seq, start, n in rows
                  if seq.guide is not None and start + n >= seq.num_ids]  # this row samples the next token
        constrained = np.zeros(allowed.shape[0] // pos, bool)
        for g, i in guided:
            constrained[i // pos] = g.active
        if guided:
            t0 = time.perf_counter()
            fill_masks(guided, allowed)
            for i, seq, start, n in rows:  # verify rows: the mask after each draft too
                if seq.guide is not None and n > 1:
                    seq.guide.fill_drafts(seq.draft[:n - 1], allowed[i * pos + 1:i * pos + n])
            self.mask_seconds += time.perf_counter() - t0
        for i, seq, start, n in rows:
            if seq.bad_words and start + n == len(seq.prompt_ids) + len(seq.output_ids):  # never drafts
                row = allowed[i * pos]
                banned = allowed_tokens(row, banned_tokens(seq.bad_words, seq.output_ids))
                if not banned or len(banned) >= count_allowed(row):  # nothing to ban, or nothing would be left
                    continue
                if constrained[i]:
                    banned = ban_in_bias(bias_ids[i], bias_values[i], banned)
                clear_bits(row, banned)
        return constrained

    def _token_text(self, params: SamplingParams):
        """token id -> its text for logprobs ("" without a tokenizer or with detokenize=False)."""
        if self.tokenizer is None or not params.detokenize:
            return lambda i: ""
        return lambda i: self.tokenizer.decode([i], skip_special=False)

    def _append(self, seq: Sequence, tok: int, lp: float, rank: int, top_ids, top_lps, now: float) -> None:
        m = seq.metrics
        if m.first_token_time is None:  # its prefill ended: vLLM counts the prompt's tokens now, once
            m.first_token_time = now
            self.counters["prompt_tokens"] += len(seq.prompt_ids)
            self.counters["prompt_tokens_cached"] += seq.cached_tokens or 0
        elif m.last_token_time is not None and now > m.last_token_time:  # once per step (several with drafts)
            self.latency["itl"].append(now - m.last_token_time)
        m.last_token_time = now
        seq.output_ids.append(tok)
        self.counters["generation_tokens"] += 1
        if seq.params.logprobs is not None:
            n = seq.params.logprobs
            dec = self._token_text(seq.params)
            seq.logprobs.append(TokenLogprobs(Logprob(tok, lp, dec(tok), rank),
                                              _alternatives(top_ids, top_lps, n, dec)))
            seq.cum_logprob += lp
        last, failed = False, None
        if seq.guide is not None:
            if not seq.guide.advance(tok):  # a limit of llguidance's hit mid-way (or a bug): never "stop"
                failed = first_line(seq.guide.error) or f"token {tok} is outside the constraint"
                log.error("request %s: token %d broke its structured-output constraint: %s",
                          loggable(seq.request_id), tok, failed)
                self.counters["structured_output_errors"] += 1
            last = failed is not None or seq.guide.done
        r = seq.checker.append(tok, last=last)
        if failed is not None:  # vLLM's FINISHED_ERROR: the output is not in the language
            self._finish(seq, "error", failed)
        elif r.finished:
            self._finish(seq, r.finish_reason, r.stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finished, seq.finish_reason, seq.stop_reason = True, reason, stop_reason
        self._ended.add(seq.request_id)
        seq.metrics.finished_time = time.monotonic()
        self._release(seq)
        if seq.lora is not None:
            self.loras.release(seq.lora, seq.rid)
        if self.kv_role in ("kv_producer", "kv_both") and reason != "abort" and not seq.internal:
            # disaggregated prefill: what a consumer engine needs to resume this prompt, into the shared store
            self.counters["kv_transfer_published"] += self.prefix_cache.publish(seq.hasher, len(seq.prompt_ids)) > 0
        if seq.internal:
            self.seqs.pop(seq.rid, None)
            self._canonical_pending.pop(seq.rid, None)
            return
        # (not for prompts given as embeddings: a tail would keep the request's vectors alive after it ends)
        if self.prefix_cache is not None and reason != "abort" and not seq.reused and seq.embeds is None:
            h = seq.hasher.fresh()
            h.extend(seq.all_ids)
            self._tails[seq.rid] = (h, seq.lora)  # see _canonicalize_shared_tails
            while len(self._tails) > MAX_TAILS:
                self._tails.popitem(last=False)
        if self.suffix is not None and reason != "abort" and seq.beam is None and seq.embeds is None:
            self.suffix.add_response(seq.prompt_ids, seq.output_ids, seq.tenant)  # drafted from later
        req = self.requests[seq.request_id]
        if req.finished and reason != "abort":
            self.counters["requests_finished"] += 1
            m = seq.metrics
            for k, v in (("ttft", m.ttft), ("e2e", m.e2e), ("queue", m.queue_time)):
                if v is not None:
                    self.latency[k].append(v)

    def _release(self, seq: Sequence) -> None:
        pc = self.prefix_cache
        if pc is not None and seq.hit is not None and seq.slot is not None:
            pc.unpin(seq.hit)  # admitted but never ran
        if seq.read_pin is not None:
            seq.read_pin.pins -= 1
        seq.hit = seq.read_pin = seq.read_slot = None
        seq.copies, seq.registered_pages = [], 0
        seq.epoch, seq.flight_end = seq.epoch + 1, 0
        self.page_tables.release(seq)
        if seq.slot is not None:
            self.allocator.free_slot(seq.slot)
            seq.slot = None
        self._running.pop(seq.rid, None)  # (a forked beam's parent gave its slot to `_FrozenSlot` before)
        for p in seq.pages:
            self.refs.unref(p)
            p.clear()
        seq.pages_changed()
        self._enqueue(seq)  # (one finished, or a beam awaiting its selection, is dropped when met)

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        """Free everything; the request is recomputed (prompt + outputs so far) when readmitted. `counted`:
        a preemption (vLLM's `num_preemptions`: for memory, or a failed step's lost cache); a `retract` frees
        the cache the same way but is counted apart (`requests_retracted`), so a dashboard alerting on
        preemptions (memory pressure) does not fire on every RL weight sync."""
        self._release(seq)
        seq.computed = 0
        seq.captures, seq.draft = {}, []
        seq.preempted = True
        self.counters["preemptions"] += counted

    def _reap(self) -> None:
        """Forget requests whose outputs were delivered (not those a step read back outside `step()` finished:
        the next `step()` returns their outputs). Only the requests a sequence of which ended since (`_ended`)
        are looked at: walking every request after every step cost host time growing with the queue."""
        owed = {self.seqs[r].request_id for r in self._landed if r in self.seqs}
        for rid in [r for r in self._ended if r not in owed]:
            req = self.requests.get(rid)
            if req is not None and req.finished:
                for s in req.seqs:  # (its sequences first: a Ctrl-C here leaves the request to reap)
                    self.seqs.pop(s.rid, None)
                    self._unqueue(s)
                del self.requests[rid]
            self._ended.discard(rid)  # (one of several samples ended: the last one's end names it again)
        if not self.seqs:  # (what the queue still holds of requests aborted while waiting goes with them)
            self._queue.clear()
            self._queued.clear()
            self._queued_loras.clear()

    def _seat(self, seq: Sequence) -> None:
        """Enter a new sequence into `self.seqs` (its place: the scheduler's order among equals) and the queue."""
        seq.place = next(self._places)
        self.seqs[seq.rid] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Queue a request's sequence that may wait (new, or its memory given back) in (priority, arrival) order."""
        if seq.internal is None and not seq.finished and seq.place not in self._queued:
            bisect.insort(self._queue, (seq.priority, seq.order, seq.place, seq))
            self._queued[seq.place] = uid = seq.lora.uid if seq.lora is not None else 0
            self._queued_loras[uid] += 1

    def _unqueue(self, seq: Sequence) -> None:
        """Take a sequence that leaves `self.seqs` out of the queue now: its entry, left for `_waiting` to meet,
        kept an aborted waiting request (its prompt, grammar, embeddings) alive for as long as requests ahead of
        it waited (under a steady stream of higher-priority requests: forever, one more per abort)."""
        if seq.place in self._queued:
            i = bisect.bisect_left(self._queue, (seq.priority, seq.order, seq.place))  # (places are unique)
            if i < len(self._queue) and self._queue[i][2] == seq.place:
                del self._queue[i]
            self._dequeued(seq.place)

    def _waiting(self, n: int) -> list[tuple]:
        """The first `n` entries (priority, arrival, place, seq) of the waiting requests' sequences in that order
        (all when fewer wait); the entries met of sequences that no longer wait (admitted, finished, awaiting a
        beam selection) leave the queue."""
        q, out, i = self._queue, [], 0
        while i < len(q) and len(out) < n:
            s = q[i][3]
            if self._waits(s):
                out.append(q[i])
            else:
                self._dequeued(s.place)
            i += 1
        q[:i] = out
        return out

    def _waits(self, seq: Sequence) -> bool:
        """Whether a queued sequence still waits (not admitted, finished, awaiting a beam selection or forgotten)."""
        return seq.slot is None and not seq.finished and seq.proposals is None and self.seqs.get(seq.rid) is seq

    def _waits_at(self, place: tuple) -> bool:
        """Whether a waiting sequence has this place (priority, arrival) in the queue: a bisection of `_queue`
        (a running canonical row keeps a place while the request that lent it waits, `_deferred`); the walk of
        every waiting request it replaces cost every step host time growing with the queue while such a row ran."""
        q = self._queue
        i = bisect.bisect_left(q, place)
        while i < len(q) and q[i][:2] == place:
            if self._waits(q[i][3]):
                return True
            i += 1
        return False

    def _dequeued(self, place: int) -> None:
        """Forget the queue entry of the sequence at `place` (taken out of `_queue`)."""
        uid = self._queued.pop(place, None)
        if uid is None:
            return
        self._queued_loras[uid] -= 1
        if not self._queued_loras[uid]:
            del self._queued_loras[uid]

    def _output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return self._beam_output(req)
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = [self._completion(s, delta) for s in req.seqs]
        for s, o in zip(req.seqs, outs):
            if o is not None and s.routes is not None and s.finish_reason in ("stop", "length"):
                o.routed_experts = s.routes.first(len(s.prompt_ids) + len(s.output_ids) - 1)
                self.counters["routed_experts_incomplete"] += bool((o.routed_experts < 0).any())
            if o is not None and s.hidden is not None and s.finish_reason in ("stop", "length"):
                o.hidden_states = s.hidden.first(len(s.prompt_ids) + len(s.output_ids) - 1)
        outs = [o for o in outs if o is not None]
        first = min((s.metrics.first_token_time for s in req.seqs if s.metrics.first_token_time), default=None)
        req.metrics.first_token_time = first
        req.metrics.last_token_time = max((s.metrics.last_token_time for s in req.seqs if s.metrics.last_token_time),
                                          default=None)
        req.metrics.first_scheduled_time = min((s.metrics.first_scheduled_time for s in req.seqs
                                                if s.metrics.first_scheduled_time), default=None)
        if req.finished:
            req.metrics.finished_time = max(s.metrics.finished_time for s in req.seqs)
        cached = max((s.cached_tokens or 0 for s in req.seqs), default=0)
        prompt_lps = list(req.seqs[0].prompt_lps) if req.seqs[0].prompt_lps is not None else None
        if delta and req.reported:
            prompt_lps = None
        req.reported = True
        return RequestOutput(req.request_id, req.prompt, [] if req.embeds else req.prompt_ids, outs, req.finished,
                             req.metrics, cached, prompt_lps)

    @staticmethod
    def _completion(s: Sequence, delta: bool) -> Optional[CompletionOutput]:
        """A sequence's output: everything so far, or (`delta`) what is new since its last one (None: nothing;
        a finish counts as new once)."""
        lps = s.params.logprobs is not None
        if not delta:
            return CompletionOutput(s.index, s.checker.text, list(s.output_ids), s.finish_reason, s.stop_reason,
                                    list(s.logprobs) if lps else None, s.cum_logprob if lps else None)
        if s.sent is None:  # its finish went out
            return None
        (k, c), chunks = s.sent, s.checker.chunks
        if len(s.output_ids) == k and chunks == c and s.finish_reason is None:
            return None
        out = CompletionOutput(s.index, s.checker.text_from(c), s.output_ids[k:], s.finish_reason, s.stop_reason,
                               s.logprobs[k:] if lps else None, s.cum_logprob if lps else None)
        s.sent = None if s.finish_reason is not None else (len(s.output_ids), chunks)
        return out

    # ---- beam search (serve/beam_search.py) ------------------------------------------------------
    def _park(self, seq: Sequence, top_ids, top_lps) -> None:
        """A beam computed its last token: keep its proposals for the group's selection (it is not
        scheduled until then)."""
        n = seq.beam.params.proposals
        seq.proposals = (np.asarray(top_ids[:n]).tolist(), np.asarray(top_lps[:n]).tolist())

    def _unpark_for_laggards(self, stuck: bool = False) -> bool:
        """A beam search with a beam waiting for memory (preempted, or forked without room) cannot select
        until that beam has computed: its beams that have their proposals give their memory back so the
        laggard can run (their proposals stay; their continuations recompute). `stuck` (the plan runs nothing,
        nothing in flight): a laggard that holds its slot counts too, since its next row may need the pages a
        sibling's last decode took before parking, and only that sibling's memory lets it go on -> whether
        any beam gave its memory back."""
        released = False
        for req in self._beams.values():
            if any((s.slot is None or stuck) and s.proposals is None for s in req.seqs):
                for s in req.seqs:
                    if s.proposals is not None and s.slot is not None:
                        self._release(s)
                        s.computed, released = 0, True
        return released

    def _select_beams(self) -> set[str]:
        """One selection round for every beam search whose live beams all have their proposals: keep
        the best `beam_width` continuations (a beam chosen once continues in place, one chosen k > 1
        times forks into k), or finish -> the ids of the searches that ended."""
        now, ended = time.monotonic(), set()
        for rid, req in list(self._beams.items()):
            beams = req.seqs
            if not beams or any(s.proposals is None for s in beams):
                continue
            try:
                if self._select_beam(rid, req, now):
                    ended.add(rid)
            except Exception as e:  # this search only: it ends, the others go on
                self._host_failed(rid, e)
        self._sweep_frozen()
        return ended

    def _select_beam(self, rid: str, req: Request, now: float) -> bool:
        """One selection round of beam search `rid` (`_select_beams`) -> whether it ended."""
        g, beams = req.beam, req.seqs
        p = g.params
        survivors, done = expand([(s.hyp, *s.proposals) for s in beams], p.beam_width, g.eos_ids, g.prompt_len,
                                 p.length_penalty)
        g.completed += done
        g.rounds += 1
        if g.rounds == 1:
            g.cached_tokens = beams[0].cached_tokens or 0
        m = beams[0].metrics  # shared by the request's beams
        if m.first_token_time is None:  # (the prompt's tokens, once for the search, as `_append` counts them)
            m.first_token_time = now
            self.counters["prompt_tokens"] += g.prompt_len
            self.counters["prompt_tokens_cached"] += g.cached_tokens
        elif m.last_token_time is not None:
            self.latency["itl"].append(now - m.last_token_time)
        m.last_token_time = now
        self.counters["generation_tokens"] += len(beams)
        if g.rounds >= p.max_tokens or not survivors:
            g.final = best(g.completed + [h for _, h in survivors], p.beam_width, g.prompt_len, p.length_penalty)
            self._ended.add(rid)
            for s in beams:
                self._drop_beam(s)
            req.seqs = []
            del self._beams[rid]
            m.finished_time = now
            self.counters["requests_finished"] += 1
            for k, v in (("ttft", m.ttft), ("e2e", m.e2e), ("queue", m.queue_time)):
                if v is not None:
                    self.latency[k].append(v)
            return True
        chosen: list[list[tuple[int, Hypothesis]]] = [[] for _ in beams]
        for rank, (i, h) in enumerate(survivors):
            chosen[i].append((rank, h))
        ranked = []
        for s, mine in zip(beams, chosen):
            if len(mine) == 1:
                s.hyp, s.proposals = mine[0][1], None
                if s.slot is None:  # (its memory went to a laggard sibling: it waits again)
                    self._enqueue(s)
                s.output_ids.append(s.hyp.tokens[-1])
                ranked.append((mine[0][0], s))
            elif mine:
                ranked += zip([r for r, _ in mine], self._fork_beam(s, [h for _, h in mine]))
            else:
                self._drop_beam(s)
        req.seqs = [s for _, s in sorted(ranked, key=lambda x: x[0])]
        for i, s in enumerate(req.seqs):
            s.index = i
        return False

    def _fork_beam(self, parent: Sequence, hyps: list[Hypothesis]) -> list[Sequence]:
        """Children of a beam chosen more than once. Each shares the parent's full MLA pages, gets a
        copy of its partial last page, and reads the parent's KDA state slot in its next step while
        writing its own (the slot is frozen meanwhile: nothing writes a slot a step reads). A child
        that finds no memory waits like a preempted request and recomputes its tokens."""
        lm, ps = self.cfg.num_mla_layers, self.config.page_size
        src, full, part = parent.pages, parent.computed // ps, parent.computed % ps
        frozen = None
        # a KDA checkpoint just taken at the parent's row end holds its state (its own slot is still unwritten)
        read = (parent.read_slot, parent.read_pin) if parent.read_pin is not None else None
        if parent.slot is not None:
            frozen = _FrozenSlot(parent.slot, [u for p in src for u in p])
            parent.slot, parent.pages = None, [[] for _ in range(lm)]  # their holds move to `frozen`
        kids = []
        for h in hyps:
            c = Sequence(rid=f"{parent.request_id}#b{next(self._beam_ids)}", request_id=parent.request_id, index=0,
                         order=parent.order, prompt_ids=parent.prompt_ids, params=parent.params, seed=parent.seed,
                         checker=parent.checker, metrics=parent.metrics, output_ids=list(h.tokens),
                         pages=[[] for _ in range(lm)], priority=parent.priority, lora=parent.lora, beam=parent.beam,
                         hyp=h, hasher=parent.hasher.copy() if parent.hasher is not None else None,
                         reused=parent.reused, cached_tokens=parent.cached_tokens, embeds=parent.embeds)
            if frozen is not None and self._share_beam(c, frozen, src, full, part, read):
                c.computed, c.registered_pages = parent.computed, min(parent.registered_pages, full)
                self.counters["beam_forks"] += 1
            else:
                self.counters["beam_fork_recomputes"] += 1
            if c.lora is not None:
                c.lora.requests.add(c.rid)
            self._seat(c)
            kids.append(c)
        if frozen is not None:
            self._frozen.append(frozen)
        self._drop_beam(parent)
        return kids

    def _share_beam(self, child: Sequence, frozen: "_FrozenSlot", src: list[list[int]], full: int, part: int,
                    read: Optional[tuple] = None) -> bool:
        """Give a forked beam its slot (reading `frozen`, or the parent's pending `read`: (slot, pinned checkpoint)),
        the shared pages and its partial-page copy."""
        lm = self.cfg.num_mla_layers
        fresh = lm if part else 0
        if self.prefix_cache is not None:
            self.prefix_cache.evict_for(fresh, 1, keep=self._wanted())
        if not self.allocator.can_fit(fresh, 1):
            return False
        child.slot = self.allocator.alloc_slot()
        self._running[child.rid] = child
        new = self.allocator.alloc_pages(fresh)
        self.refs.ref(new)
        for l in range(lm):
            shared = src[l][:full]
            self.refs.ref(shared)
            child.pages[l] = shared + new[l:l + 1]
        child.copies = [(src[l][full], new[l]) for l in range(len(new))]
        child.read_slot, child.read_pin = read if read is not None else (frozen.slot, frozen)
        child.read_pin.pins += 1
        return True

    def _drop_beam(self, seq: Sequence) -> None:
        """A beam that no continuation needs: free what it holds and forget it."""
        self._release(seq)
        seq.finished, seq.finish_reason, seq.proposals = True, "beam", None
        self._ended.add(seq.request_id)
        if seq.lora is not None:
            self.loras.release(seq.lora, seq.rid)
        self.seqs.pop(seq.rid, None)
        self._unqueue(seq)  # (`_release` queued it: it was not finished yet)

    def _sweep_frozen(self) -> None:
        """Free the frozen parents every child has read (or given up on)."""
        keep = []
        for f in self._frozen:
            if f.pins > 0:
                keep.append(f)
            else:
                self.allocator.free_slot(f.slot)
                self.refs.unref(f.units)
        self._frozen = keep

    def _beam_output(self, req: Request) -> RequestOutput:
        """A beam search reports once, when it ends: its best hypotheses, best first."""
        g, outs = req.beam, []
        skip = not g.params.include_stop_str_in_output
        dec = (lambda ids, skip=True: self.tokenizer.decode(ids, skip_special=skip)) if self.tokenizer else (
            lambda ids, skip=True: "")
        for i, h in enumerate(g.final or ()):
            lps = [_beam_logprobs(t, lp, alts, dec) for t, lp, alts in zip(h.tokens, h.logprobs, h.proposals)]
            # vLLM's: the EOS that ended a hypothesis stays in its token ids but never in its text, and is its
            # stop_reason
            shown = list(h.tokens[:-1] if h.eos else h.tokens)
            reason = "abort" if g.aborted else "stop" if h.eos else "length"
            outs.append(CompletionOutput(i, dec(shown, skip), list(h.tokens), reason,
                                         h.tokens[-1] if h.eos and not g.aborted else None, logprobs=lps,
                                         cumulative_logprob=h.cum_logprob))
        return RequestOutput(req.request_id, req.prompt, [] if req.embeds else req.prompt_ids, outs, req.finished,
                             req.metrics, g.cached_tokens, None)

    # ---- introspection --------------------------------------------------------------------------
    def _moe_exchange_bytes(self, tokens: int) -> int:
        """Expert-parallel traffic of a step of `tokens` (padded) tokens (`k3jax.sharding.moe_exchange_bytes`:
        a ring estimate from the program's shapes, not a measurement; tensor-parallel collectives, which
        GSPMD inserts, are not counted). 0 without expert parallelism."""
        return moe_exchange_bytes(self.expert_counts.shape[0], tokens, self.cfg.num_experts_per_token,
                                  self.cfg.expert_in_size, self._ep_ranks, self.mesh.size if self.mesh is not None else 1)

    def cache_config(self) -> dict:
        """The cache's configuration as it was built (vLLM's `cache_config_info` labels, plus the arena's)."""
        c, lay = self.config, self.layout
        return {"block_size": c.page_size, "num_gpu_blocks": lay.num_units, "unit_bytes": lay.unit_bytes,
                "kda_slot_units": lay.slot_units, "cache_dtype": lay.codec.kind, "kda_state_dtype": lay.state_dtype,
                "enable_prefix_caching": bool(c.enable_prefix_caching), "host_cache_bytes": c.host_cache_bytes,
                "gpu_memory_utilization": c.gpu_memory_utilization if c.sizes_from_memory else None}

    def stats(self) -> dict:
        live = [s for s in self.seqs.values() if not s.finished and not s.internal]
        by_kind = self.allocator.bytes_by_kind()
        cached = self._cached_units()
        return {
            **self.counters,
            "compiles_after_warmup": self.compiles_after_warmup,
            "num_requests_running": sum(1 for s in live if s.slot is not None),
            "num_requests_waiting": sum(1 for s in live if s.slot is None),
            "arena_bytes": by_kind,
            "memory_plan": self.memory_plan.as_dict() if self.memory_plan is not None else None,
            "arena_free_units": self.allocator.free_units,
            "arena_baseline_free_units": self.allocator.baseline_free_units,
            "kv_cache_usage": kv_cache_usage(self.allocator.free_units, cached, self.allocator.baseline_free_units),
            "arena_cached_units": cached,
            **self.page_tables.counters, "page_tables_bytes": self.page_tables.nbytes,
            "expert_counts": self.expert_counts.tolist(),
            "moe_layers": [l for l in range(self.cfg.num_hidden_layers) if self.cfg.is_moe(l)],
            "moe_dispatch_seconds": self.moe_dispatch_seconds,
            "structured_output_mask_seconds": self.mask_seconds,
            "iteration_tokens": self.iteration_tokens.as_dict(),  # tokens per step, by bucket (vLLM's histogram)
            "moe_step_seconds": dict(self.moe_step_seconds),
            "inter_rank_bytes": self.inter_rank_bytes,  # expert-parallel MoE traffic; 0 on one device
            # expert-parallel load balancing (serve/eplb.py): placements planned, layers moved, the last plan
            "eplb": self.eplb.stats() if self.eplb is not None else None,
            "mesh": dict(self.mesh.shape) if self.mesh is not None else None,
            "processes": len(mesh_processes(self.mesh)) if self.mesh is not None else 1,
            # multi-process: host seconds the leader spent sending step batches and samples to the followers
            "step_broadcast_seconds": self.channel.seconds if self.channel is not None else 0.0,
            "step_broadcast_bytes": self.channel.bytes if self.channel is not None else 0,
            "sharding": self.config.sharding,
            # ranks the KDA heads (and state slots) are split over; arena_bytes are one rank's
            "arena_state_ranks": self.layout.state_ranks,
            # ranks the MLA pages are split over by position (decode context parallelism; 1: whole pages)
            "arena_context_ranks": self.layout.context_ranks,
            "new_token_ratio": self.new_token_ratio,  # admission look-ahead (serve/scheduler.py)
            "sleep_level": self.sleep_level,  # 0 awake (vLLM's sleep mode: Engine.sleep / wake_up)
            # MLA latent storage: "auto" (model dtype) or "fp8"; bytes of one token in one MLA layer
            "kv_cache_dtype": self.layout.codec.kind,
            "kv_bytes_per_token_per_layer": self.layout.latent_words * 4,  # a rank holds 1 / arena_context_ranks
            # KDA recurrent state storage and one state slot's bytes (every KDA layer, this rank's heads)
            "kda_state_dtype": self.layout.state_dtype,
            "kda_slot_bytes": self.layout.slot_units * self.layout.unit_bytes,
            "expert_format": self.cfg.expert_format,  # as the step reads them ("dense" once dequantized)
            "dense_weight_layout": "in_out" if self.dense_in_out else "out_in",
            "deterministic_inference": self.config.enable_deterministic_inference,
            "decode_forms": {"kda": "in_place" if self.kda_in_place else "gathered",
                             "mla": ("paged" if self.mla_paged else "gathered")
                                    + ("_context_parallel" if self.layout.context_ranks > 1 else "")},
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache else {},
            # enable_return_routed_experts: the host store of cached prefixes' routed ids (serve/routed_experts.py)
            "routed_experts_store": ({"bytes": self.routes_store.bytes, "budget": self.routes_store.budget,
                                      "granules": len(self.routes_store.blocks), "evicted": self.routes_store.evicted}
                                     if self.routes_store is not None else {}),
            "cache_config": self.cache_config(),
            "spec_decode_accepted_per_pos": self.spec_accepted_per_pos.tolist(),
            # verify / plain decode step time per decode bucket (warm-up) and decode steps whose drafts
            # were dropped because they were not expected to pay (serve/speculative.DraftGate)
            "spec_decode_cost_ratio": dict(self.gate.cost) if self.gate else {},
            "spec_decode_skipped_steps": self.gate.skipped_steps if self.gate else 0,
            # LoRA (vLLM's lora_requests_info): slots, and the adapters with requests running / waiting
            "max_loras": self.config.max_loras,
            "lora_bytes": self.lora_bytes,  # device memory of the adapter slots (beside the weights, not the arena)
            "lora_adapters": self.list_loras(),
            "lora_adapters_in_slots": sorted(a.name for a in self.loras.in_slot.values()),
            "lora_requests": {a.name: {"running": sum(1 for s in live if s.lora is a and s.slot is not None),
                                       "waiting": sum(1 for s in live if s.lora is a and s.slot is None)}
                              for a in self.loras.by_name.values()},
        }

    def slot_bytes(self, base: int) -> np.ndarray:
        """Host copy of one KDA slot's contents, every rank's part (tests use it to check checkpoints
        never change)."""
        return np.asarray(self.arena[base:base + self.layout.slot_units]).reshape(-1)

    def _cached_units(self) -> int:
        """Units held only by the prefix cache (reclaimable by eviction)."""
        return self.prefix_cache.evictable()[0] if self.prefix_cache else 0


def _beam_logprobs(token: int, logprob: float, proposals, dec) -> TokenLogprobs:
    """A hypothesis token's logprobs (its Logprob first, then the alternatives its beam proposed at that step,
    ranked by place)."""
    alts = _alternatives([a for a, _ in proposals], [x for _, x in proposals], len(proposals),
                         lambda a: dec([a], False))
    rank = next((a.rank for a in alts if a.token_id == token), None)
    return TokenLogprobs(Logprob(token, logprob, dec([token], False), rank), alts)


def kv_cache_usage(free: int, cached: int, baseline: int) -> float:
    """vLLM's kv_cache_usage_perc: the share of the arena requests hold; units only the prefix cache holds are
    free (evicted on demand), as vLLM counts its cached blocks with no request on them."""
    return 1.0 - (free + cached) / baseline if baseline else 0.0


def _zeros(shape, dtype, sharding=None) -> jax.Array:
    zeros = lambda: jax.numpy.zeros(shape, dtype)
    return zeros() if sharding is None else jax.jit(zeros, out_shardings=sharding)()


def _close_engine(ref) -> None:
    engine = ref()
    if engine is not None:
        try:
            engine.close()
        except Exception:  # interpreter exit: the followers' coordinator may be gone already
            log.warning("could not release the follower processes", exc_info=True)


def _fit(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
