"""Tests for serve.stop_checker: incremental detokenization, stop ids, stop strings, hold-back."""

from __future__ import annotations

import random

import pytest

from k3jax.tokenizer import BYTE_EOS, BYTE_IM_END, BYTE_IM_USER, BYTE_PAD, ByteTokenizer
from serve.stop_checker import StepResult, StopChecker
from serve.types import SamplingParams

TOK = ByteTokenizer(320)
EOS = TOK.eos_token_ids  # (257, 261)


def checker(max_tokens=1000, tokenizer=TOK, **kw) -> StopChecker:
    return StopChecker(SamplingParams(**kw), tokenizer, EOS, max_tokens)


def ids_of(text: str) -> list[int]:
    return TOK.encode(text)


def feed(chk: StopChecker, ids, chunks=None) -> list[StepResult]:
    """Append ids one by one until finished; check the delta/text invariant on the way."""
    out = []
    for t in ids:
        r = chk.append(t)
        out.append(r)
        assert chk.text == "".join(x.text_delta for x in out)
        if r.finished:
            break
    return out


def deltas(results) -> str:
    return "".join(r.text_delta for r in results)


# ------------------------------------------------------------------------------------------
# plain decoding
# ------------------------------------------------------------------------------------------


def test_no_stop_conditions_streams_every_byte():
    chk = checker()
    res = feed(chk, ids_of("hello, world"))
    assert [r.text_delta for r in res] == list("hello, world")
    assert not any(r.finished for r in res)
    assert chk.text == "hello, world" and chk.token_ids == ids_of("hello, world")
    assert chk.finish_reason is None and chk.stop_reason is None


def test_multibyte_characters_are_never_split():
    text = "a€b😀c"
    chk = checker()
    res = feed(chk, ids_of(text))
    pieces = [r.text_delta for r in res]
    assert "".join(pieces) == text
    assert pieces[1:4] == ["", "", "€"]  # three bytes, emitted once complete
    assert all("\ufffd" not in p for p in pieces)


def test_max_tokens_finishes_with_length():
    chk = checker(max_tokens=5)
    res = feed(chk, ids_of("abcdefgh"))
    assert len(res) == 5
    assert res[-1] == StepResult("e", True, "length", None)
    assert chk.text == "abcde" and chk.finished and chk.finish_reason == "length"
    with pytest.raises(RuntimeError):
        chk.append(ord("f"))


def test_length_flushes_a_partial_character():
    chk = checker(max_tokens=2)
    res = feed(chk, ids_of("a€"))
    assert res[-1].finish_reason == "length"
    assert chk.text == TOK.decode(ids_of("a€")[:2]) == "a\ufffd"


def test_special_tokens_skipped_or_rendered():
    ids = [ord("a"), BYTE_PAD, ord("b")]
    assert deltas(feed(checker(), ids)) == "ab"
    assert deltas(feed(checker(skip_special_tokens=False), ids)) == "a<|pad|>b"


# ------------------------------------------------------------------------------------------
# stop token ids and eos
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos", EOS)
def test_eos_stops_and_is_not_rendered(eos):
    chk = checker(skip_special_tokens=False)
    res = feed(chk, ids_of("hi") + [eos] + ids_of("more"))
    assert len(res) == 3
    assert res[-1] == StepResult("", True, "stop", eos)
    assert chk.token_ids == ids_of("hi") + [eos]
    assert chk.text == "hi"


def test_ignore_eos_keeps_going():
    chk = checker(ignore_eos=True, max_tokens=6)
    res = feed(chk, ids_of("hi") + [BYTE_EOS, BYTE_IM_END] + ids_of("there"))
    assert len(res) == 6 and res[-1].finish_reason == "length"
    assert chk.text == "hith"  # eos ids are specials: dropped by skip_special_tokens
    assert chk.token_ids[2:4] == [BYTE_EOS, BYTE_IM_END]


