"""Tokenizer vs llama.cpp: ids for every corpus string (tests/data/tokenizer_reference.json, written by
scripts/make_tokenizer_reference.py with llama.cpp's llama-tokenize), pieces, round trips, streaming decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_tokenizer import load_corpus, load_metadata, load_reference
from ninfer.errors import TokenizerError
from ninfer.tokenizer import IncrementalDecoder, Tokenizer

MODELS = ["smollm2", "qwen05", "qwen15", "gemma3"]
# the optional (larger) models are marked `large`, like the rest of the suite
PARAMS = [key if key == "smollm2" else pytest.param(key, marks=pytest.mark.large) for key in MODELS]
_cache: dict[Path, Tokenizer] = {}


@pytest.fixture(scope="module", params=PARAMS)
def model(request: pytest.FixtureRequest) -> tuple[Path, Tokenizer]:
    path: Path = request.getfixturevalue(f"{request.param}_path")  # skips when the optional model is absent
    if path not in _cache:
        _cache[path] = Tokenizer.from_metadata(load_metadata(path))
    return path, _cache[path]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Tokenizer:
    if smollm2_path not in _cache:
        _cache[smollm2_path] = Tokenizer.from_metadata(load_metadata(smollm2_path))
    return _cache[smollm2_path]


def _reference(path: Path) -> list[dict]:
    ref = load_reference().get(path.name)
    if ref is None:
        pytest.skip(f"no llama.cpp reference for {path.name}: run scripts/make_tokenizer_reference.py")
    return ref


def _mismatches(tok: Tokenizer, ref: list[dict], key: str, parse_special: bool) -> list[str]:
    bad = []
    for entry in ref:
        got = tok.encode(entry["text"], add_special=True, parse_special=parse_special)
        if got != entry[key]:
            bad.append(f"{entry['text']!r}: got {got}, llama.cpp {entry[key]}")
    return bad


def test_reference_covers_corpus(model: tuple[Path, Tokenizer]) -> None:
    path, _ = model
    assert [e["text"] for e in _reference(path)] == load_corpus(), "reference is stale: rerun the script"


def test_encode_matches_llama_cpp(model: tuple[Path, Tokenizer]) -> None:
    path, tok = model
    bad = _mismatches(tok, _reference(path), "ids", parse_special=True)
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)


def test_encode_no_parse_special_matches_llama_cpp(model: tuple[Path, Tokenizer]) -> None:
    path, tok = model
    bad = _mismatches(tok, _reference(path), "ids_no_special", parse_special=False)
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)


def test_pieces_match_llama_cpp(model: tuple[Path, Tokenizer]) -> None:
    path, tok = model
    for entry in _reference(path):
        got = [tok.token_to_piece(i).hex() for i in entry["ids"]]
        assert got == entry["pieces"], entry["text"]


def test_decode_round_trips(model: tuple[Path, Tokenizer]) -> None:
    # With llama.cpp's ids, the concatenated pieces give the text back for every corpus string (none of these
    # models cleans up spaces when detokenizing); with BOS, the BOS text comes first unless special tokens are skipped.
    path, tok = model
    for entry in _reference(path):
        text, ids = entry["text"], entry["ids"]
        prefix = tok.decode([tok.bos_id]) if tok.add_bos else ""
        assert tok.decode(ids) == prefix + text
        body = ids[1:] if tok.add_bos else ids
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(body, skip_special=True) == tok.decode(
            [i for i in body if not tok.is_control(i)]), text


def test_incremental_decoder_never_splits_characters(model: tuple[Path, Tokenizer]) -> None:
    _, tok = model
    for text in load_corpus() + ["🤗🚀 日本語 👨‍👩‍👧‍👦 مرحبا x̧̌ 🇫🇷"]:
        ids = tok.encode(text, add_special=False)
        dec = IncrementalDecoder(tok)
        chunks = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(chunks) == tok.decode(ids) == text
        assert all("\ufffd" not in c for c in chunks)
        # every chunk is whole characters: it survives a UTF-8 round trip on its own
        assert all(c.encode("utf-8").decode("utf-8") == c for c in chunks)


def test_incremental_decoder_holds_back_partial_utf8(smollm2: Tokenizer) -> None:
    # Byte-level BPE splits a 4-byte emoji over several tokens: nothing may come out until it is complete.
    ids = smollm2.encode("🤗", add_special=False)
    assert len(ids) > 1
    dec = smollm2.incremental_decoder()
    outs = [dec.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🤗"
    # an unfinished character at the end of the stream becomes U+FFFD on flush, exactly like decode()
    dec2 = smollm2.incremental_decoder()
    assert [dec2.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec2.flush() == smollm2.decode(ids[:-1]) == "\ufffd"


def test_special_tokens(smollm2: Tokenizer) -> None:
    im_start, im_end = smollm2.token_id("<|im_start|>"), smollm2.token_id("<|im_end|>")
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>", add_special=False)
    assert ids[0] == im_start and ids[-1] == im_end
    plain = smollm2.encode("<|im_start|>", add_special=False, parse_special=False)
    assert im_start not in plain and smollm2.decode(plain) == "<|im_start|>"
    assert smollm2.decode([im_start]) == "<|im_start|>" and smollm2.decode([im_start], skip_special=True) == ""
    assert smollm2.is_eog(im_end) and smollm2.is_eog(smollm2.token_id("<|endoftext|>"))
    assert not smollm2.is_eog(im_start) and not smollm2.is_eog(smollm2.encode("a", add_special=False)[0])
    assert smollm2.eos_id == im_end and smollm2.eot_id == im_end and smollm2.bos_id == im_start
    assert smollm2.add_bos is False and smollm2.vocab_size == 49152


@pytest.mark.large
def test_gemma_specials(gemma3_path: Path) -> None:
    tok = _cache.get(gemma3_path) or Tokenizer.from_metadata(load_metadata(gemma3_path))
    _cache[gemma3_path] = tok
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id == tok.token_id("<bos>")
    assert tok.encode("")== [tok.bos_id] and tok.encode("", add_special=False) == []
    eot = tok.token_id("<end_of_turn>")
    assert tok.eot_id == eot and tok.is_eog(eot) and tok.is_eog(tok.eos_id)


def test_out_of_range_ids(smollm2: Tokenizer) -> None:
    n = smollm2.vocab_size
    for bad in (n, n + 100, -1):
        with pytest.raises(TokenizerError, match=rf"{bad}.*{n}"):
            smollm2.decode([1, bad])
        with pytest.raises(TokenizerError, match=str(n)):
            smollm2.token_to_piece(bad)
    with pytest.raises(TokenizerError):
        smollm2.incremental_decoder().push(n)
    assert not smollm2.is_eog(n)


def test_bad_metadata() -> None:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}
    tok = Tokenizer.from_metadata({**base, "tokenizer.ggml.pre": "gpt-2"})
    assert tok.encode("abab", add_special=False) == [2, 2]
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_metadata({**base, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="unsupported tokenizer model"):
        Tokenizer.from_metadata({**base, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_special_partition_longest_first() -> None:
    # llama.cpp cuts special tokens longest first over the whole text, not leftmost first: in "abcd" the longer
    # "bcd" wins over the earlier "ab"; and a text between cut tokens is never matched across a cut.
    from ninfer.tokenizer import bytes_to_unicode

    chars = [bytes_to_unicode()[b] for b in range(256)]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.merges": [],
            "tokenizer.ggml.tokens": chars + ["ab", "bcd", "<x>"], "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 4]}
    tok = Tokenizer.from_metadata(meta)
    ab, bcd, x = 256, 257, 258
    assert tok.encode("abcd", add_special=False) == [ord("a"), bcd]
    assert tok.encode("abab<x>ab", add_special=False) == [ab, ab, x, ab]
    assert tok.encode("a<x>b", add_special=False) == [ord("a"), x, ord("b")]
    # parse_special=False: CONTROL tokens are plain text, USER_DEFINED ones are still cut out
    assert tok.encode("ab<x>", add_special=False, parse_special=False) == [ord("a"), ord("b"), x]


# End-of-generation sets as llama.cpp prints them when loading each model ("load: printing all EOG tokens").
LLAMA_CPP_EOG = {
    "smollm2": {0, 2, 4},  # <|endoftext|> <|im_end|> <reponame>
    "qwen05": {128247, 151643, 151645, 151662, 151663, 151664},  # </s> <|endoftext|> <|im_end|> fim_pad repo file_sep
    "qwen15": {128247, 151643, 151645, 151662, 151663, 151664},
    "gemma3": {1, 106, 212},  # <eos> <end_of_turn> </s>
}


@pytest.mark.parametrize("key", PARAMS)
def test_eog_ids_match_llama_cpp(key: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"{key}_path")
    tok = _cache.get(path) or _cache.setdefault(path, Tokenizer.from_metadata(load_metadata(path)))
    assert tok.eog_ids == LLAMA_CPP_EOG[key]
    assert all(tok.is_eog(i) for i in LLAMA_CPP_EOG[key])
