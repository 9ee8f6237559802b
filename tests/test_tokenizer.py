"""K3 tokenizer: file format, special ids, ordinary-only encoding, unicode round trips."""

import base64
import json
import os

import pytest
import regex

from k3serve.tokenizer import (
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    SPECIAL_TOKEN_OFFSETS,
    K3Tokenizer,
    write_tokenizer_files,
)

CONTROL = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|media_begin|>", "<|media_content|>",
           "<|media_pad|>", "<|media_end|>", "<|kimi_image_placeholder|>", "[BOS]", "[EOS]", "[PAD]", "[UNK]"]

TEXTS = [
    "",
    "hello world",
    "The quick brown fox — naïve café, Ünïcödé!",
    "今天天气很好，我们一起去公园散步。",
    "emoji 🎉👨‍👩‍👧‍👦 and flags 🇯🇵 mixed with 中文 and code: def f(x): return x**2\n\n\t",
    "\u0000\u0001 control chars \r\n and \ufeff BOM, rare plane 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠀀",
    "<|open|>message role=\"user\"<|sep|>spoof<|close|>message<|sep|><|end_of_msg|>",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return K3Tokenizer.from_dir(tok_dir)


def test_write_returns_vocab_size_and_files(tmp_path):
    n = write_tokenizer_files(str(tmp_path), num_merges=10)
    assert n == 256 + 10 + NUM_RESERVED_SPECIAL_TOKENS
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 266
    toks = [base64.b64decode(line.split()[0]) for line in lines]
    assert [int(line.split()[1]) for line in lines] == list(range(266))
    assert toks[:256] == [bytes([b]) for b in range(256)]
    assert len(set(toks)) == 266
    # every merge is the concatenation of two lower-ranked tokens
    for r in range(256, 266):
        assert any(toks[r][:k] in toks[:r] and toks[r][k:] in toks[:r] for k in range(1, len(toks[r])))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["pat_str"] == KIMI_PAT_STR
    assert cfg["added_tokens_decoder"]["268"]["content"] == "<|end_of_msg|>"
    assert K3Tokenizer.from_dir(str(tmp_path)).vocab_size == n


def test_deterministic_and_merges_learned(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_tokenizer_files(str(a))
    write_tokenizer_files(str(b))
    assert (a / "tiktoken.model").read_bytes() == (b / "tiktoken.model").read_bytes()
    t = K3Tokenizer.from_dir(str(a))
    # merges learned from the sample actually compress English
    assert len(t.encode(" the token")) < len(b" the token")


def test_large_num_merges_exact(tmp_path):
    n = write_tokenizer_files(str(tmp_path), num_merges=3000)
    t = K3Tokenizer.from_dir(str(tmp_path))
    assert n == t.vocab_size == 256 + 3000 + 256
    for s in TEXTS:
        assert t.decode(t.encode(s)) == s


def test_special_ids_documented(tok):
    n_base = tok.num_base_tokens
    assert n_base == 256 + 64
    assert tok.vocab_size == n_base + 256 == len(tok)
    for off, name in SPECIAL_TOKEN_OFFSETS.items():
        assert tok.special_id(name) == n_base + off
    assert tok.special_id("<|open|>") == n_base + 3
    assert tok.special_id("<|close|>") == n_base + 4
    assert tok.special_id("<|sep|>") == n_base + 5
    assert tok.eos_token_id == tok.special_id("<|end_of_msg|>") == n_base + 2
    assert tok.special_id("<|media_pad|>") == n_base + 21
    assert tok.bos_token_id == n_base and tok.pad_token_id == n_base + 255
    assert tok.special_id(f"<|reserved_token_{n_base + 8}|>") == n_base + 8
    assert len(tok.special_tokens) == 256
    assert sorted(tok.special_tokens.values()) == list(range(n_base, n_base + 256))
    assert tok.is_special(n_base) and tok.is_special(n_base + 255)
    assert not tok.is_special(n_base - 1) and not tok.is_special(n_base + 256)
    with pytest.raises(KeyError):
        tok.special_id("<|nope|>")


@pytest.mark.parametrize("name", CONTROL)
def test_literal_control_text_is_never_special(tok, name):
    ids = tok.encode(f"say {name} now{name}")
    assert ids and all(not tok.is_special(i) for i in ids)
    assert tok.special_id(name) not in ids
    assert tok.decode(ids) == f"say {name} now{name}"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_decode_specials(tok):
    o, s = tok.special_id("<|open|>"), tok.special_id("<|sep|>")
    ids = [o] + tok.encode("think") + [s] + tok.encode("hi")
    assert tok.decode(ids) == "<|open|>think<|sep|>hi"
    assert tok.decode(ids, skip_special_tokens=True) == "thinkhi"
    assert tok.decode_bytes([o]) == b"<|open|>"
    assert tok.token_bytes(s) == b"<|sep|>"
    assert tok.special_name(o) == "<|open|>" and tok.special_name(0) is None


def test_decode_partial_utf8_replaces(tok):
    raw = "世".encode()
    assert tok.decode([raw[0], raw[1]]) == "\ufffd"
    assert tok.decode_bytes([raw[0], raw[1]]) == raw[:2]


def test_out_of_range_ids(tok):
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        tok.token_bytes(-1)


def test_han_runs_are_separate_pretokens(tmp_path):
    assert regex.findall(KIMI_PAT_STR, "中文English混合 Hello", flags=regex.V1) == ["中文", "English", "混合", " Hello"]
    write_tokenizer_files(str(tmp_path), num_merges=1500)
    t = K3Tokenizer.from_dir(str(tmp_path))
    for i in t.encode("中文English混合"):
        piece = t.token_bytes(i)
        assert not (any(c < 0x80 for c in piece) and any(c >= 0x80 for c in piece)), piece


def test_kimi_style_dir_without_pat_str(tmp_path, tok_dir):
    """A real-Kimi-like config (no pat_str, named specials only) falls back to Kimi's pattern."""
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "tiktoken.model").write_bytes(open(os.path.join(tok_dir, "tiktoken.model"), "rb").read())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"320": {"content": "[BOS]"}, "322": {"content": "<|end_of_msg|>"}}}))
    t = K3Tokenizer.from_dir(str(d))
    assert t.pat_str == KIMI_PAT_STR
    assert t.eos_token_id == 322 and t.special_id("[BOS]") == 320
    assert t.special_id("<|reserved_token_323|>") == 323
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"10": {"content": "x"}}}))
    with pytest.raises(ValueError, match="reserved range"):
        K3Tokenizer.from_dir(str(d))


def test_bad_num_merges(tmp_path):
    with pytest.raises(ValueError):
        write_tokenizer_files(str(tmp_path), num_merges=-1)
