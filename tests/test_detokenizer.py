"""Incremental detokenizer: UTF-8 safety, stop strings across token boundaries, flush."""

import random

import pytest

from k3serve.detokenizer import IncrementalDetokenizer
from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer_files(d)
    return K3Tokenizer.from_dir(d)


def byte_ids(text: str) -> list[int]:
    """Ranks 0..255 are the single bytes, so each UTF-8 byte is its own token."""
    return list(text.encode("utf-8"))


def run(detok, ids, step=1):
    deltas = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas


def test_multibyte_split_across_tokens(tok):
    text = "a世🎉b"
    d = IncrementalDetokenizer(tok)
    deltas = run(d, byte_ids(text))
    # 'a' | 3 bytes of 世 | 4 bytes of 🎉 | 'b'
    assert deltas == ["a", "", "", "世", "", "", "", "🎉", "b"]
    assert "".join(deltas) == d.text == text
    assert d.flush() == "" and d.stopped_by is None


def test_incomplete_tail_flushed_as_replacement(tok):
    d = IncrementalDetokenizer(tok)
    raw = "世".encode()
    assert d.push([ord("x"), raw[0], raw[1]]) == "x"
    assert d.flush() == "\ufffd"
    assert d.text == "x\ufffd" == tok.decode([ord("x"), raw[0], raw[1]])
    assert d.push([ord("y")]) == ""  # finished


def test_invalid_bytes_match_one_shot_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
        d = IncrementalDetokenizer(tok)
        out = "".join(run(d, ids, step=rng.randrange(1, 4))) + d.flush()
        assert out == bytes(ids).decode("utf-8", errors="replace")


def test_stop_string_split_across_tokens(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = run(d, byte_ids("abST"))
    assert deltas == ["a", "b", "", ""]  # "S", "ST" held back
    assert d.push(byte_ids("O")) == ""
    assert d.push(byte_ids("Pxyz")) == ""
    assert d.stopped_by == "STOP" and d.text == "ab"
    assert d.push(byte_ids("more")) == "" and d.flush() == "" and d.text == "ab"


def test_false_stop_prefix_released(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    assert run(d, byte_ids("STO")) == ["", "", ""]
    assert d.push(byte_ids("X")) == "STOX"
    assert d.stopped_by is None


def test_include_stop_str(tok):
    d = IncrementalDetokenizer(tok, stop=["</end>"], include_stop_str_in_output=True)
    out = "".join(run(d, tok.encode("hello </end> tail"), step=2))
    assert out == d.text == "hello </end>"
    assert d.stopped_by == "</end>"


def test_multibyte_stop_string(tok):
    d = IncrementalDetokenizer(tok, stop=["。"])
    out = "".join(run(d, byte_ids("你好。再见")))
    assert out == d.text == "你好" and d.stopped_by == "。"


def test_flush_releases_held_prefix(tok):
    d = IncrementalDetokenizer(tok, stop=["\n\n"])
    assert d.push(byte_ids("line\n")) == "line"
    assert d.flush() == "\n" and d.text == "line\n" and d.stopped_by is None


def test_earliest_completed_stop_wins(tok):
    d = IncrementalDetokenizer(tok, stop=["abc", "b"])
    d.push(byte_ids("xabc"))  # in one push: "b" completes before "abc"
    assert d.stopped_by == "b" and d.text == "xa"
    d = IncrementalDetokenizer(tok, stop=["b", "ab"])
    d.push(byte_ids("xab"))  # same end: the longer one
    assert d.stopped_by == "ab" and d.text == "x"


def test_special_tokens(tok):
    o, s = tok.special_id("<|open|>"), tok.special_id("<|sep|>")
    ids = [o] + tok.encode("think") + [s] + tok.encode("hi")
    d = IncrementalDetokenizer(tok)
    assert "".join(run(d, ids)) == "thinkhi"
    d = IncrementalDetokenizer(tok, skip_special_tokens=False, stop=["<|sep|>"])
    assert "".join(run(d, ids)) == "<|open|>think" and d.stopped_by == "<|sep|>"


def test_randomized_against_reference(tok):
    rng = random.Random(1)
    alphabet = "ab世🎉 <|>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))]
        incl = rng.random() < 0.5
        ids = tok.encode(text) if rng.random() < 0.5 else byte_ids(text)
        # reference: earliest completed stop (ties: longer)
        best = None
        for st in stops:
            i = text.find(st)
            if i >= 0 and (best is None or (i + len(st), -len(st)) < (best[0] + len(best[1]), -len(best[1]))):
                best = (i, st)
        expected = text if best is None else text[: best[0] + (len(best[1]) if incl else 0)]
        d = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=incl)
        emitted = ""
        step = rng.randrange(1, 4)
        for i in range(0, len(ids), step):
            emitted += d.push(ids[i:i + step])
            assert expected.startswith(emitted)  # never emits text that must not be shown
            assert "\ufffd" not in emitted
        emitted += d.flush()
        assert emitted == d.text == expected, (text, stops)
        assert d.stopped_by == (best[1] if best else None)


def test_bad_stop():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(None, stop=[""])