def test_stop_token_ids_apply_even_with_ignore_eos():
    chk = checker(ignore_eos=True, stop_token_ids=[ord("x")])
    res = feed(chk, ids_of("abxcd"))
    assert res[-1] == StepResult("", True, "stop", ord("x"))
    assert chk.text == "ab" and chk.token_ids == ids_of("abx")


def test_stop_token_with_include_stop_str_is_rendered():
    chk = checker(stop_token_ids=[ord("x")], include_stop_str_in_output=True)
    feed(chk, ids_of("abxcd"))
    assert chk.text == "abx" and chk.stop_reason == ord("x")


def test_stop_token_on_the_last_allowed_token_is_a_stop():
    chk = checker(max_tokens=3)
    res = feed(chk, ids_of("ab") + [BYTE_EOS])
    assert res[-1] == StepResult("", True, "stop", BYTE_EOS)


def test_stop_token_flushes_partial_character():
    chk = checker()
    feed(chk, ids_of("a€")[:2] + [BYTE_EOS])
    assert chk.text == "a\ufffd" and chk.finish_reason == "stop"


def test_without_tokenizer_only_id_rules_apply():
    chk = checker(tokenizer=None, stop=["b"], stop_token_ids=[ord("z")])
    res = feed(chk, ids_of("abc"))
    assert [r.text_delta for r in res] == ["", "", ""] and not chk.finished
    assert chk.append(ord("z")) == StepResult("", True, "stop", ord("z"))
    assert chk.text == ""
    chk = checker(tokenizer=None, max_tokens=2)
    assert feed(chk, [1, 2, 3])[-1] == StepResult("", True, "length", None)
    chk = checker(tokenizer=None)
    assert feed(chk, [1, BYTE_IM_END, 3])[-1] == StepResult("", True, "stop", BYTE_IM_END)


# ------------------------------------------------------------------------------------------
# stop strings
# ------------------------------------------------------------------------------------------


def test_stop_string_inside_one_token():
    # a special token rendered as text (skip_special_tokens=False) is one token holding many chars
    chk = checker(stop=["im_u"], skip_special_tokens=False)
    res = feed(chk, ids_of("ok") + [BYTE_IM_USER] + ids_of("zz"))
    assert res[-1] == StepResult("<|", True, "stop", "im_u")
    assert chk.text == "ok<|" and chk.token_ids == ids_of("ok") + [BYTE_IM_USER]


def test_stop_string_inside_one_token_include():
    chk = checker(stop=["im_u"], skip_special_tokens=False, include_stop_str_in_output=True)
    feed(chk, ids_of("ok") + [BYTE_IM_USER])
    assert chk.text == "ok<|im_u"  # the rest of the token ("ser|>") is discarded
    assert chk.stop_reason == "im_u"


def test_stop_string_across_tokens():
    chk = checker(stop=["STOP"])
    res = feed(chk, ids_of("go STOP now"))
    assert len(res) == len("go STOP")
    assert [r.text_delta for r in res] == ["g", "o", " ", "", "", "", ""]
    assert res[-1] == StepResult("", True, "stop", "STOP")
    assert chk.text == "go "


def test_stop_string_across_tokens_include():
    chk = checker(stop=["STOP"], include_stop_str_in_output=True)
    res = feed(chk, ids_of("go STOP now"))
    assert res[-1] == StepResult("STOP", True, "stop", "STOP")
    assert chk.text == "go STOP"


def test_stop_string_across_a_multibyte_character():
    # the stop string ends in the middle of the bytes of "€" and of "😀"
    for stop in ("x€", "€y", "😀"):
        chk = checker(stop=[stop])
        feed(chk, ids_of("ab x€y 😀 tail"))
        expect = "ab x€y 😀 tail".split(stop)[0]
        assert chk.text == expect, stop
        assert chk.stop_reason == stop and chk.finish_reason == "stop"


def test_stop_string_matches_decoded_text_not_bytes():
    # "€" is e2 82 ac; a stop string of the char whose UTF-8 is a byte-suffix must not fire early
    chk = checker(stop=["\u00ac"])  # "¬" = c2 ac
    feed(chk, ids_of("€ ok"))
    assert not chk.finished and chk.text == "€ ok"


