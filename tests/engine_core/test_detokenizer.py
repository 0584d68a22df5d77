"""Incremental detokenizer and front-end output state: multi-byte chars, stop strings."""

from __future__ import annotations

import pytest

from engine_core.detokenizer import IncrementalDetokenizer
from engine_core.messages import EngineOutput, TokenLogprob
from engine_core.output_processor import OutputProcessor, RequestState
from engine_core.sampling_params import SamplingParams

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog. STOP here.",
          "naïve café, 日本語のテキスト, emoji 🎉🚀 and more text. END of line"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE tokenizer: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        update = detok.update(ids[i:i + chunk], finished=last)
        pieces.append(update.text)
        if update.stop_str is not None:
            break
    return pieces


@pytest.mark.parametrize("text", ["日本語のテキスト 🎉🚀", "naïve café", "hello world", "ünïcödé ✓"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_characters_split_across_tokens(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()
    pieces = _stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids, chunk)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_prompt_context_and_special_tokens(tokenizer):
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    ids = tokenizer.encode(" world", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer, prompt), ids)) == " world"
    keep = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert "".join(_stream(keep, ids)) == " world<eos>"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_spanning_tokens_excluded(tokenizer, chunk):
    ids = tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["k bro"])
    pieces = _stream(detok, ids, chunk)
    assert "".join(pieces) == "the quic"
    assert detok.stop_str == "k bro"


def test_stop_string_included(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["brown", "fox"],
                                   include_stop_str_in_output=True)
    assert "".join(_stream(detok, ids)) == "the quick brown"
    assert detok.stop_str == "brown"


def test_earliest_stop_wins_and_holdback_releases(tokenizer):
    ids = tokenizer.encode("the lazy dog. STOP here.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP", "dog. X"])
    pieces = _stream(detok, ids)
    assert "".join(pieces) == "the lazy dog. "
    # Text that only looked like the start of "dog. X" is released once it cannot match.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["dog. X"])
    assert "".join(_stream(detok, ids)) == "the lazy dog. STOP here."
    assert detok.stop_str is None


def test_request_state_stop_string_asks_engine_abort(tokenizer):
    params = SamplingParams(stop=["fox"], logprobs=1, max_tokens=50)
    state = RequestState.create("r1", [1, 2], params, tokenizer)
    ids = tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    deltas = []
    for tid in ids:
        lp = TokenLogprob(token_id=tid, logprob=-0.5, rank=1, top_token_ids=[tid], top_logprobs=[-0.5])
        delta = state.process(EngineOutput("r1", [tid], 2, 0, new_logprobs=[lp]))
        if delta is None:
            break
        deltas.append(delta)
    assert deltas[-1].finished and deltas[-1].needs_engine_abort
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "fox"
    assert state.output_text == "the quick brown "
    assert deltas[0].logprobs[0].token == tokenizer.decode([ids[0]])


def test_output_processor_engine_finish(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    proc.add_request("a", [1], SamplingParams(max_tokens=len(ids)))
    deltas, aborts = proc.process_outputs([EngineOutput("a", ids[:-1], 1, 0)])
    assert not aborts and not deltas[0].finished
    deltas, _ = proc.process_outputs([EngineOutput("a", ids[-1:], 1, 0, finish_reason="length")])
    assert deltas[0].finished and deltas[0].finish_reason == "length"
    assert deltas[0].num_output_tokens == len(ids)
    assert not proc.has_unfinished()


SENTENCE = "the quick brown fox jumps over the lazy dog."


def _feed(state: RequestState, ids: list[int], last_finish: str, last_stop_reason=None):
    streamed, delta = "", None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = state.process(EngineOutput("r", [token], 0, 0,
                                           finish_reason=last_finish if last else None,
                                           stop_reason=last_stop_reason if last else None))
        streamed += delta.text
        if delta.finished:
            break
    return streamed, delta


def test_a_short_stop_string_inside_min_tokens_text_is_not_matched_later(tokenizer):
    """With two stop strings, the search looked back the longest one's length: a short stop
    seen only in text that min_tokens protects matched once min_tokens passed, after the
    client had been streamed that text (vLLM looks back each stop's own length)."""
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    protected = next(k for k in range(1, len(ids) + 1) if "q" in tokenizer.decode(ids[:k]))
    state = RequestState.create("r", [], SamplingParams(
        stop=["q", "zzzzzzzzzzzz"], min_tokens=protected, max_tokens=len(ids)), tokenizer)
    streamed, delta = _feed(state, ids, "length")
    assert (delta.finish_reason, delta.stop_reason) == ("length", None)
    assert streamed == state.output_text == SENTENCE


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_tokens_text_is_left_out_as_vllm_does(tokenizer, include):
    """A request the engine stopped on a token (finish_reason "stop": EOS or stop_token_ids)
    counts that token but leaves its text out, unless include_stop_str_in_output."""
    dot = tokenizer.encode(".", add_special_tokens=False)
    assert len(dot) == 1
    words = tokenizer.encode("the lazy dog", add_special_tokens=False)
    for params, stop_id, reason in (
            (SamplingParams(stop_token_ids=dot, include_stop_str_in_output=include), dot[0], dot[0]),
            (SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include),
             tokenizer.eos_token_id, None)):
        state = RequestState.create("r", [], params, tokenizer)
        streamed, delta = _feed(state, words + [stop_id], "stop", reason)
        expected = tokenizer.decode(words + ([stop_id] if include else []),
                                    skip_special_tokens=False)
        assert streamed == state.output_text == expected
        assert delta.num_output_tokens == len(words) + 1


