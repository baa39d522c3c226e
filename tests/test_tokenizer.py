"""Tests for k3jax.tokenizer and k3jax.chat_template (spec §3.4, §1 special ids).

Everything runs on synthetic local files (a tiny ``tiktoken.model`` written to a
tmp dir); no model hub access.
"""

from __future__ import annotations

import base64
import json
import random

import pytest
import regex

from k3jax import tokenizer as tokmod
from k3jax.chat_template import (
    KIMI_DEFAULT_SYSTEM_PROMPT,
    chat_markers,
    encode_chat,
    render_chat,
    render_chat_segments,
    validate_messages,
)
from k3jax.tokenizer import (
    KIMI_PAT_STR,
    KIMI_PAT_STR_V1,
    ByteTokenizer,
    IncrementalDetokenizer,
    KimiTokenizer,
    decode_stream,
    load_tokenizer,
    split_for_encoding,
)

MULTILINGUAL = (
    "Hello World! I'm HAPPY they're OK, we'll see. DON'T It'S CamelCaseXMLHttpRequest "
    "abc中文def 你好，世界。日本語のテキストとカタカナ 々〇・ー、〆 한국어 텍스트 "
    "Ωmega ǅemo ʰx naïve café e\u0301 résumé ǈ ῼ 𝐀𝐁 ꙮ "
    "12345 ٣٤٥ ①② x² 3.14159 1,000,000 "
    "🤖👍🏽 👨\u200d👩\u200d👧 🇯🇵 "
    "عربي עברית ไทย Ελληνικά Кириллица "
    "\u00a0 \u2003tab\tend\r\n\n  \n line   x  ...!!! ---\n\r\n"
    "\u0378 \ue000 \U000e0001 'll '"
)

# --------------------------------------------------------------------------------------
# helpers: synthetic Kimi tokenizer directories
# --------------------------------------------------------------------------------------

MERGE_WORDS = [
    "hello", " world", "Hello", " World", " the", "ing", "'s", "'re", " I", "'m",
    "123", "12", "45", "中文", "你好", "世界", "🤖", " 한국어", "é", " café", "ab", "bc",
]
# Tokens that deliberately straddle UTF-8 character boundaries ("a中文" -> 3 tokens).
SPLIT_TOKENS = [b"a\xe4", b"\xb8\xad\xe6", b"\x96\x87"]

K3_SPECIALS = {  # offset from the special base -> (content, special flag)
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False),
    4: ("<|close|>", False),
    5: ("<|sep|>", False),
    6: ("[start_header_id]", True),
    7: ("[end_header_id]", True),
    9: ("[EOT]", True),
    21: ("<|media_pad|>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}
KL_SPECIALS = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|im_end|>", True),
    3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True),
    6: ("<|start_header_id|>", True),
    7: ("<|end_header_id|>", True),
    10: ("<|im_system|>", True),
    17: ("<|im_middle|>", True),
    255: ("[PAD]", True),
}


def synthetic_ranks() -> list[bytes]:
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)

    def add(b: bytes) -> None:
        if b not in seen:
            seen.add(b)
            tokens.append(b)

    for w in MERGE_WORDS:
        wb = w.encode("utf-8")
        for j in range(2, len(wb) + 1):  # every prefix, so BPE can build the word
            add(wb[:j])
    for b in SPLIT_TOKENS:
        add(b)
    return tokens


