"""Incremental detokenising: linear work, and exactly the text a full decode gives.

Work is counted, not timed: every call to the tokenizer's ``decode`` and every token id it is handed.
Decoding the whole output after each token (what the engine did before) hands it n(n+1)/2 ids for an
n-token output; the incremental detokenizer must hand it a bounded number per token.
"""
from __future__ import annotations

import random

import pytest

from minipaged import SamplingParams
from minipaged.detokenizer import IncrementalDetokenizer
from minipaged.model.testing import build_byte_tokenizer
from minipaged.output_processor import OutputProcessor
from minipaged.request import Request, RequestStatus

# Text whose characters take 1 to 4 bytes, so that byte-level tokens split most of them.
MIXED_TEXT = "Paged attention, naïve caches, 東京の天気は晴れ, emojis 🚀🧠 and Ω≈ç√ — all split across tokens. "


class CountingTokenizer:
    """Wraps a tokenizer and counts the decoder's work."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0
        self.ids_decoded = 0

    def decode(self, token_ids, **kwargs) -> str:
        self.calls += 1
        self.ids_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def whole_output_reference(tokenizer, token_ids: list[int]) -> str:
    """The engine's old rule: decode everything after every token; keep the last text that does not end in
    the middle of a multi-byte character."""
    text = ""
    for i in range(1, len(token_ids) + 1):
        full = tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            text = full
    return text


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_byte_tokenizer()


def output_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer(MIXED_TEXT).input_ids)
    return ids[:n]


def detokenize(tokenizer, token_ids: list[int]) -> tuple[str, CountingTokenizer]:
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    pieces = [detok.add_tokens([t]) for t in token_ids]
    assert "".join(pieces) == detok.text
    return detok.text, counting


def test_a_2000_token_output_costs_linear_decoder_work_and_gives_the_full_decode(byte_tokenizer):
    ids = output_ids(byte_tokenizer, 2000)
    assert sum(1 for b in MIXED_TEXT.encode() if b >= 0x80) > 40          # multi-byte characters, split up
    text, work = detokenize(byte_tokenizer, ids)
    assert text == whole_output_reference(byte_tokenizer, ids)
    full = byte_tokenizer.decode(ids, skip_special_tokens=True)
    assert text == full.rstrip("\ufffd")          # 2000 cuts the last character in half: it is held back
    assert work.calls <= 2 * len(ids)
    assert work.ids_decoded <= 12 * len(ids), "each token should be decoded a bounded number of times"
    quadratic = len(ids) * (len(ids) + 1) // 2
    assert work.ids_decoded < quadratic / 50

    # Twice the output, twice the work (not four times).
    _, half = detokenize(byte_tokenizer, ids[:1000])
    assert work.ids_decoded <= 2.2 * half.ids_decoded


def test_special_tokens_are_skipped_and_do_not_grow_the_window(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    ids = byte_tokenizer("ab").input_ids + [eos] * 500 + byte_tokenizer("é!").input_ids
    text, work = detokenize(byte_tokenizer, ids)
    assert text == "abé!" == byte_tokenizer.decode(ids, skip_special_tokens=True)
    assert work.ids_decoded <= 12 * len(ids)


@pytest.mark.slow
def test_the_embedded_models_tokenizer_round_trips_incrementally():
    """SmolLM2's byte-level BPE: merged tokens, spaces inside tokens, and characters split over tokens."""
    from minipaged.model.loader import convert_embedded_model
    from transformers import AutoTokenizer

    folder, _converted = convert_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = output_ids(tokenizer, 2000)
    text, work = detokenize(tokenizer, ids)
    assert text == whole_output_reference(tokenizer, ids)
    assert work.ids_decoded <= 12 * len(ids)
    rng = random.Random(0)                                  # random ids: invalid byte runs, special tokens
    noise = [rng.randrange(tokenizer.vocab_size) for _ in range(600)]
    assert detokenize(tokenizer, noise)[0] == whole_output_reference(tokenizer, noise)


def make_request(tokenizer, params: SamplingParams) -> Request:
    return Request("r", tokenizer("x").input_ids, params, 0, 0.0)


@pytest.mark.parametrize("stop", [["晴れ"], ["🧠 and"], ["caches, 東"]])
def test_stop_strings_split_across_multibyte_tokens_end_the_text_and_the_stream_exactly(byte_tokenizer, stop):
    """A stop string whose bytes arrive over several tokens: the text ends right before it, the stream never
    shows any of it, and the joined stream equals the final text."""
    outputs = OutputProcessor(byte_tokenizer)
    req = make_request(byte_tokenizer, SamplingParams(max_tokens=10_000, stop=stop))
    outputs.add_requests("r", [req])
    streamed, stop_hit = "", None
    for i, token in enumerate(byte_tokenizer(MIXED_TEXT).input_ids):
        req.output_token_ids.append(token)
        found = outputs.process_tokens({"r": [token]}, now=float(i))
        drained = outputs.drain()
        streamed += "".join(d.samples[0].text for d in drained.deltas)
        assert drained.text.get("r", "") == "".join(d.samples[0].text for d in drained.deltas)   # observers: same
        assert stop[0] not in streamed
        if found:
            (hit_req, stop_hit, surplus), = found
            assert surplus == 0                              # one token at a time: none came after it
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_hit
            break
    assert stop_hit == stop[0]
    outputs.finish(req, now=100.0)
    last, = outputs.drain().deltas
    streamed += last.samples[0].text
    out = last.output
    assert out.text == MIXED_TEXT[:MIXED_TEXT.index(stop[0])] == streamed
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop[0]