def _holdback_brute_force(text: str, stops: list[str]) -> int:
    for length in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(len(stop) > length and stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def test_holdback_matches_the_definition_and_stays_cheap():
    """The hold-back (the longest text suffix that is a proper prefix of a stop string) now
    tries only places where a stop's first character occurs: the same answer as trying every
    length, checked on random texts, at a fraction of the cost (it took ~1 ms a token at the
    limits, 16 stop strings of 1024 characters, on the event loop)."""
    import random
    import time

    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]
        detok = IncrementalDetokenizer(None, [], stop=stops)
        detok.output_text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        assert detok._holdback() == _holdback_brute_force(detok.output_text, stops)

    class Letters:
        def decode(self, ids, **kwargs):
            return "".join("ab"[i % 2] for i in ids)

    detok = IncrementalDetokenizer(Letters(), [0], stop=["c" * (1024 - i) for i in range(16)])
    started = time.perf_counter()
    for i in range(1000):
        detok.update([i])
    assert time.perf_counter() - started < 0.3  # was ~1 s


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: BPE over ``▁``-joined text with byte-fallback tokens
    ``<0xNN>`` for characters it has no piece for, decoded by Replace + ByteFallback + Fuse
    + Strip (what Llama-2's, Mistral's and Gemma's tokenizer.json do). Its vocabulary is
    ASCII only, so every emoji and CJK character is a run of byte tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = [chr(c) for c in range(32, 127)] + ["▁"]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet),
                                  special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens)
    tok.train_from_iterator(["▁" + text.replace(" ", "▁") for text in CORPUS], trainer=trainer)
    # Byte tokens are ordinary vocabulary in such checkpoints, not added tokens.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("prompt,output", [("Party time 🎉🎉", "🚀 yes!"), ("中文", "字符测试"),
                                           ("the fox 日本語", "のテキスト ok")])
def test_byte_fallback_output_after_a_multibyte_prompt_end(byte_fallback_tokenizer, prompt,
                                                           output):
    """The output's first characters continue a run of byte tokens that began in the prompt:
    the decoding context must start on a character boundary, or the byte-fallback decoder
    turns the whole run into U+FFFD (vLLM picks a context that decodes cleanly too)."""
    tok = byte_fallback_tokenizer
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    full_ids = tok(prompt + output, add_special_tokens=False).input_ids
    assert full_ids[:len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids):]
    expected = tok.decode(full_ids)[len(tok.decode(prompt_ids)):]
    assert "\ufffd" not in expected
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(tok, prompt_ids)
        assert "".join(_stream(detok, output_ids, chunk)) == expected


def test_byte_fallback_streaming_equals_full_decode(byte_fallback_tokenizer):
    """Random cuts of mixed ASCII, CJK and emoji text: the streamed text is what decoding
    the whole sequence adds to the prompt's text."""
    import random

    tok = byte_fallback_tokenizer
    rng = random.Random(4)
    pieces = ["hello ", "world", " 中文", "字符", "🎉", "🚀 ", "naïve ", "café", "日本語", "!"]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(3, 12)))
        ids = tok(text, add_special_tokens=False).input_ids
        cut = rng.randrange(1, len(ids))
        prompt_ids, output_ids = ids[:cut], ids[cut:]
        expected = tok.decode(ids)[len(tok.decode(prompt_ids)):]
        if "\ufffd" in tok.decode(prompt_ids):
            continue  # the prompt itself ends inside a character: nothing to compare
        detok = IncrementalDetokenizer(tok, prompt_ids)
        assert "".join(_stream(detok, output_ids)) == expected, (text, cut)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("handed", [1, 2, 3])
def test_handed_over_tokens_then_engine_outputs_equal_one_stream(tokenizer, handed: int,
                                                                 include: bool) -> None:
    """A continuation (``assume_delivered``) releases exactly what one stream releases after
    the same tokens, a stop string completed by the handed-over tokens included: then it
    sends only the finish, whatever the engine's output for the request."""
    ids = tokenizer.encode("the quick brown fox STOP here")
    prefix = tokenizer.decode(ids[:handed])
    stop = prefix[-2:]  # completed by the last handed-over token
    params = SamplingParams(max_tokens=10, stop=[stop, "STOP"], include_stop_str_in_output=include)

    def fresh() -> RequestState:
        return RequestState.create("r", [1, 2], params, tokenizer)

    whole, sent = fresh(), []
    for token in ids:
        delta = whole.process(EngineOutput("r", [token], 2, 0))
        sent.append(delta.text)
        if delta.finished:
            break
    assert whole.finished and delta.stop_reason == stop and delta.finish_reason == "stop"
    assert len(sent) == handed or stop in prefix[:-1], "the stop ends the handed-over tokens"

    rest = fresh()
    rest.assume_delivered(ids[:handed])
    assert rest.handed_stop == stop and "".join(rest.text_pieces) == "".join(sent)
    final = rest.process(EngineOutput("r", [], 2, 0, finish_reason="length"))
    assert final.finished and (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == "" and final.num_output_tokens == handed
    assert not final.needs_engine_abort
    assert rest.process(EngineOutput("r", [7], 2, 0)) is None