def test_held_back_prefix_is_emitted_when_it_does_not_become_a_stop():
    chk = checker(stop=["STOP"])
    res = feed(chk, ids_of("a STOq"))
    assert [r.text_delta for r in res] == ["a", " ", "", "", "", "STOq"]
    assert not chk.finished and chk.text == "a STOq"
    # partial overlap: "SSTOP" -> the first S is released when the second one arrives
    chk = checker(stop=["STOP"])
    res = feed(chk, ids_of("SSTOP"))
    assert [r.text_delta for r in res] == ["", "S", "", "", ""]
    assert chk.text == "S" and chk.stop_reason == "STOP"


def test_held_back_prefix_flushed_at_length():
    chk = checker(stop=["STOP"], max_tokens=4)
    res = feed(chk, ids_of("abST"))
    assert [r.text_delta for r in res] == ["a", "b", "", "ST"]
    assert res[-1].finish_reason == "length" and chk.text == "abST"


def test_held_back_prefix_flushed_at_eos():
    chk = checker(stop=["STOP"])
    res = feed(chk, ids_of("abST") + [BYTE_EOS])
    assert res[-1] == StepResult("ST", True, "stop", BYTE_EOS)
    assert chk.text == "abST"


def test_stop_string_on_the_last_allowed_token_is_a_stop():
    chk = checker(stop=["cd"], max_tokens=4)
    res = feed(chk, ids_of("abcd"))
    assert res[-1] == StepResult("", True, "stop", "cd")
    assert chk.text == "ab"


def test_several_stop_strings_first_to_complete_wins():
    # "bc" completes before "abcd" in the character stream, whatever the chunking
    chk = checker(stop=["abcd", "bc"], skip_special_tokens=False)
    feed(chk, ids_of("xabcdy"))
    assert chk.stop_reason == "bc" and chk.text == "xa"
    # same completion point: the one starting first wins
    chk = checker(stop=["c", "bc"])
    feed(chk, ids_of("xabcdy"))
    assert chk.stop_reason == "bc" and chk.text == "xa"