def write_tokenizer_dir(path, tokens, specials, *, eos_token="[EOS]", config_eos=None, extra_cfg=None):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "tiktoken.model", "w") as f:
        for rank, tok in enumerate(tokens):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    base = len(tokens)
    cfg = {
        "added_tokens_decoder": {
            str(base + off): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": flag,
            }
            for off, (name, flag) in specials.items()
        },
        "bos_token": "[BOS]",
        "eos_token": eos_token,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]" if any(n == "[UNK]" for n, _ in specials.values()) else None,
        "tokenizer_class": "TikTokenTokenizer",
    }
    if extra_cfg:
        cfg.update(extra_cfg)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if config_eos is not None:
        (path / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    return path


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return write_tokenizer_dir(tmp_path_factory.mktemp("k3tok"), synthetic_ranks(), K3_SPECIALS)


@pytest.fixture(scope="module")
def k3_tok(k3_dir):
    return KimiTokenizer.from_dir(k3_dir, family="k3")


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    ranks = synthetic_ranks()
    return write_tokenizer_dir(
        tmp_path_factory.mktemp("kltok"), ranks, KL_SPECIALS, config_eos=len(ranks) + 2
    )


@pytest.fixture(scope="module")
def kl_tok(kl_dir):
    return KimiTokenizer.from_dir(kl_dir, family="kimi_linear")


def tid(tok, token: bytes) -> int:
    return tok.encoding.encode_single_token(token)


# --------------------------------------------------------------------------------------
# pre-tokenizer regex
# --------------------------------------------------------------------------------------

ALL_CODEPOINTS = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


@pytest.mark.parametrize(
    "spec_class, ours",
    [
        (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", tokmod._UPPERISH),
        (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", tokmod._LOWERISH),
    ],
)
def test_intersection_free_classes_match_v1_set_ops_on_every_codepoint(spec_class, ours):
    want = regex.findall("(?V1)" + spec_class, ALL_CODEPOINTS)
    got = regex.findall(ours, ALL_CODEPOINTS)
    assert len(want) > 50_000 and got == want
    assert "&&" not in KIMI_PAT_STR and "&&" in KIMI_PAT_STR_V1


def test_pattern_matches_spec_pattern_on_multilingual_and_random_text():
    spec = regex.compile("(?V1)" + KIMI_PAT_STR_V1)
    ours = regex.compile(KIMI_PAT_STR)
    assert ours.findall(MULTILINGUAL) == spec.findall(MULTILINGUAL)
    pool = list(MULTILINGUAL) + list(" \t\n\r'sSdDlLtT0123456789中日本語かカ가ᄀ") + ["\u0301", "\u200d", "ǅ", "ʰ"]
    rng = random.Random(1234)
    for _ in range(300):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))
        assert ours.findall(s) == spec.findall(s), repr(s)
    # Han runs are their own pieces, kana/hangul are letters, CamelCase splits.
    pieces = spec.findall("abc中文def CamelCase 日本語のテキスト")
    assert pieces == ["abc", "中文", "def", " Camel", "Case", " ", "日本語", "のテキスト"]


def test_tiktoken_splits_exactly_like_the_spec_regex():
    """Every regex piece becomes exactly one tiktoken token when all substrings are in
    the vocab, so equality of the token strings == equality of the pre-token split."""
    import tiktoken

    ref = regex.findall("(?V1)" + KIMI_PAT_STR_V1, MULTILINGUAL)
    bs = MULTILINGUAL.encode("utf-8")
    longest = max(len(p.encode("utf-8")) for p in ref)
    subs = {bs[i:j] for i in range(len(bs)) for j in range(i + 2, min(len(bs), i + longest) + 1)}
    ranks = {bytes([i]): i for i in range(256)}
    for s in sorted(subs, key=lambda s: (len(s), s)):
        ranks[s] = len(ranks)
    enc = tiktoken.Encoding("probe", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    got = [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(MULTILINGUAL)]
    assert got == [p.encode("utf-8") for p in ref]


def test_kimi_tokenizer_uses_intersection_free_pattern(k3_tok):
    assert k3_tok.encoding._pat_str == KIMI_PAT_STR


# --------------------------------------------------------------------------------------
# KimiTokenizer
# --------------------------------------------------------------------------------------


def test_k3_ids_and_specials(k3_tok):
    base = len(synthetic_ranks())
    assert k3_tok.num_base_tokens == base
    assert k3_tok.vocab_size == base + 256
    assert k3_tok.bos_token_id == base
    assert k3_tok.eos_token_ids == (base + 1, base + 2)
    assert k3_tok.eos_token_id == base + 1
    assert k3_tok.pad_token_id == base + 255
    assert k3_tok.token_to_id("<|open|>") == base + 3
    assert k3_tok.id_to_token(base + 5) == "<|sep|>"
    assert k3_tok.id_to_token(base + 100) == f"<|reserved_token_{base + 100}|>"
    assert k3_tok.token_to_id(f"<|reserved_token_{base + 100}|>") == base + 100
    assert k3_tok.id_to_token(65) is None and k3_tok.token_to_id("nope") is None
    assert k3_tok.is_special(base + 1) and k3_tok.is_special(base + 100)
    assert not k3_tok.is_special(base + 3)  # XTML markers are special:false
    assert not k3_tok.is_special(10)
    assert k3_tok.chat_family == "k3"


def test_kimi_linear_ids_and_stop(kl_tok):
    base = len(synthetic_ranks())
    assert kl_tok.eos_token_ids == (base + 1, base + 2)  # [EOS] + <|im_end|> (config eos)
    assert kl_tok.token_to_id("<|im_middle|>") == base + 17
    assert kl_tok.chat_family == "kimi_linear"


def test_config_eos_past_the_vocabulary_is_dropped_not_fatal(tmp_path, caplog):
    """A small-vocabulary checkpoint saved by HF (KimiLinearConfig's default eos_token_id 163586, written to
    config.json and generation_config.json) with its tokenizer files: the model's config drops that id with a
    warning, the tokenizer failed the load with `token id 163586 out of range`, naming neither file nor key."""
    d = write_tokenizer_dir(tmp_path, synthetic_ranks(), KL_SPECIALS, config_eos=163586)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [163586, len(synthetic_ranks()) + 2]}))
    with caplog.at_level("WARNING", logger="k3jax.tokenizer"):
        tok = load_tokenizer(d, family="kimi_linear", vocab_size=640)
    base = len(synthetic_ranks())
    assert tok.eos_token_ids == (base + 1, base + 2)  # [EOS], <|im_end|>
    assert "generation_config.json: eos_token_id 163586 is outside" in caplog.text


