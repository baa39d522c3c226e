"""Structured-output overhead at K3's vocabulary size (163,840 ids): host masks and the device masking.

    python benchmarks/structured.py          # ~2-3 min on the 2-core CPU host; writes results/structured-cpu.json

What is measured
----------------
* Vocabulary: 163,840 ids (K3's padded size: 163,584 ordinary + 256 special), built from this machine's
  Python standard library sources: the 256 bytes, CJK ideographs, numbers, then the most frequent
  pre-tokenized pieces (words with and without a leading space, punctuation runs, whitespace runs) of
  the corpus. Not K3's BPE (its `tiktoken.model` is not on this machine; no downloads), but a trie of
  the same size and a similar mix of word, code, digit and CJK tokens, which is what mask computation
  walks.
* Host, per constraint (a 6-field order JSON schema with a nested object and an array, a regex, the
  `tool_choice="required"` schema of 3 functions): grammar compile time, then the time to compute the
  next-token bitmask before each token of a valid answer (repeated), for k3jax's path (llguidance through
  `serve/structured.py`) and for the peer xgrammar (vLLM's default backend) on the same vocabulary,
  schema and answer tokens. Tokenizer set-up time for both.
* Engine: `k3-small` (512-token byte vocabulary, so the host masks are cheap here; the rows above give
  their cost at K3's size), c = 8 greedy requests decoding 48 tokens, every row constrained to a regex
  that never ends early against the same wave unconstrained, alternating waves, median decode-only step:
  what the constraint costs in the engine loop (mask array, matcher advance, the masked branch).
* Device: `serve.sampling.sample` jitted at V = 163,840 and B = 1 / 8 / 32 / 64, greedy, with every row
  constrained (random bitmasks) against the same batch unconstrained (the mask branch skipped), median
  of 9 calls; the masking's compulsory traffic (read the logits and the mask, write the masked logits)
  against the bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from serving import _loadavg, machine_info, make_engine, measure_bandwidth, med, pct, run_wave  # noqa: E402
from serve.sampling import SamplingBatch, sample  # noqa: E402
from serve.structured import GrammarCompiler, mask_words  # noqa: E402
from serve.tools import plan_tools  # noqa: E402
from serve.types import SamplingParams, StructuredOutputsParams as SO  # noqa: E402

VOCAB = 163840
SPECIALS = 256
EOS = VOCAB - SPECIALS + 1  # the second special id, as K3's [EOS]
_PIECES = re.compile(r"""'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def build_vocab(n_ordinary: int = VOCAB - SPECIALS, max_bytes: int = 40 << 20) -> list[bytes]:
    """256 bytes, CJK ideographs, numbers, then the corpus's most frequent pieces (see the docstring)."""
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)

    def add(b: bytes) -> None:
        if b not in seen and len(tokens) < n_ordinary:
            seen.add(b)
            tokens.append(b)

    for cp in range(0x4E00, 0x9FA6):
        add(chr(cp).encode())
    for i in range(1000):
        add(str(i).encode())
        add(f" {i}".encode())
    counts: collections.Counter = collections.Counter()
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        counts.update(p for p in _PIECES.findall(text) if len(p.encode()) <= 16)
        size += len(text)
        if size > max_bytes:
            break
    for piece, _ in counts.most_common():
        b = piece.encode()
        for j in range(2, len(b)):  # BPE vocabularies hold the prefixes their merges pass through
            add(b[:j])
        add(b)
        if len(tokens) >= n_ordinary:
            break
    k = 0
    while len(tokens) < n_ordinary:  # a small corpus: pad with two-piece joins
        add(tokens[256 + k % 5000] + tokens[256 + (k * 7919) % 20000])
        k += 1
    return tokens


class SyntheticTokenizer:
    """The tokenizer surface `serve/structured.py` reads, over `build_vocab`; `encode` is greedy longest
    match (used for fixed strings in grammars and to tokenize the answers)."""

    chat_family = "byte"

    def __init__(self, ordinary: list[bytes]):
        self.ordinary = ordinary
        self.index = {b: i for i, b in enumerate(ordinary)}
        self.vocab_size = len(ordinary) + SPECIALS
        self.eos_token_ids = (EOS,)
        self.bos_token_id = len(ordinary)

    def is_special(self, i: int) -> bool:
        return i >= len(self.ordinary)

    def token_bytes(self, i: int) -> bytes:
        return self.ordinary[i] if i < len(self.ordinary) else f"<|special_{i}|>".encode()

    def id_to_token(self, i: int):
        return None if i < len(self.ordinary) else f"<|special_{i}|>"

    def encode(self, text: str, add_special: bool = False, allow_special=False) -> list[int]:
        b, out, i = text.encode(), [], 0
        while i < len(b):
            for j in range(min(len(b), i + 16), i, -1):
                t = self.index.get(b[i:j])
                if t is not None:
                    out.append(t)
                    i = j
                    break
        return out


ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                 "required": ["name", "vip"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "status": {"enum": ["open", "paid", "shipped"]},
    "notes": {"type": "string"}, "total": {"type": "number"}},
    "required": ["order_id", "customer", "items", "status", "notes", "total"], "additionalProperties": False}
