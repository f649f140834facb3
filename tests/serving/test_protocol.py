"""The HTTP request schemas take their sampling fields from SamplingParams and derive what they
refuse (serve/protocol.py): adding a sampling parameter touches serve/sampling.py only."""

from __future__ import annotations

import dataclasses

import pytest

from serve.protocol import (OWN_SPELLING, SAMPLING_FIELDS, APIError, ChatRequest,
                            CompletionRequest, refuse_unsupported)
from serve.sampling import NOT_IMPLEMENTED, SamplingParams

PARAMS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("kind", [CompletionRequest, ChatRequest])
def test_every_sampling_field_is_a_request_field_with_its_default(kind):
    assert set(SAMPLING_FIELDS) | set(OWN_SPELLING) == set(PARAMS)
    for name in SAMPLING_FIELDS:
        assert kind.model_fields[name].default == PARAMS[name], name


@pytest.mark.parametrize("kind", [CompletionRequest, ChatRequest])
def test_a_kind_refuses_the_known_fields_it_does_not_take(kind):
    own = set(kind.model_fields)
    assert set(kind.REFUSED) == (set(NOT_IMPLEMENTED) | set(PARAMS)) - own
    assert "prompt_logprobs" in kind.REFUSED and "temperature" not in kind.REFUSED
    assert ("best_of" in kind.REFUSED) == (kind is ChatRequest)  # completions take it (== n)


def test_a_refused_field_passes_only_at_a_value_that_means_off():
    def request(**extra):
        return CompletionRequest.model_validate({"model": "m", "prompt": "x", **extra})

    refuse_unsupported(request(use_beam_search=False, logit_bias={}, length_penalty=1.0))
    for field, value in (("use_beam_search", True), ("logit_bias", {"5": 1}),
                         ("prompt_logprobs", 1), ("guided_json", {})):
        with pytest.raises(APIError) as caught:
            refuse_unsupported(request(**{field: value}))
        assert caught.value.param == field and caught.value.status == 400


def test_the_rules_that_shape_a_request_live_with_its_schema():
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 0})
    with pytest.raises(APIError) as caught:
        chat.to_sampling_params(room=10)
    assert caught.value.param == "max_completion_tokens"
    unbounded = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2})
    params = unbounded.to_sampling_params(room=7)
    assert params.max_tokens == 7 and params.logprobs == 2
    echo = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 0,
                                             "echo": True, "logprobs": 1})
    params = echo.to_sampling_params()
    assert echo.score_prompt and params.max_tokens == 1 and params.prompt_logprobs == 1


def test_content_parts_are_joined_by_newlines_as_vllm_does():
    """The server reads OpenAI's text parts as LLM.chat does (serve.inputs.content_text)."""
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]})
    assert chat.messages[0].content == "first\nsecond"
