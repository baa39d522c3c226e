"""`k3jax serve`: the OpenAI-compatible HTTP server (uvicorn + serve/api.py).

The server listens at once; the model is loaded and every step bucket compiled in a background thread
afterwards, so `/health` answers 503 during warm-up and 200 once the engine serves. The persistent JAX
compilation cache (`--compile-cache-dir`, else JAX's `JAX_COMPILATION_CACHE_DIR`, else `~/.cache/k3jax/jax`;
`--no-compile-cache` leaves JAX's own settings alone) makes later starts much faster.

The defaults fit a small CPU machine: `k3-small` (seeded weights, byte tokenizer), context 512,
up to 8 concurrent sequences, decode buckets of 1 and 8 rows and one prefill row of 64 tokens, all over
the whole context (32 pages): three step programs in all. Add buckets (`--decode-buckets 1,4,8`,
`--context-buckets 8,32`, ...) where steps are cheap enough for padding to matter (accelerators).

Multi-host (`--coordinator-address`, `--num-processes`, `--process-id`, with a `--sharding` whose mesh
spans every process): every host runs the same command; process 0 serves HTTP and schedules, the others
build the same engine and replay process 0's steps (`serve/multihost.py`) until it shuts down.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
import time
from typing import Optional

from serve.types import LOGPROBS_MODES

BODY_BYTES = 1 << 20  # the request body limit's default
CACHE_MB = 128  # --cache-mb's default (the arena's budget when no option sizes it)
EMBEDS_BODY_BYTES = 512 << 20  # ... when prompts may be vectors (base64 tensors)

DEFAULTS = dict(
    model="k3-small", host="127.0.0.1", port=8000, dtype="auto", seed=0, served_model_name=None,
    max_model_len=512, max_num_seqs=8, page_size=16, prefill_chunk=64, decode_buckets=None, prefill_buckets="1",
    long_prefill_chunk=0, max_num_batched_tokens=None,
    context_buckets=None, cache_mb=None, kv_cache_memory_bytes=None, num_gpu_blocks_override=None,
    gpu_memory_utilization=None, max_logprobs=20, logprobs_mode="raw_logprobs", api_key_file=None, rpm=None, tpm=None, max_waiting=256,
    max_body_bytes=None, compile_cache_dir=None, no_compile_cache=False, no_prefix_caching=False,
    sharding=None, decode_context_parallel_size=1, enable_eplb=False, eplb_window_size=1000, eplb_step_interval=3000,
    eplb_num_redundant_experts=0, enable_expert_parallel=False,
    kda_decode="auto", mla_decode="auto", kv_cache_dtype="auto", kda_state_dtype="float32",
    schedule_conservativeness=1.0, prefill_first=False, scheduling_policy="priority", enable_deterministic_inference=False, compile_threads=None, scan_layers=False, log_level="info",
    enable_return_routed_experts=False, enable_return_hidden_states=False,
    coordinator_address=None, num_processes=1, process_id=0, no_reasoning_parser=False, speculative_config=None,
    host_cache_mb=None, kv_offloading_size=None, max_stored_responses=1024, enable_sleep_mode=False,
    enable_weights_cpu_backup=False,
    enable_lora=False, max_loras=1, max_lora_rank=16, lora_modules=None, allow_runtime_lora_updating=False,
    lora_target_modules=None, lora_experts_shared_a=False, max_cpu_loras=None, tensor_parallel_size=None, data_parallel_size=1, data_parallel_routing="cache_aware",
    prefill_devices=None, decode_devices=None, kv_store_mb=1024, logits_processors=None, generation_config="auto",
    return_tokens_as_token_ids=False, enable_request_id_headers=False, api_key=None, ssl_keyfile=None,
    ssl_certfile=None, ssl_ca_certs=None, ssl_cert_reqs=0, root_path="", allowed_origins=None, allowed_methods="*",
    allowed_headers="*", allow_credentials=False, shutdown_timeout=0.0, disable_log_stats=False,
    log_stats_interval=10.0, enable_log_requests=False, max_log_len=None, disable_uvicorn_access_log=False,
    enable_prompt_embeds=False, profiler_dir=None,
    async_scheduling=False, enable_chunked_prefill=True, trust_remote_code=False, config=None,
    enable_auto_tool_choice=False, tool_call_parser=None, reasoning_parser=None, chat_template=None,
    enforce_eager=False, swap_space=None,
)
# options of the HTTP server alone: `k3jax run-batch` (vLLM's too) has none of them (its parser refuses them)
SERVER_ONLY = ("host", "port", "api_key", "api_key_file", "rpm", "tpm", "max_waiting", "max_body_bytes",
               "max_stored_responses", "enable_sleep_mode", "enable_weights_cpu_backup", "enable_request_id_headers",
               "allow_runtime_lora_updating", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
               "root_path", "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
               "shutdown_timeout", "log_stats_interval", "profiler_dir", "log_level", "disable_uvicorn_access_log",
               "coordinator_address",
               "num_processes", "process_id")


class _Without:
    """A parser (or argument group) that leaves out the options whose dest is in `dests`."""

    def __init__(self, parser, dests):
        self.parser, self.dests = parser, dests

    def add_argument(self, *names, **kwargs):
        long = next((n for n in names if n.startswith("--")), names[0])
        if kwargs.get("dest", long.lstrip("-").replace("-", "_")) in self.dests:
            return None
        return self.parser.add_argument(*names, **kwargs)

    def add_argument_group(self, *args, **kwargs) -> "_Without":
        return _Without(self.parser.add_argument_group(*args, **kwargs), self.dests)


def add_serve_arguments(s, server: bool = True) -> None:
    """The `serve` subcommand's options (used by k3jax/cli.py); `server` False: the engine's and the answers'
    alone (`run-batch`: no SERVER_ONLY options)."""
    from k3jax.cli import dtype_arg

    d = DEFAULTS
    s = s if server else _Without(s, SERVER_ONLY)
    s.add_argument("--model", default=d["model"], help="preset name or checkpoint directory (default k3-small)")
    s.add_argument("--host", default=d["host"])
    s.add_argument("--port", type=int, default=d["port"])
    s.add_argument("--dtype", default=d["dtype"], type=dtype_arg,
                   help="model weights and arithmetic: vLLM's auto (the default: the checkpoint's torch_dtype, "
                        "bfloat16 for a bfloat16 checkpoint, else float32; presets: float32), bfloat16 or float32; "
                        "float is float32; float16 / half is refused")
    s.add_argument("--seed", type=int, default=d["seed"],
                   help="seeds the sampling of requests that give no seed (vLLM's) and presets' weights")
    s.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="vLLM's: options from a YAML file ('max-model-len: 32k', 'enable-lora: true', lists, JSON "
                        "objects as mappings); the command line's own win")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id in the API (default: --model); vLLM's several names: requests may name any, "
                        "responses carry the first")
    e = s.add_argument_group("engine")
    e.add_argument("--max-model-len", type=_model_len, default=d["max_model_len"],
                   help="context window (tokens; vLLM's 32k = 32000, 32K = 32768); 'auto' or -1: the longest request "
                        "the cache holds, at most the model's max_position_embeddings (its context buckets then "
                        "default to powers of 4 of pages)")
    e.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="requests running at once (vLLM's; the rows of the largest decode bucket)")
    e.add_argument("--max-num-batched-tokens", type=_human_int, default=d["max_num_batched_tokens"],
                   help="vLLM's: tokens computed per step, decode and prompt tokens together (the scheduler's budget; "
                        "default: max(512, what the largest decode and prefill programs, or the long prefill "
                        "program, hold))")
    e.add_argument("--page-size", "--block-size", type=int, default=d["page_size"],
                   help="tokens per MLA cache page (--block-size: vLLM's name)")
    e.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"],
                   help="tokens per prefill row (a prompt's chunk a step; default 64)")
    e.add_argument("--long-prefill-chunk", type=int, default=d["long_prefill_chunk"],
                   help="tokens of the one-row prefill program, which gives a long prompt alone that many tokens "
                        "a step (a multiple of --prefill-chunk, e.g. 256; default 0: off)")
    e.add_argument("--decode-buckets", default=None, help="comma-separated rows (default: 1,MAX_NUM_SEQS)")
    e.add_argument("--prefill-buckets", default=d["prefill_buckets"], help="comma-separated rows (default '1')")
    e.add_argument("--context-buckets", default=None,
                   help="comma-separated MLA pages per layer (default: the whole context window)")
    e.add_argument("--cache-mb", type=int, default=d["cache_mb"],
                   help=f"cache arena budget per device (MiB; default {CACHE_MB})")
    e.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=_human_int, default=None,
                   help="vLLM's: the cache arena's budget per device in bytes (1G, 512M, ...), in place of --cache-mb; "
                        "like --cache-mb it wins over --gpu-memory-utilization")
    e.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="vLLM's: the arena's units (the num_gpu_blocks vllm:cache_config_info reports: each an MLA page "
                        "of one layer or a share of a KDA state slot), overriding the count the other options give")
    e.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                   help="vLLM's: the fraction of each device's memory for weights, step temporaries and cache; the "
                        "arena gets what the weights and the largest steps leave (GPU, TPU); an explicit size "
                        "(--cache-mb, --kv-cache-memory-bytes, --num-gpu-blocks-override) wins over it, as in vLLM")
    e.add_argument("--max-logprobs", type=int, default=d["max_logprobs"],
                   help="most top logprobs a request may ask for (vLLM's; default 20; beam search needs 2 x its width)")
    e.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=d["logprobs_mode"],
                   help="vLLM's: what logprobs hold: the model's log-softmax or logits (raw_*), or those the token was "
                        "drawn from after bias, penalties, temperature, top-k/top-p/min-p (processed_*)")
    e.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="disable the prefix cache (--no-enable-prefix-caching: vLLM's name)")
    e.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false",
                   help="vLLM's: the prefix cache on (the default)")
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d["enable_chunked_prefill"],
                   help="vLLM's: prompts are always prefilled in chunks of --prefill-chunk tokens here (the default); "
                        "--no-enable-chunked-prefill is refused")
    e.add_argument("--host-cache-mb", type=int, default=None,
                   help="host-memory tier of the prefix cache (MiB): evicted pages and KDA checkpoints are "
                        "kept in RAM and restored on a hit (default 0: off)")
    e.add_argument("--kv-offloading-size", type=float, default=None,
                   help="vLLM's name for the same budget, in GiB (give one of the two)")
    e.add_argument("--sharding", default=d["sharding"],
                   help="device mesh: a config in sharding_configs/ (e.g. 'tp') or a YAML path (default: one device)")
    e.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="vLLM's: the routed experts split over the mesh by expert, as --sharding tp / ep / tp_ep (and "
                        "-tp N) already do; refused where the mesh does not split them (a config without an `experts` "
                        "rule, experts that do not divide over its ranks, --data-parallel-size > 1), a no-op on one device")
    e.add_argument("--enable-eplb", action="store_true",
                   help="expert-parallel load balancing: with the routed experts split over the mesh (e.g. --sharding "
                        "ep), re-place each MoE layer's experts every --eplb-step-interval steps so every rank gets "
                        "about the same share of the recently routed tokens (outputs unchanged)")
    e.add_argument("--eplb-window-size", type=int, default=d["eplb_window_size"],
                   help="steps of routed-token counts a placement is planned from (default 1000)")
    e.add_argument("--eplb-step-interval", type=int, default=d["eplb_step_interval"],
                   help="steps between placements (default 3000)")
    e.add_argument("--eplb-num-redundant-experts", "--num-redundant-experts", type=int,
                   default=d["eplb_num_redundant_experts"],
                   help="with --enable-eplb: extra copies of the hottest experts per MoE layer (the experts and their "
                        "copies must split evenly over the expert ranks; default 0)")
    e.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=d["decode_context_parallel_size"],
                   help="split the MLA latent pages by position over the ranks that split the KDA heads (their "
                        "number, e.g. 4 with --sharding tp on 4 devices): each rank holds every N-th token, so the "
                        "cache holds N times the context (default 1: every page whole on every rank)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=d["tensor_parallel_size"],
                   help="vLLM's -tp: the engine's mesh spans this many devices (the first N; each data-parallel "
                        "replica N of its own), under --sharding (default 'tp' when N > 1)")
    e.add_argument("--data-parallel-size", "-dp", type=int, default=d["data_parallel_size"],
                   help="engine replicas on disjoint device groups (each --sharding's mesh over devices / N, or "
                        "one device each), requests routed by cached prefix and load (default 1)")
    e.add_argument("--data-parallel-routing", default=d["data_parallel_routing"], choices=["cache_aware", "load"],
                   help="cache_aware: a request goes where its prefix was sent unless that replica is much busier "
                        "(SGLang's router); load: always the least loaded replica")
    e.add_argument("--prefill-devices", default=None,
                   help="disaggregated prefill (with --decode-devices): comma-separated device indices of a prefill "
                        "engine that runs each prompt and hands its cache to the decode engine through host memory")
    e.add_argument("--decode-devices", default=None,
                   help="device indices of the decode engine that resumes each prompt and generates the output")
    e.add_argument("--kv-store-mb", type=int, default=d["kv_store_mb"],
                   help="host store shared by the prefill and decode engines (MiB, default 1024)")
    e.add_argument("--kda-decode", default=d["kda_decode"], choices=["auto", "in_place", "gathered"],
                   help="KDA decode form: in_place (row loop over the arena, the CPU default) or gathered "
                        "(batched kernel on gathered states, the GPU/TPU default)")
    e.add_argument("--mla-decode", default=d["mla_decode"], choices=["auto", "paged", "gathered"],
                   help="MLA decode form: paged (paged kernel over the arena, the GPU/TPU default) or gathered "
                        "(pages gathered into a dense copy, the CPU default)")
    e.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"],
                   help="MLA latent cache storage: auto (model dtype) or fp8 (e4m3 with a scale per 128 values, "
                        "rotary part unquantized: 1.76x the tokens of bf16 in the same budget)")
    e.add_argument("--kda-state-dtype", default=d["kda_state_dtype"], choices=["auto", "float32", "bfloat16"],
                   help="KDA recurrent state storage (vLLM's --mamba-ssm-cache-dtype): float32 (auto; the spec's) or "
                        "bfloat16 (half the state slot; the state is rounded after every decode token and every "
                        "prefill chunk; arithmetic stays fp32)")
    e.add_argument("--schedule-conservativeness", type=float, default=d["schedule_conservativeness"],
                   help="admission look-ahead (SGLang's): admit a request only when the free pages cover the "
                        "running requests' expected growth at a new-token ratio of 0.7 x this (adaptive); "
                        "0 admits whatever fits now")
    e.add_argument("--enable-deterministic-inference", action="store_true",
                   help="a request's logits do not depend on its batch (CPU: decode rows in tiles of 8, no library "
                        "fusions of reductions; elsewhere one program per kind, the largest; no speculative "
                        "decoding): greedy and seeded sampling repeat exactly")
    e.add_argument("--prefill-first", action="store_true", default=d["prefill_first"],
                   help="steps with prompt chunks to run do not decode (SGLang's schedule without mixed chunks): "
                        "more tokens per second for batch work, a gap in running streams while prompts prefill")
    e.add_argument("--scheduling-policy", choices=("priority", "fcfs"), default=d["scheduling_policy"],
                   help="vLLM's: 'priority' (default) orders the queue and the preemption victims by each request's "
                        "`priority` (lower first), then arrival; 'fcfs' by arrival alone, refusing a nonzero priority")
    e.add_argument("--async-scheduling", action="store_true", default=d["async_scheduling"],
                   help="launch each step before the one in flight is read back (vLLM's): scheduling and output "
                        "processing run while the device computes; same outputs")
    e.add_argument("--enable-prompt-embeds", action="store_true", default=d["enable_prompt_embeds"],
                   help="accept prompts given as vectors (vLLM's): /v1/completions `prompt_embeds`, base64 of a "
                        "torch.save'd tensor [length, hidden_size], a NumPy .npy or a safetensors file; every step "
                        "program then takes a vector per position beside the token ids")
    e.add_argument("--compile-threads", type=int, default=d["compile_threads"],
                   help="compile the step programs at start-up this many at a time (default: min(programs, CPUs, "
                        "8)); 1: one after another")
    e.add_argument("--enable-return-routed-experts", action="store_true", default=d["enable_return_routed_experts"],
                   help="vLLM's / SGLang's: record the experts every token was routed to (rollout routing replay); "
                        "/generate, /v1/completions and /v1/chat/completions return them with return_routed_experts")
    e.add_argument("--enable-return-hidden-states", action="store_true", default=d["enable_return_hidden_states"],
                   help="SGLang's: the step programs also return every position's final hidden states; /generate "
                        "returns a request's with return_hidden_states")
    e.add_argument("--scan-layers", action="store_true", default=d["scan_layers"],
                   help="run the model's repeating group of layers as one scan in every step program: start-up "
                        "compile time stops growing with depth (K3: 21 of 93 layers compiled per program), each step "
                        "pays for slicing the stacked weights (CPU: decode 1.2x, prefill 1.4x slower)")
    e.add_argument("--speculative-config", default=d["speculative_config"],
                   help='speculative decoding, vLLM\'s JSON form, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        '(methods: ngram or [ngram], suffix; num_speculative_tokens 1-32, default 3)')
    e.add_argument("--generation-config", default=d["generation_config"], metavar="auto|vllm|DIR",
                   help="default sampling for requests that leave it unset: 'auto' reads the checkpoint's "
                        "generation_config.json (K3: temperature 1.0, top_p 0.95), 'vllm' ignores it, a directory "
                        "reads that one's (vLLM's)")
    e.add_argument("--logits-processors", nargs="+", default=None, metavar="PATH",
                   help="custom logits processors by built-in name (no_repeat_ngram) or import path "
                        "('package.module:attribute', a "
                        "serve.logits_processors.LogitsProcessor or a factory of one), compiled into the step "
                        "programs; a request turns one on with its argument names in `vllm_xargs`")
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d["enforce_eager"],
                   help="vLLM's: accepted, changes nothing: every step program is compiled by XLA before serving (no "
                        "eager mode, no CUDA graphs to skip); fewer programs start faster (--decode-buckets, "
                        "--context-buckets)")
    e.add_argument("--swap-space", type=float, default=d["swap_space"], metavar="GiB",
                   help="vLLM's: accepted, changes nothing: preempted requests are recomputed (as in vLLM V1, which "
                        "ignores it too); host memory for cached pages: --kv-offloading-size / --host-cache-mb")
    e.add_argument("--compile-cache-dir", default=None, help="persistent JAX compilation cache (default "
                                                             "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/k3jax/jax)")
    e.add_argument("--no-compile-cache", action="store_true",
                   help="do not turn on a persistent compilation cache (JAX_COMPILATION_CACHE_DIR still applies)")
    lo = s.add_argument_group("LoRA adapters (PEFT directories; a request names one as its `model`)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lo.add_argument("--max-loras", type=int, default=d["max_loras"], help="adapters loaded at once (slots)")
    lo.add_argument("--max-lora-rank", type=int, default=d["max_lora_rank"], help="largest adapter rank")
    lo.add_argument("--max-cpu-loras", type=int, default=None,
                    help="adapters held in host memory (default --max-loras), those beyond the slots waiting there; "
                         "loading one more drops the least recently used idle one (read again when used)")
    lo.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                    help="projections that take adapters (e.g. q_proj k_proj v_proj o_proj; default: all dense "
                         "projections); fewer cost less per step. 'all-linear' names every dense projection, "
                         "'experts' the routed experts (per-expert factors: E times a projection's memory)")
    lo.add_argument("--lora-experts-shared-a", action="store_true",
                    help="routed-expert adapters with one A per matrix shared by all experts (a B per expert; "
                         "miles' K3 LoRA recipe): 1/E of the A memory")
    lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help='adapters to load at start-up: name=path or JSON {"name": ..., "path": ...}')
    lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; paths on this "
                         "machine) and SGLang's /load_lora_adapter, /load_lora_adapter_from_tensors, "
                         "/unload_lora_adapter")
    m = s.add_argument_group("multi-host (one mesh over several processes; run the same command on each)")
    m.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0's coordinator (jax.distributed); needs --sharding")
    m.add_argument("--num-processes", type=int, default=d["num_processes"])
    m.add_argument("--process-id", type=int, default=d["process_id"],
                   help="0 serves HTTP and schedules; the others run its steps on their devices")
    a = s.add_argument_group("access")
    a.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a bearer key the API requires (vLLM's; repeat for more; beside --api-key-file and "
                        "K3JAX_API_KEYS; without it vLLM's VLLM_API_KEY is one)")
    a.add_argument("--api-key-file", default=None,
                   help="bearer keys, one per line 'KEY [rpm=N] [tpm=N]' (also: K3JAX_API_KEYS=k1,k2)")
    a.add_argument("--rpm", type=int, default=None, help="default requests per minute per key")
    a.add_argument("--tpm", type=int, default=None, help="default tokens per minute per key")
    a.add_argument("--max-waiting", type=int, default=d["max_waiting"],
                   help="sequences allowed to wait beyond --max-num-seqs; more get 503")
    a.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"],
                   help=f"largest request body (413 beyond it); default {BODY_BYTES >> 20} MiB, "
                        f"{EMBEDS_BODY_BYTES >> 20} MiB with --enable-prompt-embeds (a K3 prompt vector is 14 KiB in "
                        f"bf16, 19 KiB as base64), --enable-sleep-mode (weights pushed by "
                        f"/update_weights_from_tensor) or --allow-runtime-lora-updating (adapters pushed by "
                        f"/load_lora_adapter_from_tensors)")
    a.add_argument("--max-stored-responses", type=int, default=d["max_stored_responses"],
                   help="Responses API objects kept in memory for previous_response_id (0: none)")
    a.add_argument("--enable-sleep-mode", "--enable-memory-saver", action="store_true",
                   help="serve POST /sleep, /wake_up, GET /is_sleeping (vLLM's), POST /update_weights_from_disk "
                        "(SGLang's) and POST /pause, /resume, GET /is_paused (vLLM's), and SGLang's "
                        "/release_memory_occupation, /resume_memory_occupation, /pause_generation, "
                        "/continue_generation, /update_weight_version, /get_weights_by_name, "
                        "/update_weights_from_tensor (--enable-memory-saver is SGLang's name): release and reload the "
                        "device memory around training steps of an RL loop, hold new requests while weights change, "
                        "push and check weights by name")
    a.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="SGLang's: /release_memory_occupation keeps a host copy of the weights (default: discarded, "
                        "load new ones before generating again)")
    a.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries an X-Request-Id header: the request's, else a fresh id (vLLM's)")
    a.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:{id}' instead of their text (vLLM's; a request's "
                        "return_tokens_as_token_ids overrides it)")
    a.add_argument("--no-reasoning-parser", action="store_true",
                   help="K3 chat: return the raw XTML text as content instead of splitting it into "
                        "reasoning and content")
    h = s.add_argument_group("HTTPS, proxies and browsers")
    h.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM) ...")
    h.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    h.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) for verifying client certificates")
    h.add_argument("--ssl-cert-reqs", type=int, default=d["ssl_cert_reqs"], choices=[0, 1, 2],
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    h.add_argument("--root-path", default=d["root_path"],
                   help="the path prefix a reverse proxy serves the API under (e.g. /k3)")
    h.add_argument("--allowed-origins", default=None,
                   help="CORS: origins whose browser pages may call the API, comma-separated or a JSON list "
                        "('*': any; default: no CORS headers)")
    h.add_argument("--allowed-methods", default=d["allowed_methods"], help="CORS methods (default '*')")
    h.add_argument("--allowed-headers", default=d["allowed_headers"], help="CORS request headers (default '*')")
    h.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and authorization")
    h.add_argument("--shutdown-timeout", type=float, default=d["shutdown_timeout"],
                   help="vLLM's: on SIGTERM / Ctrl-C, seconds the requests in flight get to finish while new ones "
                        "are refused (default 0: they are aborted, each still answered)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no statistics line (throughput, running / waiting, cache use, prefix hits) while serving")
    s.add_argument("--log-stats-interval", type=float, default=d["log_stats_interval"],
                   help="seconds between statistics lines while the server works (default 10)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="a line when each generation request starts and ends (ids, token counts, sampling, finish "
                        "reasons, time; never the prompt or answer text)")
    s.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older flag: no request lines (the default)")
    s.add_argument("--max-log-len", type=int, default=d["max_log_len"], metavar="N",
                   help="vLLM's: accepted, changes nothing: request lines never hold prompt or answer text to cut")
    s.add_argument("--profiler-dir", default=d["profiler_dir"], metavar="DIR",
                   help="serve POST /start_profile and /stop_profile (vLLM's): a jax.profiler trace of the engine "
                        "between the two, written under DIR (TensorBoard / XProf, and a Perfetto trace)")
    s.add_argument("--log-level", "--uvicorn-log-level", default=d["log_level"],
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (--uvicorn-log-level: vLLM's name)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="vLLM's: no uvicorn access line per HTTP request")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's: accepted; no checkpoint code is ever run (K3 and Kimi-Linear are built in)")
    # vLLM's Kimi launch lines (`--enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2`):
    # tools and the reasoning split are always served here, in the model family's own formats
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's: accepted; tool_choice 'auto' is always served (serve/tools.py)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="vLLM's: a Kimi parser name (kimi_k2, ...) is accepted, the model family's tool-call format "
                        "is always read; another name is refused")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="vLLM's: a Kimi parser name (kimi_k2, ...) is accepted, K3's think channel is always split "
                        "out (--no-reasoning-parser: not); another name is refused")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                   help="vLLM's: refused; chat is rendered by the model family's built-in format (K3's XTML, "
                        "Kimi-Linear's; k3jax/chat_template.py), there is no Jinja renderer")


def vllm_argv(argv: list[str], options: dict) -> list[str]:
    """A `serve` / `run-batch` command line (after the subcommand) read as vLLM's parser reads it: flag names with
    underscores (`--max_model_len`) and `--config FILE.yaml`, whose options go first so the command line's win.
    `options`: the subcommand's option strings -> actions."""
    argv = [_dashes(a) for a in argv]
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("--config: give one file")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ValueError("--config: expected a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    model = rest[:1] if rest and not rest[0].startswith("-") else []  # `serve MODEL`: a list option cannot take it
    return model + config_flags(path, options) + rest[len(model):]


def _dashes(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value


def config_flags(path: str, options: dict) -> list[str]:
    """vLLM's `--config` file as flags: `key: value` -> `--key value`; true -> `--key`, false -> `--no-key` where
    there is one (else nothing: the default); a list -> its items (the flag repeated for `--api-key`); a mapping ->
    its JSON (`--speculative-config`)."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path!r}: expected a YAML file (.yaml or .yml)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {getattr(e, 'strerror', None) or e}") from None
    if cfg is None:
        return []
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    out: list[str] = []
    for key, value in cfg.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else [f"--no-{flag[2:]}"] if f"--no-{flag[2:]}" in options else []
        elif isinstance(value, list):
            items = [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value]
            if isinstance(options.get(flag), argparse._AppendAction):
                out += [x for v in items for x in (flag, v)]
            else:
                out += [flag, *items]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _ints(text: Optional[str], name: str) -> Optional[tuple[int, ...]]:
    if text is None or text == "":
        return None
    try:
        vals = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise ValueError(f"--{name}: expected positive integers, got {text!r}")
    return vals


_SIZES = dict(k=10 ** 3, m=10 ** 6, g=10 ** 9, t=10 ** 12, K=1 << 10, M=1 << 20, G=1 << 30, T=1 << 40)


def _human_int(text: str) -> int:
    """vLLM's human-readable integers: 32k = 32,000, 32K = 32,768, 25.6k = 25,600 (no decimals with K/M/G/T)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if m is None:
        return int(text)
    num, suffix = m.groups()
    if suffix.isupper() and "." in num:
        raise argparse.ArgumentTypeError(f"{text!r}: no decimals with {suffix} (binary); {num}{suffix.lower()}?")
    return int(float(num) * _SIZES[suffix]) if suffix.islower() else int(num) * _SIZES[suffix]


def _model_len(text: str):
    """--max-model-len: a token count (vLLM's 32k / 32K forms too), or 'auto' (-1)."""
    return "auto" if text.strip().lower() in ("auto", "-1") else _human_int(text)


def _shown_len(cfg) -> Optional[int]:
    """The context window an app shows before its engine is attached (None: 'auto', known once it is)."""
    return None if cfg.max_model_len == "auto" else cfg.max_model_len


def served_names(o: dict) -> list[str]:
    """The model's ids in the API: `--served-model-name`'s (vLLM's: one or several), else `--model`."""
    names = o.get("served_model_name") or [o.get("model") or DEFAULTS["model"]]
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"--served-model-name: expected non-empty names, got {names!r}")
    return names


def served_model_path(args) -> str:
    """`k3jax serve MODEL` (vLLM's positional form) or `--model MODEL`; both given must agree."""
    from k3jax.config import PRESETS

    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", DEFAULTS["model"])
    names = getattr(args, "served_model_name", None) or []
    if tag is None and flag == DEFAULTS["model"] and len(names) > 1 and (names[-1] in PRESETS or
                                                                         os.path.isdir(names[-1])):
        raise ValueError(f"--served-model-name took the model {names[-1]!r} as a name: name the model first "
                         f"(k3jax serve {names[-1]} --served-model-name ...)")
    if tag is None:
        return flag
    if flag not in (tag, DEFAULTS["model"]):
        raise ValueError(f"serve {tag!r} and --model {flag!r}: name the model once")
    return tag


def engine_config(o: dict):
    import dataclasses

    from serve.engine import EngineConfig
    from serve.speculative import SpeculativeConfig

    auto = o["max_model_len"] in ("auto", -1) and not isinstance(o["max_model_len"], bool)
    for flag in ("tool_call_parser", "reasoning_parser"):
        name = o.get(flag)
        if name is not None and not name.lower().startswith("kimi"):
            raise ValueError(f"--{flag.replace('_', '-')} {name}: this server reads the Kimi model families' own "
                             f"formats only (a Kimi parser name such as kimi_k2 is accepted)")
    if o.get("reasoning_parser") is not None and o.get("no_reasoning_parser"):
        raise ValueError("--reasoning-parser and --no-reasoning-parser: give one")
    if o.get("chat_template") is not None:
        raise ValueError("--chat-template: chat is rendered by the model family's built-in format (K3's XTML, "
                         "Kimi-Linear's; k3jax/chat_template.py), there is no Jinja renderer to take a template")
    if o.get("enable_chunked_prefill") is False:
        raise ValueError("--no-enable-chunked-prefill: prompts are always prefilled in chunks of --prefill-chunk "
                         "tokens here (a longer chunk: --long-prefill-chunk)")
    swap = o.get("swap_space")
    if swap is not None and not 0 <= swap < math.inf:
        raise ValueError(f"--swap-space: expected GiB >= 0, got {swap!r}")
    budget = o.get("max_num_batched_tokens")
    for key in ("page_size", "max_num_seqs", "prefill_chunk") + (() if auto else ("max_model_len",)) + (
            () if budget is None else ("max_num_batched_tokens",)) + tuple(
                k for k in ("cache_mb", "kv_cache_memory_bytes", "num_gpu_blocks_override") if o.get(k) is not None):
        v = o[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{key.replace('_', '-')}: expected an integer >= 1, got {v!r}")
    pages = None if auto else -(-o["max_model_len"] // o["page_size"])
    dp = o.get("data_parallel_size", 1)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"--data-parallel-size: expected an integer >= 1, got {dp!r}")
    # Decode rows 1 and MAX_NUM_SEQS, one prefill row, the whole context: three programs. A lone request
    # decodes in the 1-row program (k3-small, 2 cores: 14 ms a token against 26-31 ms padded to 8 rows,
    # benchmarks/online_serving.py); each further bucket costs a compile at start-up (~12 s for k3-small)
    # for less (8 context pages instead of 32: 10-15 % of a decode step).
    decode = _ints(o["decode_buckets"], "decode-buckets") or tuple(sorted({o["max_num_seqs"], 1}))
    if decode[-1] > o["max_num_seqs"]:  # (EngineConfig's check: the engine below gets max_num_seqs=decode[-1])
        raise ValueError(f"--decode-buckets {o['decode_buckets']}: the largest is the requests running at once, at "
                         f"most --max-num-seqs {o['max_num_seqs']}")
    prefill = _ints(o["prefill_buckets"], "prefill-buckets") or (1,)
    context = _ints(o["context_buckets"], "context-buckets") or ((pages,) if pages else None)
    extra = {}
    spec = o.get("speculative_config")
    if spec:
        try:
            extra["speculative_config"] = json.loads(spec) if isinstance(spec, str) else spec
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(extra["speculative_config"], dict):
            raise ValueError("--speculative-config: expected a JSON object")
    drafts = (extra.get("speculative_config") or {}).get("num_speculative_tokens") if spec else 0
    drafts = SpeculativeConfig.num_speculative_tokens if drafts is None else drafts  # (null: the default, as vLLM)
    drafts = drafts if isinstance(drafts, int) and drafts > 0 else 0  # EngineConfig names a bad value
    if o.get("no_prefix_caching") and "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}:
        extra["enable_prefix_caching"] = False
    mb, gib = o.get("host_cache_mb"), o.get("kv_offloading_size")
    if mb is not None and gib is not None:
        raise ValueError("--host-cache-mb and --kv-offloading-size set the same budget: give one")
    if (mb or 0) < 0 or not 0 <= (gib or 0) < math.inf:
        raise ValueError("--host-cache-mb / --kv-offloading-size: expected a size >= 0")
    if mb or gib:
        extra["host_cache_bytes"] = int(mb) << 20 if mb else int(gib * (1 << 30))
    return EngineConfig(
        **extra, **cache_size(o), max_model_len="auto" if auto else o["max_model_len"], page_size=o["page_size"],
        max_num_seqs=decode[-1], prefill_chunk=o["prefill_chunk"], max_prefill_seqs=prefill[-1],
        max_num_batched_tokens=budget or max(512, decode[-1] * (1 + drafts) + max(
            prefill[-1] * o["prefill_chunk"], o.get("long_prefill_chunk") or 0)),
        decode_buckets=decode, prefill_buckets=prefill, context_buckets=context, max_logprobs=o["max_logprobs"],
        logprobs_mode=o.get("logprobs_mode", "raw_logprobs"),
        seed=o["seed"], sharding=o.get("sharding"), tensor_parallel_size=o.get("tensor_parallel_size"),
        kda_decode=o.get("kda_decode", "auto"),
        decode_context_parallel_size=o.get("decode_context_parallel_size", 1),
        enable_expert_parallel=bool(o.get("enable_expert_parallel")),
        enable_eplb=bool(o.get("enable_eplb")), eplb_window_size=o.get("eplb_window_size", 1000),
        eplb_step_interval=o.get("eplb_step_interval", 3000),
        eplb_num_redundant_experts=o.get("eplb_num_redundant_experts", 0),
        mla_decode=o.get("mla_decode", "auto"), kv_cache_dtype=o.get("kv_cache_dtype", "auto"),
        kda_state_dtype=o.get("kda_state_dtype", "float32"),
        schedule_conservativeness=o.get("schedule_conservativeness", 1.0), prefill_first=bool(o.get("prefill_first")),
        scheduling_policy=o.get("scheduling_policy") or "priority",
        enable_deterministic_inference=bool(o.get("enable_deterministic_inference")),
        compile_threads=o.get("compile_threads"),
        scan_layers=bool(o.get("scan_layers")),
        enable_return_routed_experts=bool(o.get("enable_return_routed_experts")),
        enable_return_hidden_states=bool(o.get("enable_return_hidden_states")),
        long_prefill_chunk=o.get("long_prefill_chunk"),
        max_loras=o.get("max_loras", 1) if o.get("enable_lora") else 0, max_lora_rank=o.get("max_lora_rank", 16),
        lora_target_modules=tuple(o["lora_target_modules"]) if o.get("lora_target_modules") else None,
        lora_experts_shared_a=bool(o.get("lora_experts_shared_a")),
        max_cpu_loras=o.get("max_cpu_loras") if o.get("enable_lora") else None,
        logits_processors=tuple(o.get("logits_processors") or ()),
        generation_config=o.get("generation_config") or "auto",
        enable_prompt_embeds=bool(o.get("enable_prompt_embeds")),
        async_scheduling=bool(o.get("async_scheduling")))


def cache_size(o: dict) -> dict:
    """The options that size the arena -> EngineConfig's `cache_bytes`, `gpu_memory_utilization` and
    `num_gpu_blocks_override`. An explicit size (--cache-mb, vLLM's --kv-cache-memory-bytes, or its
    --num-gpu-blocks-override, which wins over both as vLLM's overrides its computed count) leaves
    --gpu-memory-utilization out, as vLLM's --kv-cache-memory-bytes ignores it (`vllm_notes` says so)."""
    mb, size = o.get("cache_mb"), o.get("kv_cache_memory_bytes")
    if mb is not None and size is not None:
        raise ValueError("--cache-mb and --kv-cache-memory-bytes set the same budget: give one")
    blocks = o.get("num_gpu_blocks_override")
    explicit = mb is not None or size is not None or blocks is not None
    fraction = None if explicit else o.get("gpu_memory_utilization")
    if size is None and fraction is None:  # (with the fraction, none: a cache_bytes given would win over it)
        size = (CACHE_MB if mb is None else mb) << 20
    return dict(cache_bytes=size, gpu_memory_utilization=fraction, num_gpu_blocks_override=blocks)


def _size_flags(o: dict) -> list[str]:
    """The flags given that set the arena's size explicitly."""
    return [f"--{k.replace('_', '-')}" for k in ("cache_mb", "kv_cache_memory_bytes", "num_gpu_blocks_override")
            if o.get(k) is not None]


def vllm_notes(o: dict) -> list[str]:
    """What the vLLM options accepted for a launch line's sake but meaning nothing here were given for: a line
    each, said at start-up (so no one tunes them expecting an effect)."""
    notes = []
    sized = _size_flags(o)
    if o.get("gpu_memory_utilization") is not None and sized:
        notes.append(f"--gpu-memory-utilization {o['gpu_memory_utilization']:g}: ignored, {' and '.join(sized)} "
                     f"sets the cache's size (as vLLM's --kv-cache-memory-bytes ignores it)")
    if o.get("num_gpu_blocks_override") is not None and len(sized) > 1:
        notes.append(f"--num-gpu-blocks-override {o['num_gpu_blocks_override']}: the arena has that many units, "
                     f"whatever {sized[0]} gives (as vLLM's overrides its computed count)")
    if o.get("enforce_eager"):
        notes.append("--enforce-eager: accepted, changes nothing: every step program is compiled by XLA before "
                     "serving (no eager mode, no CUDA graphs); fewer buckets start faster")
    if o.get("swap_space") is not None:
        notes.append(f"--swap-space {o['swap_space']:g}: accepted, changes nothing: preempted requests are "
                     f"recomputed (as in vLLM V1); host memory for cached pages is --kv-offloading-size GiB "
                     f"(--host-cache-mb)")
    return notes


def check_server_flags(o: dict) -> None:
    """The HTTP server's own flags, checked before the model loads: an error naming the flag."""
    if not 0 <= o["port"] <= 65535:
        raise ValueError(f"--port {o['port']}: expected a TCP port in 0..65535")
    n, pid = o.get("num_processes", 1), o.get("process_id", 0)
    if n < 1:
        raise ValueError(f"--num-processes {n}: expected an integer >= 1")
    if not 0 <= pid < n:  # (a follower without a mesh to follow compiled everything, then raised)
        raise ValueError(f"--process-id {pid}: expected 0..{n - 1} (--num-processes {n})")
    for key in ("max_waiting", "rpm", "tpm"):
        v, least = o.get(key), 0 if key == "max_waiting" else 1
        if v is not None and v < least:
            raise ValueError(f"--{key.replace('_', '-')} {v}: expected an integer >= {least}")


def check_model(model: str) -> None:
    """`--model` names a preset or a checkpoint directory whose config reads: else an error naming it before the
    server listens (the weights load after it does)."""
    from k3jax.checkpoint import read_config
    from k3jax.config import PRESETS

    if model in PRESETS:
        return
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r}: neither a preset ({sorted(PRESETS)}) nor a directory")
    try:
        read_config(model)
    except (ValueError, OSError) as e:  # (OSError: a config.json that cannot be read, such as its permissions)
        raise ValueError(f"--model {model!r}: {e}") from None


def lora_modules(o: dict) -> list:
    """`--lora-modules` as `LoRARequest`s (name=path, or vLLM's JSON form)."""
    from serve.lora import LoRARequest

    items = o.get("lora_modules") or []
    if items and not o.get("enable_lora"):
        raise ValueError("--lora-modules needs --enable-lora")
    out = []
    for i, item in enumerate(items):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {item!r}: not JSON ({e})") from None
            name, path = spec.get("name"), spec.get("path")
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
        if name in served_names(o):  # (the API's routes refuse it too)
            raise ValueError(f"--lora-modules {item!r}: {name!r} is the served model's id: requests naming it "
                             f"would be served by the base model")
        if name in {r.lora_name for r in out}:
            raise ValueError(f"--lora-modules {item!r}: a second adapter named {name!r}")
        out.append(LoRARequest(name, i + 1, path))
    return out  # more than --max-cpu-loras: the first ones wait on disk, read when a request needs them


def compile_cache_path(path: Optional[str], env=os.environ) -> str:
    """The persistent cache's directory: the flag's, else JAX's own `JAX_COMPILATION_CACHE_DIR` (so a
    deployment or a test run that shares one cache keeps it), else `~/.cache/k3jax/jax`."""
    home = os.path.join("~", ".cache", "k3jax", "jax")
    return os.path.expanduser(path or env.get("JAX_COMPILATION_CACHE_DIR") or home)


def enable_compile_cache(path: Optional[str]) -> Optional[str]:
    import jax

    path = compile_cache_path(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(f"[k3jax serve] compilation cache disabled ({path}: {e})", file=sys.stderr, flush=True)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _say(msg: str) -> None:
    print(f"[k3jax serve] {msg}", file=sys.stderr, flush=True)


def load_served_model(o: dict, cfg):
    """The served model, read straight into the first engine's placement (each device reads and receives only
    its shards): the one engine's, the first data-parallel replica's, or the disaggregated prefill engine's;
    the other engines copy theirs from it (serve/data_parallel.load_options)."""
    from k3jax.runtime import load_model
    from serve.data_parallel import load_options

    pd = disaggregation(o)
    where = load_options(cfg, o.get("data_parallel_size") or 1, pd[0] if pd is not None else None)
    return load_model(o["model"], dtype=o["dtype"], seed=o["seed"], **where)


def _follow(o: dict, cfg) -> int:
    """Processes 1.. of a multi-host server: build the same engine, then run process 0's steps."""
    from serve.engine import Engine

    me = f"process {o['process_id']}/{o['num_processes']}"
    _say(f"{me}: loading {o['model']} ({o['dtype']}) and compiling ...")
    eng = Engine(load_served_model(o, cfg), cfg, progress=False)
    _say(f"{me}: following process 0's steps")
    n = eng.follow()
    _say(f"{me}: process 0 closed after {n} steps ({eng.channel.pings} idle pings)")
    return 0


def start_engine(model, cfg, o: dict, adapters: list, cache_dir: Optional[str] = None):
    """The warmed-up engine the server runs: an `AsyncEngine`; with `--data-parallel-size N` a
    `DataParallelAsyncEngine` of N replicas on disjoint device groups (serve/data_parallel.py); with
    `--prefill-devices` / `--decode-devices` a `DisaggregatedAsyncEngine` (serve/disaggregated.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from serve.async_engine import AsyncEngine
    from serve.data_parallel import DataParallelAsyncEngine, build_replicas
    from serve.disaggregated import DisaggregatedAsyncEngine, build_pair
    from serve.engine import Engine

    size = o.get("data_parallel_size") or 1
    pd = disaggregation(o)
    if pd is not None:
        engines, groups = list(build_pair(model, cfg, *pd, o["kv_store_mb"] << 20, warmup=False)), None
    elif size > 1:
        engines, groups = build_replicas(model, cfg, size, progress=False, warmup=False)
    else:
        engines, groups = [Engine(model, cfg, warmup=False)], None
    for lr in adapters:  # before compiling: a bad adapter fails the start at once
        for eng in engines:
            eng.add_lora(lr)
        _say(f"LoRA adapter {lr.lora_name!r} loaded from {lr.lora_path}")
    eng = engines[0]
    served = dict(eng.generation_defaults)  # what the server applies (max_tokens: cut to the context left)
    if served:
        _say(f"requests that leave them unset sample with the model's generation config: {served} "
             f"(--generation-config vllm ignores it)")
    if eng.memory_plan is not None:
        mp = eng.memory_plan
        _say(f"gpu_memory_utilization {mp.utilization}: cache arena {mp.cache_bytes / 2**30:.2f} GiB per device beside "
             f"{mp.bytes_in_use / 2**30:.2f} GiB of weights and {mp.step_temp_bytes / 2**30:.2f} GiB of step temporaries "
             f"(device limit {mp.bytes_limit / 2**30:.2f} GiB)")
    _say(eng.arena_summary())  # (vLLM's "Maximum concurrency for N tokens per request")
    for proc in eng.logits_processors:
        _say(f"logits processor {proc.name!r} (vllm_xargs: {', '.join(proc.arg_names) or 'every request'})")
    replicas = (f" on each of {size} replicas (devices {', '.join(map(str, map(list, groups)))})" if size > 1 else
                f" on the prefill (devices {list(pd[0])}) and the decode engine (devices {list(pd[1])})" if pd else "")
    _say(f"compiling {len(eng.bucket_shapes())} step programs{replicas} (decode rows {eng.decode_buckets}, prefill "
         f"rows {eng.prefill_buckets} x {cfg.prefill_chunk} tokens"
         f"{f' and 1 x {eng.sched_cfg.long_prefill_chunk}' if eng.sched_cfg.long_prefill_chunk else ''}, "
         f"context pages {eng.context_buckets}"
         f"{f', decode at {eng.decode_context_buckets}' if eng.decode_context_buckets != eng.context_buckets else ''}); "
         f"compilation cache: {cache_dir or 'off'}")
    with ThreadPoolExecutor(len(engines)) as pool:  # replicas compile side by side
        list(pool.map(lambda e: e.warmup(progress=e is eng), engines))
    if pd is not None:
        return DisaggregatedAsyncEngine(*engines)
    return (AsyncEngine(eng) if size == 1
            else DataParallelAsyncEngine(engines, groups, o.get("data_parallel_routing", "cache_aware")))


def disaggregation(o: dict) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prefill devices, decode devices) of `--prefill-devices` / `--decode-devices`, or None."""
    pre, dec = o.get("prefill_devices"), o.get("decode_devices")
    if pre is None and dec is None:
        return None
    if pre is None or dec is None:
        raise ValueError("disaggregated prefill needs both --prefill-devices and --decode-devices")
    if (o.get("data_parallel_size") or 1) > 1:
        raise ValueError("--prefill-devices / --decode-devices: not with --data-parallel-size")
    if o.get("no_prefix_caching") or o.get("host_cache_mb") or o.get("kv_offloading_size"):
        raise ValueError("--prefill-devices / --decode-devices: the engines hand prompts over through the prefix "
                         "cache's host store (--kv-store-mb); leave prefix caching on and --host-cache-mb unset")
    if not isinstance(o.get("kv_store_mb"), int) or o["kv_store_mb"] < 1:
        raise ValueError(f"--kv-store-mb: expected an integer >= 1, got {o.get('kv_store_mb')!r}")
    return _devices(pre, "prefill-devices"), _devices(dec, "decode-devices")


def _devices(text: str, name: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated device indices, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise ValueError(f"--{name}: expected device indices >= 0, got {text!r}")
    return vals


def _names(text, name: str) -> Optional[list[str]]:
    """A CORS list option: comma-separated, or a JSON list of strings as vLLM takes it; None when not given."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, (list, tuple)):
        vals = list(text)
    elif text.strip().startswith("["):
        try:
            vals = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name}: not a JSON list ({e})") from None
    else:
        vals = [v.strip() for v in text.split(",") if v.strip()]
    if not vals or not all(isinstance(v, str) and v for v in vals):
        raise ValueError(f"--{name}: expected non-empty names, got {text!r}")
    return vals


def body_limit(o: dict) -> int:
    """`--max-body-bytes`, else its default: larger when a route takes base64 tensors (prompt vectors, weights
    pushed by name, LoRA adapters pushed as tensors)."""
    if o.get("max_body_bytes") is not None:
        if o["max_body_bytes"] < 1:
            raise ValueError(f"--max-body-bytes {o['max_body_bytes']}: expected a positive number of bytes")
        return o["max_body_bytes"]
    tensors = ("enable_prompt_embeds", "enable_sleep_mode", "allow_runtime_lora_updating")
    return EMBEDS_BODY_BYTES if any(o.get(flag) for flag in tensors) else BODY_BYTES


def cors_options(o: dict) -> dict:
    """`create_app`'s CORS keywords from the serve options (none without --allowed-origins)."""
    origins = _names(o.get("allowed_origins"), "allowed-origins")
    if origins is None:
        for flag in ("allowed_methods", "allowed_headers"):
            if o.get(flag, DEFAULTS[flag]) != DEFAULTS[flag]:
                raise ValueError(f"--{flag.replace('_', '-')}: needs --allowed-origins")
        if o.get("allow_credentials"):
            raise ValueError("--allow-credentials: needs --allowed-origins")
        return {}
    if o.get("allow_credentials") and "*" in origins:
        raise ValueError("--allow-credentials: browsers refuse credentials with --allowed-origins '*'; name the "
                         "origins")
    methods = _names(o.get("allowed_methods"), "allowed-methods") or ["*"]
    headers = _names(o.get("allowed_headers"), "allowed-headers") or ["*"]
    return dict(allowed_origins=origins, allowed_methods=tuple(methods), allowed_headers=tuple(headers),
                allow_credentials=bool(o.get("allow_credentials")))


def server_url(o: dict) -> str:
    scheme = "https" if o.get("ssl_certfile") else "http"
    return f"{scheme}://{o['host']}:{o['port']}{o.get('root_path') or ''}"


def uvicorn_config(app, o: dict):
    """uvicorn's settings for the served app: address, TLS, the proxy's root path. The TLS files are read here,
    so a missing or bad key or certificate is an error naming the option before the model loads."""
    import ssl

    import uvicorn

    from serve.shutdown import graceful_timeout

    key, cert, ca, reqs = o.get("ssl_keyfile"), o.get("ssl_certfile"), o.get("ssl_ca_certs"), o.get("ssl_cert_reqs", 0)
    if bool(key) != bool(cert):
        raise ValueError("--ssl-keyfile, --ssl-certfile: HTTPS needs both")
    if (ca or reqs) and not cert:
        raise ValueError("--ssl-ca-certs, --ssl-cert-reqs: need --ssl-keyfile and --ssl-certfile")
    if reqs and not ca:
        raise ValueError("--ssl-cert-reqs: verifying client certificates needs --ssl-ca-certs")
    root = o.get("root_path") or ""
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"--root-path: expected a path like /k3 (leading '/', no trailing '/'), got {root!r}")
    drain = o.get("shutdown_timeout", 0.0)
    if drain is None or not drain >= 0:
        raise ValueError(f"--shutdown-timeout: expected seconds >= 0, got {drain}")
    # lifespan off: the app has no start-up or shutdown hooks, and uvicorn's lifespan task, cancelled by Ctrl-C,
    # printed a CancelledError traceback on every interrupted shutdown
    config = uvicorn.Config(app, host=o["host"], port=o["port"], log_level=o["log_level"], lifespan="off",
                            access_log=not o.get("disable_uvicorn_access_log"),
                            timeout_graceful_shutdown=graceful_timeout(drain), root_path=root, ssl_keyfile=key,
                            ssl_certfile=cert, ssl_ca_certs=ca, ssl_cert_reqs=reqs if cert else ssl.CERT_NONE)
    if cert:
        try:
            config.load()  # builds the SSL context (the server reuses the loaded config)
        except (OSError, ssl.SSLError) as e:
            names = "--ssl-keyfile, --ssl-certfile" + (", --ssl-ca-certs" if ca else "")
            raise ValueError(f"{names}: {type(e).__name__}: {e}") from None
    return config


def serve_main(args) -> int:
    from k3jax.runtime import resolve_dtype
    from serve.api import create_app
    from serve.auth import Limits, load_api_keys
    from serve.shutdown import DrainingServer, Terminated, exit_during_warmup, sigterm_unwinds
    from serve.stats_logger import StatsLogger

    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    o["model"] = served_model_path(args)
    t0 = time.monotonic()
    cfg = engine_config(o)
    cfg.validate()
    check_server_flags(o)
    check_model(o["model"])
    o["dtype"] = resolve_dtype(o["dtype"], o["model"])  # vLLM's auto: the checkpoint's (said as it loads)
    adapters = lora_modules(o)
    for note in vllm_notes(o):
        _say(note)
    if o["num_processes"] > 1 or o["coordinator_address"]:
        if o["data_parallel_size"] > 1:
            raise ValueError("--data-parallel-size: replicas live in one process; a multi-host mesh runs one engine")
        if o.get("prefill_devices") is not None or o.get("decode_devices") is not None:
            raise ValueError("--prefill-devices / --decode-devices: the two engines live in one process (they hand "
                             "prompts over through its host store); a multi-host mesh runs one engine")
        if not o["coordinator_address"] or cfg.sharding is None:
            raise ValueError("multi-host serving needs --coordinator-address HOST:PORT, --num-processes, "
                             "--process-id and a --sharding whose mesh spans every process's devices")
        from serve.multihost import initialize

        initialize(o["coordinator_address"], o["num_processes"], o["process_id"])
    import dataclasses

    from serve.data_parallel import replica_devices

    pd = disaggregation(o)
    # each engine's devices exist and fit the sharding config's mesh: say so before listening
    groups = (pd if pd is not None else replica_devices(o["data_parallel_size"], cfg)[:1]
              if o["data_parallel_size"] > 1 else (None,))
    for devices in groups:
        one = cfg if devices is None else dataclasses.replace(cfg, devices=devices)
        one.validate()
        one.check_mesh()
    cache_dir = None if o["no_compile_cache"] else enable_compile_cache(o["compile_cache_dir"])
    if o["process_id"] > 0:
        return _follow(o, cfg)
    keys = load_api_keys(o["api_key_file"], given=o.get("api_key") or ())
    names = served_names(o)
    name = names[0]
    app = create_app(None, names, api_keys=keys, limits=Limits(o["rpm"], o["tpm"]), max_waiting=o["max_waiting"],
                     max_body_bytes=body_limit(o), max_model_len=_shown_len(cfg),
                     reasoning_parser=not o["no_reasoning_parser"],
                     return_tokens_as_token_ids=bool(o.get("return_tokens_as_token_ids")),
                     enable_request_id_headers=bool(o.get("enable_request_id_headers")),
                     max_stored_responses=o.get("max_stored_responses", DEFAULTS["max_stored_responses"]),
                     enable_sleep_mode=bool(o.get("enable_sleep_mode")),
                     weights_cpu_backup=bool(o.get("enable_weights_cpu_backup")),
                     allow_runtime_lora_updating=bool(o.get("allow_runtime_lora_updating")),
                     request_log=_say if o.get("enable_log_requests") else None,
                     profiler_dir=o.get("profiler_dir"), model_path=o["model"], **cors_options(o))
    st = app.state.k3
    server = DrainingServer(uvicorn_config(app, o), st, o.get("shutdown_timeout", 0.0), say=_say)
    stats_logger = None if o.get("disable_log_stats") else StatsLogger(
        st.engine_stats, _say, o.get("log_stats_interval", DEFAULTS["log_stats_interval"]))
    url = server_url(o)
    holder: dict = {}

    def warm() -> None:
        while not server.started and not server.should_exit:  # serve /health (503) before compiling
            time.sleep(0.02)
        if server.should_exit:
            return
        _say(f"listening on {url} (/health answers 503 until the engine is warm)")  # bound (a port in use: exit 3)
        try:
            _say(f"loading {o['model']} ({o['dtype']}) ...")
            model = load_served_model(o, cfg)
            holder["engine"] = start_engine(model, cfg, o, adapters, cache_dir)
            st.attach(holder["engine"])
            if stats_logger is not None:
                stats_logger.start()
            _say(f"ready: serving {name!r} on {url} "
                 f"({time.monotonic() - t0:.1f}s after start, {time.process_time():.1f}s CPU)")
        except BaseException as e:  # the server cannot become ready: say why and stop
            st.fail(f"{type(e).__name__}: {e}")
            _say(f"start-up failed: {type(e).__name__}: {e}")
            holder["failed"] = True
            server.should_exit = True

    warmup = threading.Thread(target=warm, name="k3jax-warmup", daemon=True)
    warmup.start()
    stopped = False  # the server ran and stopped (a port in use raises SystemExit before any loading)
    try:
        with sigterm_unwinds():
            server.run()
        stopped = True
    except (KeyboardInterrupt, Terminated):  # SIGINT / SIGTERM: uvicorn has shut down gracefully and re-raised it
        stopped = True
    finally:
        if stats_logger is not None:
            stats_logger.stop()
        if stopped and not holder.get("failed"):  # stopped while the engine still loads or compiles: exit now
            # (a failed start-up stops the server itself and has said why: its thread is ending, no "interrupted")
            exit_during_warmup(warmup, 0, _say)
        if "engine" in holder:
            holder["engine"].shutdown()
    return 1 if holder.get("failed") else 0