ORDER_ANSWER = {"order_id": "ABC-012345", "customer": {"name": "Ada Lovelace", "vip": True},
                "items": [{"sku": "pen-blue", "qty": 3, "price": 1.25}, {"sku": "notebook", "qty": 1, "price": 4.5}],
                "status": "paid", "notes": "leave at the front desk, ring twice", "total": 8.25}
REGEX = r"[A-Z][a-z]+ [0-9]{1,4}(, [A-Z][a-z]+ [0-9]{1,4})*"
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                     "required": ["city"]}),
    ("search", {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                "required": ["query"]}),
    ("send_email", {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                     "body": {"type": "string"}}, "required": ["to", "body"]}))]


def cases() -> list[tuple[str, SO, str]]:
    required = plan_tools(TOOLS, "required", None).constraint()
    return [("json_schema order", SO(json=ORDER), json.dumps(ORDER_ANSWER)),
            ("regex", SO(regex=REGEX), "Paris 12, Rome 7, Oslo 1999, Lima 450"),
            ("tool_choice required (3 functions)", required,
             json.dumps([{"name": "search", "parameters": {"query": "weather in paris tomorrow", "top_k": 3}},
                         {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]))]


def _walk_timed(new_matcher, fill, accept, ids: list[int], reps: int) -> tuple[list, list]:
    """Per answer token: seconds to fill the next-token mask, then to accept the token."""
    masks, consumes = [], []
    for _ in range(reps):
        m = new_matcher()
        for t in ids:
            t0 = time.perf_counter()
            fill(m)
            t1 = time.perf_counter()
            assert accept(m, t), "the answer must be allowed"
            consumes.append(time.perf_counter() - t1)
            masks.append(t1 - t0)
    return masks, consumes


def time_llguidance(gc: GrammarCompiler, so: SO, ids: list[int], reps: int) -> dict:
    t0 = time.perf_counter()
    gc.compile(so)
    compile_s = time.perf_counter() - t0
    row = np.zeros(mask_words(VOCAB), np.int32)

    def accept(g, t):
        return bool((row[t >> 5] >> (t & 31)) & 1) and g.advance(t)
    masks, consumes = _walk_timed(lambda: gc.guide(so), lambda g: g.fill(row), accept, ids, reps)
    return _summary(compile_s, masks, consumes, len(ids))


def time_xgrammar(info, so: SO, ids: list[int], reps: int) -> dict:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    if so.regex is not None:
        compiled = compiler.compile_regex(so.regex)
    else:
        compiled = compiler.compile_json_schema(json.dumps(so.json), max_whitespace_cnt=20)
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    masks, consumes = _walk_timed(lambda: xgr.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bitmask),
                                  lambda m, t: m.accept_token(t), ids, reps)
    return _summary(compile_s, masks, consumes, len(ids))


def _summary(compile_s, masks, consumes, n) -> dict:
    us = lambda xs, q: round(pct(xs, q) * 1e6, 1)  # noqa: E731
    return dict(compile_ms=round(compile_s * 1e3, 2), answer_tokens=n, mask_us_p50=us(masks, 50),
                mask_us_p90=us(masks, 90), mask_us_max=round(max(masks) * 1e6, 1),
                mask_us_mean=round(float(np.mean(masks)) * 1e6, 1), consume_us_p50=us(consumes, 50))