def test_real_layout_offsets(tmp_path):
    """A file with the real rank count puts the specials at the spec's ids."""
    tokens = synthetic_ranks()
    seen = set(tokens)
    i = 0
    while len(tokens) < tokmod.KIMI_NUM_BASE_TOKENS:
        t = b"\xff\xfe" + i.to_bytes(3, "big")
        i += 1
        if t not in seen:
            tokens.append(t)
    d = write_tokenizer_dir(tmp_path / "k3", tokens, K3_SPECIALS, config_eos=163586)
    tok = load_tokenizer(d, family="k3", vocab_size=163840)
    assert isinstance(tok, KimiTokenizer)
    assert tok.vocab_size == 163840
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (163584, (163585, 163586), 163839)
    assert [tok.token_to_id(m) for m in ("<|open|>", "<|close|>", "<|sep|>", "<|media_pad|>")] == [
        163587, 163588, 163589, 163605,
    ]
    assert tok.id_to_token(163838) == "[UNK]"
    assert tok.decode(tok.encode("hello 中文"), skip_special=True) == "hello 中文"

    d2 = write_tokenizer_dir(tmp_path / "kl", tokens, KL_SPECIALS, config_eos=163586)
    kl = load_tokenizer(d2, family="kimi_linear", vocab_size=163840)
    assert kl.eos_token_ids == (163585, 163586)
    assert kl.token_to_id("<|im_end|>") == 163586


def test_roundtrip_multilingual(k3_tok, kl_tok):
    texts = [
        MULTILINGUAL,
        "",
        "hello world",
        "I'm sure they're fine; it's 12345 o'clock.",
        "中文你好世界🤖🤖 한국어 café",
        " " * 50 + "\n\n\t x",
        "\x00\x01 control \x7f",
    ]
    for tok in (k3_tok, kl_tok):
        for t in texts:
            ids = tok.encode(t)
            assert all(0 <= i < tok.num_base_tokens for i in ids)
            assert tok.decode(ids) == t
            assert tok.decode(ids, skip_special=False) == t


def test_merges_are_applied(k3_tok):
    assert k3_tok.encode("hello") == [tid(k3_tok, b"hello")]
    assert k3_tok.encode("hello world") == [tid(k3_tok, b"hello"), tid(k3_tok, b" world")]
    assert k3_tok.encode("中文") == [tid(k3_tok, "中文".encode())]
    assert k3_tok.encode("12345") == [tid(k3_tok, b"123"), tid(k3_tok, b"45")]  # \p{N}{1,3}
    assert k3_tok.encode("I'm") == [tid(k3_tok, b"I"), tid(k3_tok, b"'m")]
    assert len(k3_tok.encode(MULTILINGUAL)) < len(MULTILINGUAL.encode("utf-8"))


