"""A stand-in AsyncEngine for HTTP tests of what the server asks the engine for (no model, no compile)."""

from __future__ import annotations

from types import SimpleNamespace as NS


class Recorder:
    """Answers every request with one token (`token`, decoded as `text`), recording each request's params;
    `tokenizer` None: token-id prompts only; `defaults`: the model's generation config, read as `setting` says
    (`--generation-config`: "auto", "vllm" or a directory)."""

    def __init__(self, max_model_len: int, tokenizer=None, defaults: dict | None = None, vocab_size: int = 512,
                 token: int = 7, text: str = "", setting: str = "auto"):
        self.engine = NS(tokenizer=tokenizer, cfg=NS(vocab_size=vocab_size, family="byte", hidden_size=4),
                         decode_buckets=[4],
                         config=NS(max_model_len=max_model_len, max_logprobs=5, generation_config=setting),
                         generation_defaults=defaults or {})
        self.capacity, self.alive, self.params = 4, True, []
        self.token, self.text = token, text

    def stats(self) -> dict:
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        self.params.append(params)
        on_accept()
        n = params.beam_width if hasattr(params, "beam_width") else params.n  # (a beam search: its hypotheses)
        yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(j, self.text, [self.token], "length")
                                                              for j in range(n)], finished=True)


def post_then_scrape(engine, body: dict) -> tuple:
    """POST `body` to /v1/completions of an app over `engine`, then GET /metrics -> (response, metrics text)."""
    import asyncio

    import httpx

    from serve.api import create_app

    app = create_app(engine, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json=body)
            return r, (await c.get("/metrics")).text

    return asyncio.run(go())
