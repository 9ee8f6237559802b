"""Token-level reasoning helpers: reasoning-end detection and reasoning-token counts."""

import pytest

from k3serve.chat.reasoning import count_reasoning_tokens, is_reasoning_end, marker_ids
from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer_files(d)
    return K3Tokenizer.from_dir(d)


def test_marker_ids(tok):
    ids = marker_ids(tok, "close", "think")
    assert tok.decode(ids) == "<|close|>think<|sep|>"
    assert ids[0] == tok.special_id("<|close|>") and ids[-1] == tok.special_id("<|sep|>")


def test_is_reasoning_end(tok):
    o, c = marker_ids(tok, "open", "think"), marker_ids(tok, "close", "think")
    r = tok.encode("reasoning")
    assert not is_reasoning_end(tok, o + r)
    assert is_reasoning_end(tok, o + r + c + tok.encode("answer"))
    assert not is_reasoning_end(tok, o + r + c + o + r)  # a later turn opened think again
    assert not is_reasoning_end(tok, r)


def test_count_reasoning_tokens(tok):
    o, c = marker_ids(tok, "open", "think"), marker_ids(tok, "close", "think")
    resp = marker_ids(tok, "open", "response")
    r, a = tok.encode("some careful reasoning"), tok.encode("answer")
    assert count_reasoning_tokens(tok, r + c + resp + a, True) == len(r)
    assert count_reasoning_tokens(tok, o + r + c + a, True) == len(r)
    assert count_reasoning_tokens(tok, r + resp + a, True) == len(r)
    assert count_reasoning_tokens(tok, resp + a, True) == 0
    assert count_reasoning_tokens(tok, r, True) == len(r)
    assert count_reasoning_tokens(tok, r + c + a, False) == 0
