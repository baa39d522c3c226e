"""K3 reasoning parser: split an XTML assistant message into its think and response channels.

K3 answers inside XTML channels (k3jax/chat_template.py). With thinking on, the generation prompt ends
in `<|open|>think<|sep|>` and the model writes

    REASONING<|close|>think<|sep|><|open|>response<|sep|>ANSWER<|close|>response<|sep|><|close|>message<|sep|>

before its stop token `<|end_of_msg|>`; with thinking off the prompt opens the response channel and
the text starts at ANSWER. The markers are `special: false` tokens, so they arrive as text. The chat
endpoint returns REASONING as `reasoning` and `reasoning_content` and ANSWER as `content` (vLLM's and SGLang's fields), never the
markers. Text outside any channel (after the message closes, or before a channel opens) is dropped,
except that text in an unopened response position counts as content, so a model that skips
`<|open|>response<|sep|>` after thinking loses nothing.

`ChannelSplitter` works on streamed deltas: a marker split across deltas is held back until it is
complete or ruled out, so every split of the same text yields the same reasoning and content.
"""

from __future__ import annotations

OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
THINK_END = f"{CLOSE}think{SEP}"
RESPONSE_START = f"{OPEN}response{SEP}"
RESPONSE_END = f"{CLOSE}response{SEP}"
MESSAGE_END = f"{CLOSE}message{SEP}"
THINK_START = f"{OPEN}think{SEP}"

# per state: markers that end it -> next state
_TRANSITIONS = {
    "think": {THINK_END: "between"},
    "between": {RESPONSE_START: "response", THINK_START: "think", MESSAGE_END: "done"},
    # text after the reasoning without the response opener: the answer (an opener or closer that
    # still comes is dropped, so the split does not depend on where the deltas were cut)
    "answer": {RESPONSE_START: "response", THINK_START: "think", RESPONSE_END: "after", MESSAGE_END: "done"},
    "response": {RESPONSE_END: "after", MESSAGE_END: "done"},
    "after": {MESSAGE_END: "done", RESPONSE_START: "response"},
    "done": {},
}


class ChannelSplitter:
    """Incremental split of K3 assistant text into (reasoning, content) deltas.

    `start` is the channel the generation prompt opened: "think" (thinking on) or "response"."""

    def __init__(self, start: str = "think"):
        if start not in ("think", "response"):
            raise ValueError(f"start: expected 'think' or 'response', got {start!r}")
        self.state = start
        self._held = ""
        self._pos = 0  # offset in the fed text of the first character not yet split (the held text's)
        self.spans: list[tuple[int, int]] = []  # where the content came from: [begin, end) offsets in the fed text

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta) for this text delta."""
        buf, self._held = self._held + text, ""
        reasoning, content = [], []
        while buf:
            if self.state == "between":
                rest = buf.lstrip()  # (layout between channels is dropped)
                if rest and not any(rest.startswith(m) or m.startswith(rest) for m in _TRANSITIONS["between"]):
                    self._pos += len(buf) - len(rest)
                    self.state, buf = "answer", rest  # the model skipped the response opener
                    continue
            markers = _TRANSITIONS[self.state]
            hits = [(buf.find(m), m) for m in markers if m in buf]
            if hits:
                at, marker = min(hits)
                self._emit(buf[:at], reasoning, content)
                self._pos += len(marker)
                self.state = markers[marker]
                buf = buf[at + len(marker):]
                continue
            keep = _partial_suffix(buf, markers)  # a marker may be starting at the end
            self._emit(buf[:len(buf) - keep], reasoning, content)
            self._held = buf[len(buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush text held as a possible marker start (the stream ended)."""
        reasoning, content = [], []
        if self.state == "between" and self._held.strip():  # an unfinished marker is text: the answer
            self._pos += len(self._held) - len(self._held.lstrip())
            self.state, self._held = "answer", self._held.lstrip()
        self._emit(self._held, reasoning, content)
        self._held = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list, content: list) -> None:
        """`text`, the next of the fed text from `_pos` on, goes to the current channel (or is dropped)."""
        if not text:
            return
        if self.state == "think":
            reasoning.append(text)
        elif self.state in ("response", "answer"):
            content.append(text)
            if self.spans and self.spans[-1][1] == self._pos:  # (one span for a run of content)
                self.spans[-1] = (self.spans[-1][0], self._pos + len(text))
            else:
                self.spans.append((self._pos, self._pos + len(text)))
        self._pos += len(text)


def _partial_suffix(buf: str, markers) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def content_spans(text: str, start: str = "think") -> list[tuple[int, int]]:
    """Where `split_reasoning`'s content lies in `text`: its [begin, end) offsets, in order (the answer channel
    without the markup around it, which may contain the same text: `<|close|>response` holds "on")."""
    s = ChannelSplitter(start)
    s.feed(text)
    s.finish()
    return s.spans


def split_reasoning(text: str, start: str = "think") -> tuple[str, str]:
    """Whole-message form: -> (reasoning, content)."""
    s = ChannelSplitter(start)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def reasoning_token_count(tokenizer, token_ids, start: str = "think") -> int:
    """How many of the generated `token_ids` the think channel took: those decoded while it was open (its end
    marker's tokens included), as `ChannelSplitter` splits their text; 0 when the prompt opened the response.
    Only a token ending a marker (each ends in '>') opens or closes the channel, so the text is fed in runs
    that end at such tokens (any split gives the same channels; one feed per token is slow for long answers)."""
    split, detok, n, run = ChannelSplitter(start), tokenizer.incremental_detokenizer(), 0, []
    for t in token_ids:
        n += split.state == "think"
        run.append(detok.add(t))
        if ">" in run[-1]:
            split.feed("".join(run))
            run = []
    return n
