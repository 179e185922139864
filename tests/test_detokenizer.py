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
            (hit_req, stop_hit), = found
            assert hit_req is req
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_hit
            break
    assert stop_hit == stop[0]
    outputs.finish(req, now=100.0)
    last, = outputs.drain().deltas
    streamed += last.samples[0].text
    out = last.output
    assert out.text == MIXED_TEXT[:MIXED_TEXT.index(stop[0])] == streamed
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop[0]


# ---------------------------------------------------------------------- the tokenizers library's DecodeStream
def sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer built offline: pieces with "▁" for spaces, byte-fallback tokens <0xNN> for
    characters not in the vocabulary, and a decoder that strips the first leading space (the join that makes
    decoding a token alone differ from decoding it in context)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁Paged", "▁att", "ention", ",", "▁na", "ïve", "▁caches", "▁", "!", "▁the", "s", "▁ab"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def tricky_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Random ids (special tokens among them) with multi-byte characters spelled in byte tokens, the last one
    possibly cut short. For a byte-level tokenizer random ids are also invalid UTF-8 runs of every kind."""
    byte_ids = {int(tok[3:5], 16): i for tok, i in tokenizer.get_vocab().items() if tok.startswith("<0x")}
    other_ids = [i for i in range(len(tokenizer)) if i not in byte_ids.values()]
    ids: list[int] = []
    while len(ids) < n:
        if byte_ids and rng.random() < 0.3:
            ids.extend(byte_ids[b] for b in rng.choice("東京🚀ïΩ√").encode())
        else:
            ids.append(rng.choice(other_ids))
    if byte_ids and rng.random() < 0.3:
        ids.extend(byte_ids[b] for b in "京".encode()[:2])          # the output ends inside a character
    return ids


@pytest.mark.parametrize("which", ["byte", "sentencepiece"])
def test_the_streaming_decoder_gives_the_full_decode_on_tricky_ids_without_calling_decode(which, byte_tokenizer,
                                                                                          monkeypatch):
    """Byte-level pieces of multi-byte characters (random ids: invalid runs too), byte-fallback tokens, a decoder
    that strips the first space, special tokens skipped: the text the tokenizers library's DecodeStream streams
    is the full decode's, and transformers' decode is never called on the way."""
    tokenizer = byte_tokenizer if which == "byte" else sentencepiece_style_tokenizer()
    rng = random.Random(7)
    sequences = [tricky_ids(tokenizer, rng, rng.randint(1, 60)) for _ in range(150)]
    sequences.append([tokenizer.eos_token_id] * 3 + tokenizer("ab").input_ids + [tokenizer.eos_token_id])
    references = [whole_output_reference(tokenizer, ids) for ids in sequences]
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or "")
    for ids, reference in zip(sequences, references):
        detok = IncrementalDetokenizer(tokenizer)
        assert detok.streaming
        pieces = [detok.add_tokens([t]) for t in ids]
        assert "".join(pieces) == detok.text == reference, ids
        assert detok.streaming
    assert not calls


def test_a_skipped_special_token_mid_output_keeps_the_space_after_it():
    """A decoder that strips the first leading space (Llama 2's, TinyLlama's): the window in Python restarts
    after a skipped special token and loses the space of the piece after it ("abthe"); the stream keeps it,
    as the full decode does. (The window is only used where no stream can be: see streaming_backend.)"""
    tokenizer = sentencepiece_style_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁ab", "</s>", "▁the"])
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add_tokens([t]) for t in ids) == "ab the" == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_byte_fallback_run_that_is_not_utf8_does_not_stop_the_text():
    """Byte-fallback decoders turn every byte of an invalid run into U+FFFD, even bytes already printed: the
    full decode changes text it gave before, and DecodeStream refuses the step (vLLM issue 17448). The
    request goes on through the window: no error, and the text after the run arrives."""
    tokenizer = sentencepiece_style_tokenizer()
    vocab = tokenizer.get_vocab()
    run = [vocab[f"<0x{b:02X}>"] for b in "東".encode() + "京".encode()[:1]]
    ids = run + tokenizer.convert_tokens_to_ids(["▁caches", "!"])
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert not detok.streaming
    assert text == detok.text and text.startswith("東") and text.endswith(" caches!")


def test_several_tokens_at_once_give_the_same_text_as_one_at_a_time(byte_tokenizer):
    """Speculative decoding appends several tokens a step."""
    ids = output_ids(byte_tokenizer, 300)
    one = IncrementalDetokenizer(byte_tokenizer)
    many = IncrementalDetokenizer(byte_tokenizer)
    rng = random.Random(3)
    i = 0
    while i < len(ids):
        k = rng.randint(1, 4)
        many.add_tokens(ids[i:i + k])
        i += k
    for t in ids:
        one.add_tokens([t])
    assert many.text == one.text == whole_output_reference(byte_tokenizer, ids)


class RefusingStream:
    """A DecodeStream stand-in that refuses its step after ``ok`` tokens (as tokenizers raises when a window's
    text does not start with the text before it)."""

    def __init__(self, real, ok: int) -> None:
        self.real, self.ok = real, ok

    def step(self, backend, token):
        if self.ok == 0:
            raise Exception("DecodeStream: invalid prefix")
        self.ok -= 1
        return self.real.step(backend, token)


@pytest.mark.parametrize("refuse_after", [0, 1, 5, 40])
def test_a_stream_that_refuses_a_step_hands_over_to_the_window_with_the_same_text(byte_tokenizer, refuse_after):
    ids = output_ids(byte_tokenizer, 120)
    detok = IncrementalDetokenizer(byte_tokenizer)
    detok._stream = RefusingStream(detok._stream, refuse_after)
    pieces = [detok.add_tokens(ids[i:i + 2]) for i in range(0, len(ids), 2)]
    assert not detok.streaming
    assert "".join(pieces) == detok.text == whole_output_reference(byte_tokenizer, ids)


def test_tokenizers_that_clean_up_spaces_or_have_no_backend_take_the_window(byte_tokenizer):
    """transformers removes spaces before punctuation after the backend's decode when asked to: a stream of the
    backend would not, so such a tokenizer (and one with no tokenizers backend at all) takes the window."""
    from minipaged.detokenizer import streaming_backend
    assert streaming_backend(byte_tokenizer) is byte_tokenizer.backend_tokenizer
    assert streaming_backend(CountingTokenizer(byte_tokenizer)) is None
    cleaning = sentencepiece_style_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    assert streaming_backend(cleaning) is None
    assert not IncrementalDetokenizer(cleaning).streaming
