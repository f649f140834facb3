"""Text from token ids: stop strings and streamed deltas (serve/outputs.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from egmla.models import Transformer
from egmla.presets import preset
from serve import EngineConfig, LLMEngine, SamplingParams
from serve.outputs import OutputProcessor, StopStrings, TextStream

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def letters(ids: list[int], skip_special_tokens: bool = True) -> str:
    """A toy detokenizer: one letter per token, and token 255 is the first half of a character
    that only the next token completes (shown as U+FFFD until then, as byte-level BPE does)."""
    out = []
    for i, t in enumerate(ids):
        if t == 255:
            out.append("é" if i + 1 < len(ids) else "\ufffd")
        elif i == 0 or ids[i - 1] != 255:
            out.append(LETTERS[t % 26])
    return "".join(out)


def stream_all(ids: list[int], stop: list[str]) -> tuple[str, str, bool]:
    """Feed tokens one by one; return (concatenated deltas, final text, stopped)."""
    text = TextStream(letters, stop)
    deltas = []
    for k in range(1, len(ids) + 1):
        deltas.append(text.update(ids[:k], final=k == len(ids)))
        if text.stopped:
            break
    return "".join(deltas), text.sent, text.stopped


def test_stop_string_across_tokens_is_cut_and_never_sent():
    ids = [0, 1, 2, 3, 4, 5]  # "abcdef"
    text = TextStream(letters, ["cde"])
    assert text.update(ids[:2], final=False) == "ab"
    assert text.update(ids[:3], final=False) == ""  # "c" may start "cde": held back
    assert text.update(ids[:4], final=False) == ""  # "cd" too
    assert text.update(ids[:5], final=False) == ""  # "cde": stop, nothing more
    assert text.stopped and text.sent == "ab"


def test_held_back_text_is_released_when_the_stop_string_fails_to_complete():
    text = TextStream(letters, ["cde"])
    text.update([0, 1, 2], final=False)
    assert text.update([0, 1, 2, 25], final=False) == "cz" and not text.stopped


def test_half_a_character_is_not_sent_until_it_is_complete():
    text = TextStream(letters)
    assert text.update([0, 255], final=False) == "a"
    assert text.update([0, 255, 1], final=False) == "é"  # token 1 completed it


def test_deltas_always_add_up_to_the_final_text():
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.choice([0, 1, 2, 3, 255]) for _ in range(rng.randint(1, 12))]
        stop = [letters([rng.choice([0, 1, 2]) for _ in range(rng.randint(1, 3))])]
        joined, final, stopped = stream_all(ids, stop)
        whole = letters(ids)
        assert joined == final
        assert final == (whole[: whole.find(stop[0])] if stop[0] in whole else whole)
        assert stopped == (stop[0] in whole)


def test_a_stop_string_completed_by_the_last_token_is_cut_with_reason_stop():
    """The sample ends by length at the very token that completes the stop string."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha")).eval()
    params = SamplingParams(temperature=0, max_tokens=6)
    reference = LLMEngine(model, EngineConfig(num_blocks=32)).generate([[1, 2, 3]], params)[0]
    whole = letters(reference)
    # The shortest tail of the text that appears nowhere earlier: complete only at the end.
    stop = next(whole[-k:] for k in range(1, len(whole) + 1) if whole.find(whole[-k:]) == len(whole) - k)

    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    processor = OutputProcessor(engine, letters)
    rid = engine.add_request([1, 2, 3], dataclasses.replace(params, stop=[stop]))
    processor.add(rid, stream=True)
    updates = []
    while engine.has_unfinished():
        engine.step()
        updates += processor.process()
    assert updates[-1].finished and len(updates) == 6
    out = updates[-1].outputs[0]
    assert out.token_ids == reference and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == whole[: len(whole) - len(stop)]
    assert "".join(d.text for u in updates for d in u.deltas) == out.text
    assert not engine.requests  # released