def test_min_tokens_ignores_stop_strings_ending_in_the_first_tokens():
    # vLLM's rule: a stop string counts only when it ends in the text of a token after the first min_tokens
    chk = checker(stop=["a"], min_tokens=1)
    res = feed(chk, ids_of("aba"))
    assert res[0] == StepResult("a", False)  # the first token is "a": no stop (nor an empty output)
    assert chk.stop_reason == "a" and chk.text == "ab" and len(chk.token_ids) == 3
    chk = checker(stop=["ab"], min_tokens=2)  # may start in them: "ab" ends in the third token
    feed(chk, ids_of("xab"))
    assert chk.stop_reason == "ab" and chk.text == "x"
    chk = checker(stop=["ab"], min_tokens=3)
    res = feed(chk, ids_of("xabc"))
    assert not chk.finished and deltas(res) == "xabc"
    # a stop token counts from the min_tokens-th token on (the sampler bans it before)
    chk = checker(min_tokens=2)
    feed(chk, ids_of("x") + [EOS[0]])
    assert chk.finish_reason == "stop" and chk.stop_reason == EOS[0] and chk.text == "x"
    # the ban holds the stop ids and EOS, with ignore_eos too (vLLM's all_stop_token_ids), though EOS then never stops
    assert set(checker(min_tokens=2, stop_token_ids=[7]).min_tokens_ban()) == {7, *EOS}
    chk = checker(min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    assert set(chk.min_tokens_ban()) == {7, *EOS}
    feed(chk, [EOS[0]] * 3)
    assert not chk.finished


def test_abort_flushes_the_held_back_text_and_a_partial_character():
    """An abort hands out what was held back as a possible stop string (and a dangling partial character, as any
    finish renders it): vLLM's final abort output carries all the text decoded so far; it was dropped."""
    chk = checker(stop=["STOP"])
    res = feed(chk, ids_of("xST") + [0xE4])  # "ST" held back, then the first byte of a 3-byte character
    assert chk.text == "x" and chk.held_text == "ST"
    r = chk.abort()
    assert r == StepResult("ST\ufffd", True, "abort", None)
    assert deltas(res) + r.text_delta == chk.text == TOK.decode(ids_of("xST") + [0xE4])
    assert chk.abort() == StepResult("", True, "abort", None)  # (once)
    chk = checker(tokenizer=None, stop_token_ids=[7])
    feed(chk, [1, 2])
    assert chk.abort() == StepResult("", True, "abort", None) and chk.text == ""


def test_stop_at_the_very_start():
    chk = checker(stop=["ab"])
    res = feed(chk, ids_of("abc"))
    assert res[-1] == StepResult("", True, "stop", "ab") and chk.text == ""


def test_text_never_contains_a_stop_string_random():
    rng = random.Random(0)
    alphabet = "ab€ "
    for trial in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        include = rng.random() < 0.5
        max_tokens = rng.randint(1, 40)
        ids = ids_of(text)
        chk = checker(stop=stops, include_stop_str_in_output=include, max_tokens=max_tokens)
        res = feed(chk, ids)
        full = TOK.decode(ids[: len(res)])
        # reference: the earliest-ending occurrence of any stop string in the decoded text
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        if chk.finish_reason == "stop":
            end, start, s = min(hits)
            assert chk.stop_reason == s
            assert chk.text == (full[:end] if include else full[:start])
        else:
            assert not hits, (stops, text)
            if chk.finished:
                assert chk.finish_reason == "length" and chk.text == full
            else:
                # running: everything except a held-back stop prefix has been emitted
                assert full.startswith(chk.text)
                held = full[len(chk.text):]
                assert held == chk.held_text
                assert not held or any(s.startswith(held) for s in stops)
        assert deltas(res) == chk.text


def test_deltas_concatenate_to_final_text_with_everything():
    text = "Grüße, 世界! STOP? no: S T O P... STOP here"
    chk = checker(stop=["STOP here", "END"], max_tokens=200)
    res = feed(chk, ids_of(text) + [BYTE_EOS])
    assert deltas(res) == chk.text == "Grüße, 世界! STOP? no: S T O P... "
    assert chk.stop_reason == "STOP here"


def test_any_number_of_stop_strings_offline_and_the_server_bound():
    """`SamplingParams.validate` refused more than 128 stop strings everywhere, the Python API too (vLLM's
    SamplingParams takes any number); the bound is the HTTP server's (`max_stop`). With thousands of strings
    the checker (indexed by length, and sorted for the held-back prefix) stops, holds back and names the
    string exactly as with only the strings that matter."""
    from serve.types import MAX_STOP, RequestError

    rng = random.Random(3)
    decoys = sorted({"".join(rng.choice("xyzé") for _ in range(rng.randint(1, 9))) + "q" for _ in range(20000)})
    SamplingParams(stop=decoys).validate(320)
    with pytest.raises(RequestError, match=f"stop: at most {MAX_STOP} stop strings, got {len(decoys)}"):
        SamplingParams(stop=decoys).validate(320, max_stop=MAX_STOP)
    for text, few in (("abc STOP here", ["STOP", "OP h"]), ("abc ST", ["STOP"]), ("a xy", ["xyzzy", "y"])):
        for include in (False, True):
            want = checker(stop=few, include_stop_str_in_output=include)
            got = checker(stop=decoys + few, include_stop_str_in_output=include)
            assert feed(got, ids_of(text)) == feed(want, ids_of(text)), (text, few)
            assert (got.text, got.held_text, got.stop_reason) == (want.text, want.held_text, want.stop_reason)
    text = "ab xyzé"  # held back: the longest suffix that begins a longer string
    longest = max(n for n in range(len(text)) if any(s.startswith(text[len(text) - n:]) and len(s) > n for s in decoys))
    chk = checker(stop=decoys)
    feed(chk, ids_of(text))
    assert longest > 1 and (chk.text, chk.held_text) == (text[:-longest], text[-longest:])
