"""K3 reasoning parser (serve/reasoning.py) and the chat endpoint's use of it: whole messages, every
way of streaming the same text, and the OpenAI objects the chat format builds from engine outputs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from serve.reasoning import ChannelSplitter, split_reasoning
from serve.types import CompletionOutput, RequestOutput

THINK = "Let me see: 2 < 3 and <|open tags|> are text.\n"
ANSWER = "The answer is <b>5</b>.\n"
FULL = f"{THINK}<|close|>think<|sep|><|open|>response<|sep|>{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.mark.parametrize("text, start, want", [
    (FULL, "think", (THINK, ANSWER)),
    (f"{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>", "response", ("", ANSWER)),
    (f"{THINK}<|close|>think<|sep|>\n  {ANSWER}", "think", (THINK, ANSWER)),  # no response opener
    (THINK, "think", (THINK, "")),  # cut off while thinking (max_tokens)
    (f"{THINK}<|close|>think<|sep|><|open|>response<|sep|>{ANSWER}", "think", (THINK, ANSWER)),  # cut off
    (f"{THINK}<|close|", "think", (THINK + "<|close|", "")),  # an unfinished marker at the end is text
    ("", "think", ("", "")),
    # answer text before a late response opener (or a closer without opener): the markers are dropped
    (f"{THINK}<|close|>think<|sep|> So <|open|>response<|sep|>{ANSWER}", "think", (THINK, "So " + ANSWER)),
    (f"{THINK}<|close|>think<|sep|>{ANSWER}<|close|>response<|sep|>x", "think", (THINK, ANSWER)),
    (f"{THINK}<|close|>think<|sep|> <|open|>resp", "think", (THINK, "<|open|>resp")),
])
def test_split_whole_messages(text, start, want):
    assert split_reasoning(text, start) == want


def test_content_spans_locate_the_content_not_the_markup():
    """`content_spans`: where the content lies in the text (the answer "on" is not the `on` of `response`)."""
    from serve.reasoning import content_spans

    text = "so on<|close|>think<|sep|> <|open|>response<|sep|>on<|close|>response<|sep|><|close|>message<|sep|>"
    at = text.index("<|sep|>on") + len("<|sep|>")
    assert content_spans(text) == [(at, at + 2)]
    for text, start, want in [(FULL, "think", ANSWER), (f"{THINK}<|close|>think<|sep|>\n  {ANSWER}", "think", ANSWER),
                              (f"{THINK}<|close|>think<|sep|> So <|open|>response<|sep|>{ANSWER}", "think",
                               "So " + ANSWER), (f"{THINK}<|close|>think<|sep|> <|open|>resp", "think", "<|open|>resp")]:
        assert "".join(text[a:b] for a, b in content_spans(text, start)) == want


def test_every_streaming_split_gives_the_same_parts():
    rng = random.Random(0)
    for text, start in ((FULL, "think"), (f"{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>", "response"),
                        (f"{THINK}<|close|>think<|sep|>x{ANSWER}", "think"),
                        (f"{THINK}<|close|>think<|sep|> So {ANSWER}<|open|>response<|sep|>{ANSWER}", "think"),
                        (f"{THINK}<|close|>think<|sep|>So{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>",
                         "think")):
        want = split_reasoning(text, start)
        for _ in range(300):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 25)))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            s = ChannelSplitter(start)
            parts = [s.feed(p) for p in pieces] + [s.finish()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want


def test_bad_start_channel():
    with pytest.raises(ValueError, match="start"):
        ChannelSplitter("answer")


def _outputs(text, finish=None):
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [7] * len(text), finish_reason=finish)],
                         finish is not None)


def test_chat_format_splits_full_and_streamed_messages():
    from serve.api import _ChatFormat

    st = SimpleNamespace(model_name="k3", tokenizer=None, system_fingerprint=None)
    run = SimpleNamespace(prompts=[[1]], output=lambda i: _outputs(FULL, "stop"), usage=lambda: {})
    msg = _ChatFormat(st, "id", 1, None, 0, reasoning="think").full(run)["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == THINK and msg["content"] == ANSWER  # vLLM's, SGLang's
    raw = _ChatFormat(st, "id", 1, None, 0).full(run)["choices"][0]["message"]
    assert raw["content"] == FULL and "reasoning_content" not in raw and "reasoning" not in raw
    hidden = _ChatFormat(st, "id", 1, None, 0, reasoning="think", include_reasoning=False).full(run)
    assert "reasoning" not in hidden["choices"][0]["message"] and hidden["choices"][0]["message"]["content"] == ANSWER

    def streamed(fmt):
        got = {}
        sent = 0
        for end in range(5, len(FULL) + 1, 11):  # the engine's deltas as tokens arrive
            for chunk in fmt.deltas(0, _outputs(FULL[sent:end]), False):
                for k, v in chunk["choices"][0]["delta"].items():
                    got[k] = got.get(k, "") + v
            sent = end
        for chunk in fmt.deltas(0, _outputs(FULL[sent:], "stop"), False):
            assert chunk["choices"][0]["finish_reason"] == "stop"
            for k, v in chunk["choices"][0]["delta"].items():
                got[k] = got.get(k, "") + v
        return got

    assert streamed(_ChatFormat(st, "id", 1, None, 0, reasoning="think")) == {
        "reasoning": THINK, "reasoning_content": THINK, "content": ANSWER}
    assert streamed(_ChatFormat(st, "id", 1, None, 0, reasoning="think", include_reasoning=False)) == {
        "content": ANSWER}


def test_chat_echo_starts_each_answer_with_the_assistants_last_message():
    """vLLM's chat `echo`: the content of a final assistant message (a continued turn) starts every choice's
    content, whole and streamed (a chunk per choice after the role chunks); other last roles echo nothing."""
    from serve.api import ChatCompletionRequest, _ChatFormat, _echo

    st = SimpleNamespace(model_name="k3", tokenizer=None, system_fingerprint=None)
    run = SimpleNamespace(prompts=[[1]], output=lambda i: _outputs(ANSWER, "stop"), usage=lambda: {})
    parts = [{"type": "text", "text": "Sure"}, {"type": "text", "text": "then: "}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}])
    assert _echo(body) == "Sure\nthen: "  # vLLM joins text parts with newlines
    user_last = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    assert _echo(user_last) == ""  # the answer's role is the assistant's
    assert _echo(user_last.model_copy(update={"add_generation_prompt": False})) == "Hi"  # ... else the last one's
    assert _ChatFormat(st, "id", 1, None, 0, echo="Sure: ").full(run)["choices"][0]["message"]["content"] == \
        "Sure: " + ANSWER
    start = _ChatFormat(st, "id", 2, None, 0, echo="Sure: ").start(1, False)
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in start] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
        (0, {"content": "Sure: "}), (1, {"content": "Sure: "})]


def test_reasoning_start_follows_family_thinking_and_the_server_flag():
    from serve.api import _reasoning_start

    st = SimpleNamespace(chat_family="k3", reasoning_parser=True)
    body = lambda **kw: SimpleNamespace(**{"add_generation_prompt": True, "chat_template_kwargs": None, **kw})
    assert _reasoning_start(st, body()) == "think"
    assert _reasoning_start(st, body(chat_template_kwargs={"thinking": False})) == "response"
    assert _reasoning_start(st, body(chat_template_kwargs={"thinking": None})) == "think"  # the renderer's default
    assert _reasoning_start(st, body(add_generation_prompt=False)) is None
    assert _reasoning_start(SimpleNamespace(chat_family="kimi_linear", reasoning_parser=True), body()) is None
    assert _reasoning_start(SimpleNamespace(chat_family="k3", reasoning_parser=False), body()) is None


def test_reasoning_token_count_follows_the_channels():
    """The think channel's generated tokens: its end marker's included, none after it (the answer, the markup),
    all of a think channel cut short, none when the prompt opened the response channel."""
    from k3jax.tokenizer import ByteTokenizer
    from serve.reasoning import THINK_END, reasoning_token_count

    tok = ByteTokenizer(320)  # a byte per token
    assert reasoning_token_count(tok, tok.encode(FULL)) == len((THINK + THINK_END).encode())
    assert reasoning_token_count(tok, tok.encode(THINK)) == len(THINK.encode())
    assert reasoning_token_count(tok, tok.encode(ANSWER), "response") == 0
    assert reasoning_token_count(tok, []) == 0
