"""benchmarks/startup.py: its count of an engine's default step programs is the engine's own."""
import sys
from pathlib import Path

import k3jax
from serve.engine import Engine, EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import startup  # noqa: E402


def test_default_program_count_is_the_engines():
    model = k3jax.load_model("tiny-k3")
    for seqs, ctx in ((64, 4096), (8, 512), (256, 1024)):
        eng = Engine(model, EngineConfig(max_num_seqs=seqs, max_model_len=ctx, max_num_batched_tokens=max(512, seqs),
                                         cache_bytes=16 << 20), warmup=False, progress=False)
        got = startup.default_programs(seqs, ctx, eng.config.page_size)
        assert got["programs"] == len(eng.bucket_shapes())
        assert tuple(got["decode_buckets"]) == eng.decode_buckets and tuple(got["context_buckets"]) == eng.context_buckets