# ---- stop strings against a plain reference ----------------------------------------------------

class NaiveText:
    """The stop-string rules written plainly (as serve/outputs.py had them): at every update
    search the whole text for every stop string, cut at the earliest (the smallest string at
    that start), and hold back the longest tail that is a proper prefix of one, or a trailing
    U+FFFD."""

    def __init__(self, decode, stop):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.sent, self.stopped, self.hit = "", False, None

    def update(self, ids, final):
        text = self.decode(ids, True)
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            at, self.hit = min(hits)
            text, self.stopped, final = text[:at], True, True
        if not final:
            held = max(len(text) - len(text.rstrip("\ufffd")), naive_stop_hold(text, self.stop))
            text = text[: len(text) - held]
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def naive_stop_hold(text, stop):
    """The longest tail of `text` that is a proper prefix of a stop string."""
    held = 0
    for s in stop:
        for k in range(1, min(len(s) - 1, len(text)) + 1):
            if text.endswith(s[:k]):
                held = max(held, k)
    return held


# Few letters, so that stop strings often match, overlap, nest and half-match; "é" comes from
# token 255 + the next token (U+FFFD while it is the last one: decoding is not prefix-stable).
TOKENS = st.lists(st.sampled_from([0, 1, 2, 255]), min_size=1, max_size=30)
STOPS = st.lists(st.text(alphabet="abcé\ufffd", max_size=5), max_size=6)
PROPERTY = settings(max_examples=400, deadline=None, database=None, derandomize=True)


@PROPERTY
@given(ids=TOKENS, stop=STOPS, cuts=st.lists(st.integers(1, 30), max_size=30))
def test_text_stream_equals_the_plain_reference_for_any_chunking(ids, stop, cuts):
    """Tokens arrive in random chunks (a step may bring several); every update returns what
    the reference returns, and both end with the same text, stop string and deltas."""
    ends = sorted({c for c in cuts if c < len(ids)} | {len(ids)})
    ours, ref = TextStream(letters, stop), NaiveText(letters, stop)
    deltas = []
    for k in ends:
        final = k == len(ids)
        delta = ours.update(ids[:k], final)
        assert delta == ref.update(ids[:k], final), (ids[:k], stop)
        assert (ours.stopped, ours.hit, ours.sent) == (ref.stopped, ref.hit, ref.sent)
        deltas.append(delta)
        if ours.stopped:
            break
    assert "".join(deltas) == ours.sent


class SmallSlices(StopStrings):
    """Built by slices of 2 strings: the merges and the checks across slices that 100,000 stop
    strings go through (SLICE is 8,192)."""

    SLICE = 2


@PROPERTY
@given(stop=STOPS, edits=st.lists(st.tuples(st.integers(0, 12), st.text(alphabet="abcé\ufffd",
                                                                           max_size=6)),
                                   min_size=1, max_size=12),
       built=st.sampled_from([StopStrings, SmallSlices]))
def test_a_cursor_answers_for_the_text_as_it_is_now(stop, edits, built):
    """Each new text keeps a random part of the last one and adds anything (decoding that
    rewrites earlier characters): the cursor reports the reference's earliest stop string,
    and without one, the reference's hold-back, until it finds one."""
    stops, text = built(stop), ""
    cursor, live = stops.cursor(), [s for s in stop if s]
    for keep, added in edits:
        text = text[:keep] + added
        hit, held = cursor.feed(text)
        found = [(text.find(s), s) for s in live if s in text]
        assert hit == (min(found) if found else None), (text, stop)
        if hit is not None:
            break
        assert held == naive_stop_hold(text, live), (text, stop)


@PROPERTY
@given(stop=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=12),
       piece=st.text(alphabet="ab", max_size=10), built=st.sampled_from([StopStrings, SmallSlices]))
def test_ending_is_the_longest_stop_string_that_ends_the_text(stop, piece, built):
    longest = max((len(s) for s in stop if piece.endswith(s)), default=0)
    stops = built(stop)
    assert stops.ending(piece) == longest
    assert stops.strings == sorted(set(stop))


