"""`k3jax` command line: generate, convert, info (and serve, when the serving stack is installed)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _cmd_generate(args) -> int:
    from k3jax import load_model

    model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    t0 = time.perf_counter()
    text = model.generate_text(args.prompt, args.max_tokens)
    dt = time.perf_counter() - t0
    print(text)
    print(f"[{args.max_tokens} tokens max, {dt:.2f}s incl. compile]", file=sys.stderr)
    return 0


def _cmd_convert(args) -> int:
    from k3jax import load_model
    from k3jax.checkpoint import copy_tokenizer_files, save_orbax
    from k3jax.config import PRESETS

    if os.path.exists(args.dst) and not os.path.isdir(args.dst):  # before the weights load, not after
        raise ValueError(f"DST {args.dst!r}: exists and is not a directory (the Orbax checkpoint is a directory)")
    model = load_model(args.src, dtype=args.dtype)
    save_orbax(args.dst, model.cfg, model.params, model.dtype)
    # the tokenizer and sampling defaults travel with the weights (without them DST served with the byte tokenizer)
    copied = [] if model.source in PRESETS else copy_tokenizer_files(args.src, args.dst)
    print(f"wrote Orbax checkpoint of {model.num_params:,} parameters to {args.dst}"
          + (f" (with {', '.join(copied)})" if copied else ""))
    return 0


def _cmd_info(args) -> int:
    import jax

    from k3jax.cache import cache_bytes
    from k3jax.checkpoint import read_config
    from k3jax.config import PRESETS
    from k3jax.runtime import abstract_model, param_counts, parse_dtype, resolve_dtype

    if args.page_size is None:
        args.page_size = _engine_page_size()
    for flag in ("devices", "page_size", "max_num_seqs", "max_model_len", "max_prefill_seqs", "prefill_chunk",
                 "max_lora_rank", "decode_context_parallel_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    if args.max_loras < 0:
        raise ValueError(f"--max-loras: expected an integer >= 0, got {args.max_loras}")
    if args.cache_gib is not None and not (args.cache_gib > 0 and math.isfinite(args.cache_gib)):
        raise ValueError(f"--cache-gib: expected a positive size, got {args.cache_gib}")
    try:
        contexts = [int(c) for c in str(args.context).split(",") if c.strip()]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        raise ValueError(f"--context: expected comma-separated positive token counts, got {args.context!r}")
    # a checkpoint directory as `load_model` reads it: HF (config.json) or Orbax (`k3jax convert`'s output)
    if args.model not in PRESETS and not os.path.isdir(args.model):
        raise FileNotFoundError(f"{args.model!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    cfg = PRESETS[args.model] if args.model in PRESETS else read_config(args.model)
    dtype = parse_dtype(resolve_dtype(args.dtype, args.model))
    _, abstract = abstract_model(cfg, dtype)
    leaves = jax.tree.leaves(abstract)
    info = {
        "family": cfg.family, "layers": cfg.num_hidden_layers, "kda_layers": cfg.num_kda_layers,
        "mla_layers": cfg.num_mla_layers, "param_tensors": len(leaves),
        "param_bytes": sum(int(x.size) * x.dtype.itemsize for x in leaves),
        "params": param_counts(cfg, abstract),
        "cache_bytes_per_sequence_at_4096": cache_bytes(cfg, 1, 4096, dtype),
    }
    if args.sharding:
        from k3jax.sharding import axes_size, bytes_per_device, load_sharding_config, state_axis

        sh = load_sharding_config(args.sharding)
        info["sharding"] = bytes_per_device(abstract, sh, args.devices)
        sizes = sh.mesh_shape(args.devices)
        ranks = axes_size(state_axis(sh, sizes, cfg.kda_num_heads), sizes)
        per_seq = cache_bytes(cfg, 1, 4096, dtype)
        dcp = args.decode_context_parallel_size
        if dcp > 1 and dcp != ranks:
            print(f"--decode-context-parallel-size {dcp}: the MLA pages split over the ranks that split the KDA "
                  f"heads, {ranks} under --sharding {args.sharding} on {args.devices} devices", file=sys.stderr)
            return 2
        # the arena splits KDA states (and conv channels) by heads over `ranks`; MLA pages are whole on
        # every rank unless decode context parallelism splits them by position over the same ranks
        info["sharding"]["kda_state_ranks"] = ranks
        info["sharding"]["mla_context_ranks"] = dcp
        info["sharding"]["cache_bytes_per_sequence_at_4096_per_device"] = {
            k: v // (ranks if k.startswith("kda") else dcp) for k, v in per_seq.items()}
    elif args.decode_context_parallel_size > 1:
        print("--decode-context-parallel-size needs --sharding (a mesh whose heads rule splits the KDA heads)",
              file=sys.stderr)
        return 2
    if getattr(args, "max_loras", 0):
        from k3jax.lora import slot_bytes, split_targets

        targets = tuple(args.lora_target_modules) if args.lora_target_modules else None
        _check_lora_targets(cfg, targets)
        dense_targets = split_targets(targets)[0]
        per = slot_bytes(cfg, dtype, args.max_lora_rank, targets, args.lora_experts_shared_a)
        dense = slot_bytes(cfg, dtype, args.max_lora_rank, ("all-linear",) if dense_targets is None else
                           dense_targets or ("-",))
        # the projections' slot 0 (the base model) is allocated too; tensor-parallel ranks split the factors like
        # the weights, expert-parallel ranks the routed experts' like the experts
        info["lora"] = {"max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
                        "bytes_per_adapter": per, "bytes_routed_experts_per_adapter": per - dense,
                        "bytes_all_slots": per * args.max_loras + dense}
    programs = _step_programs(args, cfg)
    if programs is not None:
        info["step_programs"] = programs
    if args.cache_gib:
        info["arena"] = _arena_plan(cfg, dtype, args, info.get("sharding", {}).get("kda_state_ranks", 1),
                                    info.get("sharding", {}).get("mla_context_ranks", 1))
    print(json.dumps(info, indent=1))
    return 0


def _check_lora_targets(cfg, targets) -> None:
    """`--lora-target-modules` names this model's projections, as the engine refuses any other (info planned 0
    bytes for an unknown name instead)."""
    from k3jax.lora import projection_names

    known = projection_names(cfg) if targets else set()
    unknown = sorted(set(targets or ()) - known)
    if unknown:
        raise ValueError(f"--lora-target-modules: this model has no projection named {unknown[0]!r} "
                         f"(it has {', '.join(sorted(known))})")


def _engine_page_size() -> int | None:
    """The serving engine's default page size (EngineConfig's), which info plans with unless told (None without
    the serving stack: nothing is planned in pages then)."""
    try:
        from serve.engine import EngineConfig
    except ImportError:
        return None
    return EngineConfig.__dataclass_fields__["page_size"].default


def _step_programs(args, cfg) -> dict | None:
    """The step programs an engine with these options compiles before it serves (serve/buckets.py; the
    engine's default buckets), how many where one-token decodes need only the widest context bucket
    (a GPU's paged MLA decode kernel), and the layer copies each holds, unrolled and with `--scan-layers`
    (the repeating group scanned). None without the serving stack."""
    try:
        from serve.buckets import default_buckets, program_shapes
        from serve.page_tables import tables_bytes
        from k3jax.layer_scan import plan as layer_scan_plan
    except ImportError:
        return None
    scan = layer_scan_plan(cfg)
    decode, prefill, context = default_buckets(args.max_num_seqs, args.max_prefill_seqs, args.max_model_len,
                                               args.page_size)
    every = program_shapes(decode, prefill, context, context, args.prefill_chunk)
    widest = program_shapes(decode, prefill, context, context[-1:], args.prefill_chunk)
    return {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "page_size": args.page_size,
            "decode_rows": list(decode), "prefill_rows": list(prefill), "context_pages": list(context),
            "programs": len(every), "programs_with_gpu_paged_decode": len(widest),
            # the device page tables (serve/page_tables.py): a row per sequence of the largest decode and prefill
            # batches, each MLA layer's pages up to the widest context bucket
            "page_tables_bytes": tables_bytes(decode[-1] + prefill[-1], max(1, cfg.num_mla_layers), context[-1]),
            "layer_scan": None if scan is None else {"first_layer": scan.start, "period": scan.period,
                                                     "groups": scan.groups},
            "layers_compiled_per_program": {
                "unrolled": cfg.num_hidden_layers,
                "scan_layers": cfg.num_hidden_layers - (scan.compiled_layers_saved if scan else 0)}}


def _arena_plan(cfg, dtype, args, ranks: int, context_ranks: int = 1) -> dict:
    """What one rank's cache arena of `--cache-gib` holds: bytes per token and MLA layer, the state slot,
    and how many requests of each `--context` length fit at once (serve/memory.py's layout)."""
    from serve.memory import ArenaLayout

    budget = int(args.cache_gib * (1 << 30))
    lay = ArenaLayout.plan(cfg, budget, args.page_size, dtype, ranks, args.kv_cache_dtype, args.kda_state_dtype,
                           context_ranks, budget_name=f"--cache-gib {args.cache_gib} ({budget} bytes per rank)")
    contexts = [int(c) for c in str(args.context).split(",") if c.strip()]
    return {"cache_bytes_per_rank": budget, "kv_cache_dtype": lay.codec.kind,
            "kda_state_dtype": lay.state_dtype,
            "page_size": lay.page_size, "kda_state_ranks": ranks, "mla_context_ranks": context_ranks,
            # one rank's bytes: a token's latent is on one rank of `mla_context_ranks`
            "mla_bytes_per_token_per_layer": lay.latent_words * 4 // context_ranks,
            "mla_bytes_per_token": lay.latent_words * 4 * lay.num_mla_layers // context_ranks,
            "state_slot_bytes_per_rank": lay.slot_units * lay.unit_bytes,
            "sequences": {str(c): lay.sequences_at(c) for c in contexts}}


def _cmd_serve(args) -> int:
    try:
        from serve.cli import serve_main
    except ImportError as e:  # the HTTP server lands with the serving issues
        print(f"k3jax serve is not available in this build: {e}", file=sys.stderr)
        return 2
    return serve_main(args)


def _cmd_run_batch(args) -> int:
    from serve.run_batch import run_batch_main

    return run_batch_main(args)


DTYPE_NAMES = ("auto", "bfloat16", "float32", "float", "half", "float16")  # vLLM's --dtype choices


def dtype_arg(text: str) -> str:
    """`--dtype` as vLLM names it -> "auto" (the checkpoint's: `k3jax.runtime.resolve_dtype`), "bfloat16" or
    "float32" ("float"); float16 ("half") is refused, saying so: the model runs in bfloat16 or float32 only."""
    if text in ("half", "float16"):
        raise argparse.ArgumentTypeError(f"{text!r}: float16 is not supported; use bfloat16 (or auto: the "
                                         f"checkpoint's dtype)")
    if text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DTYPE_NAMES)})")
    return "float32" if text == "float" else text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 / Kimi-Linear in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="greedy generation from a prompt")
    g.add_argument("--model", default="tiny-k3", help="preset name or checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--dtype", default="auto", type=dtype_arg,
                   help="auto (the default: the checkpoint's; presets float32), float32 or bfloat16")
    g.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    g.set_defaults(fn=_cmd_generate)

    c = sub.add_parser("convert", help="write an Orbax checkpoint of a loaded model")
    c.add_argument("src")
    c.add_argument("dst")
    # auto, as for the other commands: a float32 source converted to bf16 by default was no longer the model
    # `load_model(DST)` was to restore (a preset's converted copy generated other tokens)
    c.add_argument("--dtype", default="auto", type=dtype_arg,
                   help="auto (the default: the source's; presets float32), float32 or bfloat16")
    c.set_defaults(fn=_cmd_convert)

    i = sub.add_parser("info", help="parameter and cache sizes (abstract; works for the full K3)")
    i.add_argument("--model", default="k3")
    i.add_argument("--dtype", default="bfloat16", type=dtype_arg, help="bfloat16, float32 or auto (the checkpoint's)")
    i.add_argument("--sharding", default=None, help="also the bytes per device under this sharding config")
    i.add_argument("--devices", type=int, default=8, help="devices for --sharding (default 8)")
    i.add_argument("--cache-gib", type=float, default=None,
                   help="also plan a cache arena of this many GiB per device: how many requests of each "
                        "--context length it holds at once")
    i.add_argument("--context", default="8192,32768,131072", help="comma-separated context lengths (tokens)")
    i.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"])
    i.add_argument("--kda-state-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="KDA recurrent state storage for the arena plan")
    i.add_argument("--page-size", type=int, default=None,
                   help="MLA page size in tokens (default: the engine's, EngineConfig.page_size)")
    i.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                   help="MLA pages split by position over the ranks that split the KDA heads (needs --sharding)")
    i.add_argument("--max-num-seqs", type=int, default=64, help="for the count of step programs compiled at start-up")
    i.add_argument("--max-model-len", type=int, default=32768, help="for the count of step programs")
    i.add_argument("--max-prefill-seqs", type=int, default=4, help="for the count of step programs")
    i.add_argument("--prefill-chunk", type=int, default=64, help="for the count of step programs")
    i.add_argument("--max-loras", type=int, default=0, help="also the device bytes of this many LoRA adapter slots")
    i.add_argument("--max-lora-rank", type=int, default=16)
    i.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                   help="as for serve: 'experts' adds the routed experts' adapter slots")
    i.add_argument("--lora-experts-shared-a", action="store_true", help="as for serve: one A for all experts")
    i.set_defaults(fn=_cmd_info)

    # no abbreviated options: a vLLM / SGLang flag we lack must not land on one of ours (SGLang's `--tp 8` was our
    # `--tpm 8`, a limit of 8 tokens a minute that refused every request)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: k3-small, no download)",
                       allow_abbrev=False)
    try:
        from serve.cli import add_serve_arguments
    except ImportError:  # serving stack not installed: the basic options only
        s.add_argument("--model", default="k3-small")
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=int, default=8000)
        s.add_argument("--dtype", default="auto", type=dtype_arg)
    else:
        add_serve_arguments(s)
        s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="vLLM's `serve MODEL`: the same as --model")
    s.set_defaults(fn=_cmd_serve)

    b = sub.add_parser("run-batch", help="offline batch in OpenAI's Batch file format (JSONL in, JSONL out)",
                       allow_abbrev=False)
    b.add_argument("-i", "--input-file", required=True,
                   help="JSONL of {custom_id, method, url, body} (url: /v1/chat/completions, /v1/completions, "
                        "/v1/responses); a local file, '-' reads stdin (URLs are refused: no network)")
    b.add_argument("-o", "--output-file", required=True, help="JSONL results, one per request (a local file); '-' writes stdout")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: 4 x --max-num-seqs)")
    try:
        from serve.cli import add_serve_arguments
    except ImportError:
        pass
    else:
        add_serve_arguments(b, server=False)  # as vLLM's run-batch: the engine's options, none of the server's
    b.set_defaults(fn=_cmd_run_batch)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["serve"], ["run-batch"]):  # vLLM's --config FILE.yaml and --flag_name spellings
        try:
            from serve.cli import vllm_argv
        except ImportError:
            pass
        else:
            sub = parser._subparsers._group_actions[0].choices[argv[0]]
            try:
                argv = argv[:1] + vllm_argv(argv[1:], sub._option_string_actions)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    args = parser.parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
