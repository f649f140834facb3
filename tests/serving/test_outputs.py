"""Text from token ids: stop strings and streamed deltas (serve/outputs.py)."""

from __future__ import annotations

import dataclasses
import random

import torch

from egmla.models import Transformer
from egmla.presets import preset
from serve import EngineConfig, LLMEngine, SamplingParams
from serve.outputs import OutputProcessor, TextStream

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