class CountingStopStrings(StopStrings):
    """StopStrings that count their binary searches (each `begins` or `ending` call)."""

    searches = 0

    def begins(self, piece):
        self.searches += 1
        return super().begins(piece)

    def ending(self, piece):
        self.searches += 1
        return super().ending(piece)


def test_reading_a_character_takes_at_most_three_searches_whatever_the_stop_strings():
    """The cost of a step does not grow with the number of stop strings or the text: each
    character read costs at most two `begins` searches (amortized) and one `ending`, with
    100,000 random stop strings and with sets built to defeat a matcher (nested, periodic,
    each a substring of the text), the text fed a few characters at a time."""
    rng = random.Random(0)
    text = "".join(rng.choice("abcd") for _ in range(3000))
    families = {
        "100,000 random of 40": (["".join(rng.choice(LETTERS) for _ in range(40))
                                  for _ in range(100_000)],
                                 "".join(rng.choice(LETTERS) for _ in range(3000))),
        "a^k b and b a^k": ([*("a" * k + "b" for k in range(1, 2000)),
                             *("b" + "a" * k for k in range(1, 2000))], "a" * 3000),
        "all of ab up to 10, then c": (
            ["".join(rng.choice("ab") for _ in range(rng.randint(1, 10))) + "c"
             for _ in range(3000)], "".join(rng.choice("ab") for _ in range(3000))),
        "substrings of the text": ([text[i:i + 300] + "e" for i in range(2900)], text),
        "one long, then broken": (["a" * 5000 + "b"], "a" * 2999 + "x"),
    }
    for name, (stop, words) in families.items():
        stops = CountingStopStrings(stop)
        cursor = stops.cursor()
        for k in range(3, len(words) + 1, 3):
            hit, _ = cursor.feed(words[:k])
            assert hit is None, name  # the families never complete a stop string
        assert stops.searches <= 3 * len(words), (name, stops.searches / len(words))


@pytest.fixture(scope="module")
def greedy_run():
    """A tiny model, and its greedy 12 tokens after [1, 2, 3] (the reference's token stream)."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha")).eval()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = LLMEngine(model, EngineConfig(num_blocks=32)).generate([[1, 2, 3]], params)[0]
    return model, params, tokens


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(data=st.data(), stream=st.booleans())
def test_the_engine_cuts_stop_strings_as_the_plain_reference(greedy_run, data, stream):
    """Through the engine and OutputProcessor (one token per step): the final text,
    finish_reason, stop_reason and the streamed deltas are the reference's, for stop strings
    drawn from the generated text itself (so they match, overlap and nest) and at random."""
    model, params, tokens = greedy_run
    whole = letters(tokens)
    pieces = st.builds(lambda i, n: whole[i:i + n], st.integers(0, len(whole)), st.integers(1, 6))
    stop = data.draw(st.lists(pieces | st.text(alphabet=LETTERS[:4] + "é", max_size=4),
                              max_size=5))
    ref, deltas = NaiveText(letters, stop), []
    for k in range(1, len(tokens) + 1):
        deltas.append(ref.update(tokens[:k], final=k == len(tokens)))
        if ref.stopped:
            break

    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    processor = OutputProcessor(engine, letters)
    rid = engine.add_request([1, 2, 3], dataclasses.replace(params, stop=stop))
    processor.add(rid, stream=stream)
    updates = []
    while engine.has_unfinished():
        engine.step()
        updates += processor.process()
    out = updates[-1].outputs[0]
    assert out.text == ref.sent
    assert out.finish_reason == ("stop" if ref.stopped else "length")
    assert out.stop_reason == ref.hit
    assert out.token_ids == tokens[:len(deltas)]  # the engine stopped at the reference's token
    if stream:
        assert [d.text for u in updates for d in u.deltas] == deltas