def device_masking(batches=(1, 8, 32, 64), reps: int = 9) -> list[dict]:
    rng = np.random.default_rng(0)
    fn = jax.jit(sample)
    out = []
    for b in batches:
        logits = jnp.asarray(rng.standard_normal((b, VOCAB)).astype(np.float32))
        masks = rng.integers(-(2 ** 31), 2 ** 31, (b, mask_words(VOCAB)), dtype=np.int64).astype(np.int32)
        params = [SamplingParams(temperature=0)] * b
        plain = SamplingBatch.from_params(params, [0] * b, [0] * b, b, None, None, 0, None, mask_words(VOCAB))
        masked = SamplingBatch.from_params(params, [0] * b, [0] * b, b, None, None, 0, masks, mask_words(VOCAB))
        tokens = np.asarray(fn(logits, masked).tokens)
        assert all((masks[i, t >> 5] >> (t & 31)) & 1 for i, t in enumerate(tokens)), "masked tokens only"
        fn(logits, plain).tokens.block_until_ready()
        ts = {"unconstrained": [], "constrained": []}
        for _ in range(reps):  # alternate, so both see the same load
            for name, batch in (("unconstrained", plain), ("constrained", masked)):
                t0 = time.perf_counter()
                fn(logits, batch).tokens.block_until_ready()
                ts[name].append(time.perf_counter() - t0)
        times = {k: med(v) for k, v in ts.items()}
        nbytes = b * VOCAB * 4 * 2 + masks.nbytes  # logits in and out, the mask
        out.append(dict(batch=b, unconstrained_ms=round(times["unconstrained"] * 1e3, 3),
                        constrained_ms=round(times["constrained"] * 1e3, 3),
                        masking_ms=round((times["constrained"] - times["unconstrained"]) * 1e3, 3),
                        masking_bytes=nbytes))
    return out


def engine_overhead(waves: int = 3, c: int = 8, gen: int = 48) -> dict:
    import k3jax

    model = k3jax.load_model("k3-small")
    eng, build_s = make_engine(model, dict(max_model_len=256, cache_bytes=256 << 20, max_num_seqs=c,
                                           decode_buckets=(c,), prefill_buckets=(c,), prefill_chunk=64,
                                           context_buckets=(16,), measure_moe_time=False))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 250, 40)] for _ in range(c)]
    plain = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True,
                            structured_outputs=SO(regex="[a-z][a-z ,.]{200}"))
    steps = {"unconstrained": [], "constrained": []}
    mask_s = 0.0
    for _ in range(waves):
        for name, sp in (("unconstrained", plain), ("constrained", guided)):
            m0 = eng.mask_seconds
            w = run_wave(eng, prompts, sp)
            steps[name] += [dt for dt, _ in w["decode_only_steps"]]
            if name == "constrained":
                mask_s += eng.mask_seconds - m0
                assert all(re.fullmatch("[a-z][a-z ,.]*", bytes(t).decode("latin-1")) for t in w["token_ids"])
    out = {k: round(med(v) * 1e3, 2) for k, v in steps.items()}
    return dict(model="k3-small", concurrency=c, gen_tokens=gen, waves=waves, engine_build_s=round(build_s, 1),
                decode_step_ms=out, overhead_ms=round(out["constrained"] - out["unconstrained"], 2),
                host_mask_ms_per_step=round(mask_s / max(1, len(steps["constrained"])) * 1e3, 3),
                compiles_after_warmup=eng.compiles_after_warmup)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "structured-cpu.json"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    t_start = time.time()
    info = machine_info()
    t0 = time.perf_counter()
    ordinary = build_vocab()
    tok = SyntheticTokenizer(ordinary)
    vocab_s = time.perf_counter() - t0
    gc = GrammarCompiler(tok, VOCAB, tok.eos_token_ids)
    t0 = time.perf_counter()
    gc.ll_tokenizer  # noqa: B018  (built on first use)
    setup = {"llguidance_tokenizer_s": round(time.perf_counter() - t0, 3)}
    xinfo = None
    try:
        import xgrammar as xgr

        t0 = time.perf_counter()
        encoded = [tok.token_bytes(i) if not tok.is_special(i) else b"" for i in range(VOCAB)]
        xinfo = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
        setup["xgrammar_tokenizer_s"] = round(time.perf_counter() - t0, 3)
    except ImportError:
        setup["xgrammar"] = "not installed: peer skipped (pip install xgrammar)"
    rows = []
    for name, so, answer in cases():
        ids = tok.encode(answer)
        row = dict(constraint=name, answer_chars=len(answer), k3jax_llguidance=time_llguidance(gc, so, ids, args.reps))
        if xinfo is not None:
            row["peer_xgrammar"] = time_xgrammar(xinfo, so, ids, args.reps)
        rows.append(row)
        print(json.dumps(row))
    eng = engine_overhead()
    print(json.dumps(eng))
    bw = measure_bandwidth()
    dev = device_masking()
    for d in dev:
        d["masking_roofline_ms"] = round(d["masking_bytes"] / (bw["GBps"] * 1e9) * 1e3, 3)
        print(json.dumps(d))
    info["loadavg_end"] = _loadavg()
    result = dict(benchmark="structured outputs", machine=info, vocab_size=VOCAB, vocab_build_s=round(vocab_s, 2),
                  vocab_note="synthetic 163,840-id vocabulary from the stdlib sources (see the docstring)",
                  setup=setup, host_masks=rows, engine=eng, bandwidth=bw, device_masking=dev,
                  llguidance=__import__("llguidance").__version__, wall_s=round(time.time() - t_start, 1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