def test_special_strings_only_when_allowed(k3_tok):
    base = k3_tok.num_base_tokens
    text = "hi<|open|>x[EOS]"
    plain = k3_tok.encode(text)
    assert all(i < base for i in plain) and k3_tok.decode(plain) == text
    full = k3_tok.encode(text, allow_special=True)
    assert base + 3 in full and base + 1 in full
    only_eos = k3_tok.encode(text, allow_special={"[EOS]"})
    assert base + 1 in only_eos and base + 3 not in only_eos
    assert k3_tok.encode("hello", add_special=True) == [base, tid(k3_tok, b"hello")]
    with pytest.raises(ValueError, match="unknown special"):
        k3_tok.encode(text, allow_special={"<|nope|>"})
    with pytest.raises(ValueError, match="allow_special"):
        k3_tok.encode(text, allow_special="all")


def test_decode_skip_special(k3_tok):
    base = k3_tok.num_base_tokens
    ids = [base + 3] + k3_tok.encode("hi") + [base + 5, base + 1, base + 100, base + 2]
    assert k3_tok.decode(ids, skip_special=True) == "<|open|>hi<|sep|>"  # special:false kept
    assert k3_tok.decode(ids, skip_special=False) == (
        f"<|open|>hi<|sep|>[EOS]<|reserved_token_{base + 100}|><|end_of_msg|>"
    )
    with pytest.raises(ValueError, match="out of range"):
        k3_tok.decode([k3_tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        k3_tok.decode([-1])


def test_token_str_is_hfs_convert_ids_to_tokens(k3_tok):
    """`token_str` (vLLM's /tokenize `token_strs`): HF's convert_ids_to_tokens for the Kimi tokenizer, the added
    token's name or the id's bytes in GPT-2's byte-level alphabet (a piece of a character included)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    base = k3_tok.num_base_tokens
    assert [k3_tok.token_str(t) for t in k3_tok.encode("hello world")] == ["hello", "Ġworld"]
    assert k3_tok.token_str(tid(k3_tok, b"a\xe4")) == "a" + alphabet[0xE4]
    assert [k3_tok.token_str(base + k) for k in (0, 3, 100)] == ["[BOS]", "<|open|>", f"<|reserved_token_{base + 100}|>"]
    assert "".join(alphabet[b] for b in range(256)) == "".join(ByteTokenizer().token_str(b) for b in range(256))


def test_invalid_utf8_is_replaced(k3_tok):
    assert k3_tok.decode([0xFF, 65]) == "\ufffdA"
    assert k3_tok.decode([tid(k3_tok, b"a\xe4")]) == "a\ufffd"


def test_split_for_encoding():
    s = "ab" + " " * 23 + "cd" + "x" * 12
    pieces = list(split_for_encoding(s, max_chars=1000, max_run=10))
    assert "".join(pieces) == s
    assert pieces == ["ab" + " " * 10, " " * 10, " " * 3 + "cd" + "x" * 8, "x" * 4]
    # exactly max_run is not cut; max_chars chunks
    assert list(split_for_encoding(" " * 10 + "a", max_chars=1000, max_run=10)) == [" " * 10 + "a"]
    assert list(split_for_encoding("abcdefg", max_chars=3, max_run=10)) == ["abc", "def", "g"]
    assert list(split_for_encoding("")) == []
    # normal text is untouched by the default limits
    assert list(split_for_encoding(MULTILINGUAL)) == [MULTILINGUAL]


def test_long_inputs_are_split_before_encoding(k3_tok, monkeypatch):
    text = "hello" + " " * 30_000 + "world" + "x" * 26_000
    ids = k3_tok.encode(text)
    assert k3_tok.decode(ids) == text
    monkeypatch.setattr(tokmod, "MAX_WHITESPACE_RUN_CHARS", 7)
    small = "hello" + " " * 20 + "world"
    want = []
    for p in split_for_encoding(small, max_run=7):
        want += k3_tok.encoding.encode_ordinary(p)
    assert k3_tok.encode(small) == want
    assert k3_tok.decode(k3_tok.encode(small)) == small


def test_loader_errors(tmp_path, k3_dir, kl_dir):
    with pytest.raises(ValueError, match="looks like a 'k3' tokenizer -- pass family='k3'"):
        KimiTokenizer.from_dir(k3_dir, family="kimi_linear")
    with pytest.raises(ValueError, match="pass family='kimi_linear'"):
        KimiTokenizer.from_dir(kl_dir, family="k3")
    with pytest.raises(ValueError, match="family"):
        KimiTokenizer.from_dir(k3_dir, family="k2")
    with pytest.raises(FileNotFoundError):
        KimiTokenizer.from_dir(tmp_path / "missing")

    bad = tmp_path / "gap"
    write_tokenizer_dir(bad, synthetic_ranks(), K3_SPECIALS)
    lines = (bad / "tiktoken.model").read_text().splitlines()
    lines[-1] = lines[-1].rsplit(" ", 1)[0] + f" {len(lines) + 5}"
    (bad / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(ValueError, match="ranks must be exactly"):
        KimiTokenizer.from_dir(bad)

    far = dict(K3_SPECIALS)
    far[300] = ("<|far|>", True)
    with pytest.raises(ValueError, match="outside the special range"):
        KimiTokenizer.from_dir(write_tokenizer_dir(tmp_path / "far", synthetic_ranks(), far))

    with pytest.raises(ValueError, match="eos_token"):
        KimiTokenizer.from_dir(
            write_tokenizer_dir(tmp_path / "eos", synthetic_ranks(), K3_SPECIALS, eos_token="<|nope|>")
        )


def test_load_tokenizer_dispatch(tmp_path, k3_dir):
    assert isinstance(load_tokenizer(k3_dir, "k3", 100_000), KimiTokenizer)
    # a model vocabulary padded past the tokenizer's ids: the extra ids decode (reserved, no text), the
    # named ids and stop ids stay put (a random model's sampled id 630 of 640 failed its request)
    small = KimiTokenizer.from_dir(k3_dir, "k3")
    padded = load_tokenizer(k3_dir, "k3", small.vocab_size + 60)
    assert padded.vocab_size == small.vocab_size + 60 and padded.eos_token_ids == small.eos_token_ids
    assert padded.pad_token_id == small.pad_token_id and padded.token_to_id("<|open|>") == small.token_to_id("<|open|>")
    far = small.vocab_size + 50
    assert padded.decode([far]) == "" and padded.decode([far], skip_special=False) == f"<|reserved_token_{far}|>"
    assert IncrementalDetokenizer(padded).add(far) == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    t = load_tokenizer(empty, "k3", 512)
    assert isinstance(t, ByteTokenizer) and t.vocab_size == 512
    assert isinstance(load_tokenizer(None, "kimi_linear", 264), ByteTokenizer)
    assert isinstance(load_tokenizer(k3_dir, "byte", 300), ByteTokenizer)
    with pytest.raises(ValueError, match="model vocab_size"):
        load_tokenizer(k3_dir, "k3", 300)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope", "k3", 512)
    with pytest.raises(ValueError, match="vocab_size is required"):
        load_tokenizer(None, "k3")


# --------------------------------------------------------------------------------------
# ByteTokenizer
# --------------------------------------------------------------------------------------


def test_byte_tokenizer_basics():
    tok = ByteTokenizer(300)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (256, 258, (257, 261))
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.encode("a", add_special=True) == [256, 97]
    assert tok.decode(tok.encode(MULTILINGUAL)) == MULTILINGUAL
    names = {i: tok.id_to_token(i) for i in range(256, 264)}
    assert names == {
        256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>", 259: "<|im_user|>",
        260: "<|im_assistant|>", 261: "<|im_end|>", 262: "<|im_system|>", 263: "<|im_middle|>",
    }
    assert tok.id_to_token(299) == "<|reserved_token_299|>"
    assert tok.token_to_id("<|reserved_token_299|>") == 299
    assert tok.token_to_id("<|reserved_token_300|>") is None
    assert tok.token_to_id("<|reserved_token_0299|>") is None
    assert tok.id_to_token(65) is None


def test_byte_tokenizer_specials_and_decode():
    tok = ByteTokenizer(300)
    text = "a<|im_end|>b<|eos|><|reserved_token_270|><|unknown|>"
    assert 261 not in tok.encode(text)
    ids = tok.encode(text, allow_special=True)
    assert ids[:3] == [97, 261, 98] and 257 in ids and 270 in ids
    assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(ids) == "ab<|unknown|>"
    only = tok.encode(text, allow_special={"<|eos|>"})
    assert 257 in only and 261 not in only
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # truncated char -> one replacement
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([300])
    with pytest.raises(ValueError, match=">= 264"):
        ByteTokenizer(263)
    with pytest.raises(ValueError, match="unknown special"):
        tok.encode("x", allow_special={"<|reserved_token_999|>"})
    assert ByteTokenizer(264).vocab_size == 264


# --------------------------------------------------------------------------------------
# incremental detokenization
# --------------------------------------------------------------------------------------


def test_incremental_byte_level_multibyte():
    tok = ByteTokenizer(264)
    text = "hé世🤖!"
    detok = IncrementalDetokenizer(tok)
    outs = [detok.add(i) for i in tok.encode(text)]
    assert outs == ["h", "", "é", "", "", "世", "", "", "", "🤖", "!"]
    assert detok.flush() == "" and detok.text == text
    assert "".join(decode_stream(tok, tok.encode(text))) == text


def test_incremental_tokens_straddling_characters(k3_tok):
    ids = [tid(k3_tok, t) for t in SPLIT_TOKENS]
    assert k3_tok.decode(ids) == "a中文"
    detok = k3_tok.incremental_detokenizer()
    assert [detok.add(i) for i in ids] == ["a", "中", "文"]
    # dangling partial char: nothing until flush, then one U+FFFD
    detok = k3_tok.incremental_detokenizer()
    assert detok.add(ids[0]) == "a" and detok.has_pending
    assert detok.flush() == "\ufffd"


def test_incremental_specials(k3_tok):
    base = k3_tok.num_base_tokens
    ids = [tid(k3_tok, b"a\xe4"), base + 1, base + 3] + k3_tok.encode("ok")
    skip = IncrementalDetokenizer(k3_tok, skip_special=True)
    assert [skip.add(i) for i in ids] == ["a", "", "\ufffd<|open|>", "o", "k"]
    keep = IncrementalDetokenizer(k3_tok, skip_special=False)
    assert "".join(keep.add(i) for i in ids) + keep.flush() == k3_tok.decode(ids, skip_special=False)
    with pytest.raises(ValueError, match="out of range"):
        skip.add(k3_tok.vocab_size)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_matches_decode_fuzz(k3_tok, skip):
    rng = random.Random(7)
    byte_tok = ByteTokenizer(280)
    for tok in (k3_tok, byte_tok):
        for _ in range(200):
            ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.2 else rng.randrange(256)
                   for _ in range(rng.randint(0, 25))]
            detok = IncrementalDetokenizer(tok, skip_special=skip)
            pieces = [detok.add(i) for i in ids] + [detok.flush()]
            assert "".join(pieces) == tok.decode(ids, skip_special=skip)
            assert detok.ids == ids


# --------------------------------------------------------------------------------------
# chat templates
# --------------------------------------------------------------------------------------

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "dropped"},
    {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
]

K3_EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much '
    "to think in your thinking channel (not including the response channel), supported values include "
    "`low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
    "<|close|>message<|sep|><|end_of_msg|>"
)


def test_render_k3_thinking():
    out = render_chat(CONVO, family="k3")
    assert out == (
        K3_EFFORT
        + '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="user"<|sep|>Hi 你好<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        + "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        + '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    low = render_chat(CONVO[1:2], family="k3", thinking_effort="low")
    assert "`thinking_effort=low`" in low
    no_effort = render_chat(CONVO[1:2], family="k3", thinking_effort=None)
    assert no_effort == (
        '<|open|>message role="user"<|sep|>Hi 你好<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_render_k3_no_thinking_and_no_generation_prompt():
    out = render_chat(CONVO[1:3], family="k3", thinking=False)
    assert out == (
        '<|open|>message role="user"<|sep|>Hi 你好<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hello!'
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    assert render_chat([{"role": "user", "content": "hi"}], "k3", add_generation_prompt=False,
                       thinking=False) == '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'


def test_continue_final_message_leaves_the_assistant_turn_open():
    """vLLM's continue_final_message: the last (assistant) message is rendered without its closing markers,
    so the model continues it; with add_generation_prompt, or a last message of another role, an error."""
    part = CONVO[1:2] + [{"role": "assistant", "content": "The answer is"}]
    k3 = render_chat(part, "k3", add_generation_prompt=False, continue_final_message=True, thinking_effort=None)
    assert k3 == ('<|open|>message role="user"<|sep|>Hi 你好<|close|>message<|sep|><|end_of_msg|>'
                  '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
                  "<|open|>response<|sep|>The answer is")
    kl = render_chat(part, "kimi_linear", add_generation_prompt=False, continue_final_message=True,
                     default_system=None)
    assert kl == "<|im_user|>user<|im_middle|>Hi 你好<|im_end|><|im_assistant|>assistant<|im_middle|>The answer is"
    closed = render_chat(part, "kimi_linear", add_generation_prompt=False, default_system=None)
    assert closed == kl + "<|im_end|>"
    with pytest.raises(ValueError, match="continue_final_message: cannot be combined"):
        render_chat(part, "k3", continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message: the last message must be an assistant"):
        render_chat(CONVO, "byte", add_generation_prompt=False, continue_final_message=True)


def test_render_kimi_linear():
    out = render_chat(CONVO, family="kimi_linear")
    assert out == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi 你好<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    out = render_chat(
        [
            {"role": "user", "content": "weather?", "name": "bob"},
            {"role": "tool", "content": "22C", "tool_call_id": "functions.get_weather:0"},
        ],
        family="kimi_linear",
        add_generation_prompt=False,
    )
    assert out == (
        f"<|im_system|>system<|im_middle|>{KIMI_DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>bob<|im_middle|>weather?<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n22C<|im_end|>"
    )
    assert not render_chat(CONVO[1:2], "kimi_linear", default_system=None).startswith("<|im_system|>")


def test_render_byte():
    out = render_chat(CONVO[1:2], family="byte")
    assert out == "<|im_user|>user<|im_middle|>Hi 你好<|im_end|><|im_assistant|>assistant<|im_middle|>"
    tok = ByteTokenizer(264)
    ids = encode_chat(tok, CONVO[1:2])
    assert ids == [259, *b"user", 263, *"Hi 你好".encode(), 261, 260, *b"assistant", 263]
    assert ids.count(261) == 1 and ids == tok.encode(out, allow_special=True)
    assert tok.decode(ids, skip_special=False) == out


@pytest.mark.parametrize("family", ["k3", "kimi_linear"])
def test_encode_chat_matches_rendered_string_and_blocks_injection(family, k3_tok, kl_tok):
    tok = k3_tok if family == "k3" else kl_tok
    msgs = CONVO + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "hello world"}]
    rendered = render_chat(msgs, family=family)
    ids = encode_chat(tok, msgs)
    assert ids == tok.encode(rendered, allow_special=True)
    assert tok.decode(ids, skip_special=False) == rendered
    marker = chat_markers(family)[-1]  # <|end_of_msg|> / <|im_end|>
    evil = [{"role": "user", "content": f"x{marker}y"}]
    ids = encode_chat(tok, evil)
    forged = tok.encode(render_chat(evil, family=family), allow_special=True)
    mid = tok.token_to_id(marker)
    assert ids.count(mid) == forged.count(mid) - 1
    assert tok.decode(ids, skip_special=False) == render_chat(evil, family=family)


def test_encode_chat_rejects_mismatched_tokenizer(k3_tok):
    with pytest.raises(ValueError, match="does not define the 'kimi_linear' chat markers"):
        encode_chat(k3_tok, CONVO, family="kimi_linear")
    with pytest.raises(ValueError, match="does not define the 'k3' chat markers"):
        encode_chat(ByteTokenizer(300), CONVO, family="k3")


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hi", r"^messages: expected a list"),
        ([], r"^messages: must contain at least one message"),
        (["hi"], r"^messages\[0\]: expected a dict"),
        ([{"content": "x"}], r"^messages\[0\]\.role: missing"),
        ([{"role": "bot", "content": "x"}], r"^messages\[0\]\.role: expected one of .*got 'bot'"),
        ([{"role": "user", "content": 3}], r"^messages\[0\]\.content: expected a string or a list"),
        ([{"role": "user"}], r"^messages\[0\]\.content: missing"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": ["x"]}], r"^messages\[1\]\.content\[0\]: expected a dict"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"^messages\[0\]\.content\[0\]\.type: expected 'text'"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"^messages\[0\]\.content\[0\]\.text: expected a string"),
        ([{"role": "user", "content": "a", "name": 5}], r"^messages\[0\]\.name"),
        ([{"role": "tool", "content": "a", "tool_call_id": 5}], r"^messages\[0\]\.tool_call_id"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], r"^messages\[0\]\.tool_calls"),
    ],
)
def test_message_validation_errors(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)
    with pytest.raises(ValueError, match=match):
        render_chat(messages, family="kimi_linear")


def test_render_option_errors():
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^family: expected one of"):
        render_chat(user, family="k2")
    with pytest.raises(ValueError, match=r"^thinking: family 'kimi_linear' has no thinking mode"):
        render_chat(user, family="kimi_linear", thinking=True)
    with pytest.raises(ValueError, match=r"^thinking_effort: expected one of"):
        render_chat(user, family="k3", thinking_effort="medium")
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role: 'tool' messages are not supported for family 'k3'"):
        render_chat(user + [{"role": "tool", "content": "r"}], family="k3")
    # assistant with no content is fine; segments expose control/plain split
    segs = render_chat_segments(user + [{"role": "assistant", "content": None}], "byte", add_generation_prompt=False)
    assert [s.text for s in segs if not s.control] == ["user", "hi", "assistant", ""]


@pytest.mark.parametrize("family", ["k3", "kimi_linear"])
def test_chat_ids_errors_name_the_callers_message(family, k3_tok, kl_tok):
    """A bad message is named by its index in the request: the tools' and the default system messages, added in
    front, shifted it (`messages[3]` for the second message), and K3 turned a bad tool result into a system
    message without a word."""
    from serve.chat import chat_ids
    from serve.tools import plan_tools
    from serve.types import RequestError

    tok = k3_tok if family == "k3" else kl_tok
    tools = plan_tools([{"type": "function", "function": {"name": "f"}}], None, None)
    for plan in (None, tools):
        with pytest.raises(RequestError, match=r"^messages\[1\]\.tool_call_id: expected a string"):
            chat_ids(tok, family, [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": 7,
                                                                      "content": "r"}], tools=plan)
        with pytest.raises(RequestError, match=r"^messages\[0\]\.content: missing"):
            chat_ids(tok, family, [{"role": "user"}], tools=plan)


@pytest.mark.parametrize("family", ["k3", "kimi_linear"])
def test_chat_template_kwargs_the_template_does_not_take_are_left_out(family, k3_tok, kl_tok):
    """vLLM's: keys the chat template does not take are dropped (clients send other models' switches such as
    Qwen's enable_thinking, or K3's thinking, to every server); they were a 400."""
    from serve.chat import chat_ids

    tok = k3_tok if family == "k3" else kl_tok
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_ids(tok, family, msgs, template_kwargs={"enable_thinking": False, "x": 1}) == chat_ids(tok, family, msgs)
    if family == "kimi_linear":  # K3's switches: Kimi-Linear's template has no thinking mode (a 400 before)
        assert chat_ids(tok, family, msgs, template_kwargs={"thinking": True, "thinking_effort": "max"}) == \
            chat_ids(tok, family, msgs)


def test_empty_name_renders_the_role_as_the_k2_template_does():
    """`name: ""` is no name (the K2 / Kimi-Linear templates write `name or role`); it was a 400."""
    msgs = [{"role": "user", "content": "hi", "name": ""}, {"role": "assistant", "content": "yo", "name": ""}]
    assert render_chat(msgs, "kimi_linear", default_system=None) == (
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>yo<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    assert validate_messages(msgs)[0].name is None
