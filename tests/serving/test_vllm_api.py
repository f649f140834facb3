"""Code written for vLLM runs here: `LLM` and `SamplingParams` take vLLM's names and defaults,
and every field changes the output as documented, checked against a reference computed from
the model's own logits (a tiny model exported with a real BPE tokenizer)."""

from __future__ import annotations

import pytest
import torch

from serve import LLM, Logprob, SamplingParams
from serve.engine import InvalidRequest
from support.models import tiny_text_export

PROMPTS = ["The king said", "And the lord spake", "O Romeo, Romeo"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("vllm") / "export", max_seq_len=128)


@pytest.fixture(scope="module")
def llm(export):
    return LLM(model=str(export), dtype="float32", max_model_len=96, seed=0)


def greedy_reference(llm: LLM, prompt: list[int], steps: int, adjust=None) -> list[int]:
    """Greedy decoding by full forwards of the model; `adjust(logits, output)` changes the
    logits before the argmax (a penalty written out)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = llm.model(torch.tensor([prompt + out]))[0, -1].double()
            out.append(int((adjust(logits, out) if adjust else logits).argmax()))
    return out


def test_code_written_for_vllm_runs_and_its_logprobs_are_the_models(llm):
    """The acceptance example: vLLM's constructor and generate keywords, greedy with stop
    strings and logprobs=2; each token's logprobs equal a direct log-softmax of the model over
    prompt + output (1e-4), with the top two and the sampled token, ranked."""
    params = SamplingParams(temperature=0, max_tokens=12, stop=["\n\n"], logprobs=2)
    outs = llm.generate(PROMPTS, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt and out.finished and isinstance(out.request_id, str)
        sample = out.outputs[0]
        ids = out.prompt_token_ids + sample.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(llm.model(torch.tensor([ids]))[0].double(), dim=-1)
        total = 0.0
        for t, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            row = reference[len(out.prompt_token_ids) - 1 + t]
            top2 = row.topk(2).indices.tolist()
            assert set(entry) == {*top2, token} and token == top2[0]  # greedy: rank 1
            for tid, lp in entry.items():
                assert isinstance(lp, Logprob) and abs(lp.logprob - row[tid].item()) < 1e-4
                assert lp.rank == int((row > row[tid]).sum()) + 1
                assert lp.decoded_token == llm.tokenizer.decode([tid])
            total += row[token].item()
        assert sample.cumulative_logprob == pytest.approx(total, abs=1e-3)
        assert sample.finish_reason in ("stop", "length") and sample.finished()


def test_prompt_logprobs_are_the_models_over_chunks_and_despite_the_prefix_cache(export):
    """prompt_logprobs=3: every prompt token after the first, scored by a log-softmax of the
    model's logits at the position before it (1e-4), with the top three; also when the prompt is
    prefilled in chunks of 8 and when an identical prompt already sits in the prefix cache
    (a request that asks for prompt logprobs computes its whole prompt)."""
    llm = LLM(model=str(export), dtype="float32", block_size=4, max_num_batched_tokens=8)
    text = "And the lord spake unto Moses, saying, Speak unto the children of Israel"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first, again = (llm.generate(text, params, use_tqdm=False)[0] for _ in range(2))
    ids = first.prompt_token_ids
    assert len(ids) > 16  # three chunks at least
    with torch.no_grad():
        reference = torch.log_softmax(llm.model(torch.tensor([ids]))[0].double(), dim=-1)
    for out in (first, again):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = reference[p - 1]
            assert set(entry) == {*row.topk(3).indices.tolist(), ids[p]}
            assert all(abs(lp.logprob - row[t].item()) < 1e-4 for t, lp in entry.items())
    assert again.num_cached_tokens == 0  # it did not take the cached blocks
    plain = llm.generate(text, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # the cache still serves


def test_bf16_logprobs_are_the_fp32_models_within_bf16s_error(export):
    """bf16 weights and KV: each token's logprob within 0.05 nats of fp32's log-softmax: bf16
    rounds each weight and activation to 8 bits of mantissa (relative 2^-9), which moves a
    logit by a few thousandths here (measured at most 0.004); 0.05 leaves room for a longer
    context's accumulation without admitting a wrong token's logprob."""
    bf16 = LLM(model=str(export), dtype="bfloat16", seed=0)
    fp32 = LLM(model=str(export), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    for out in bf16.generate(PROMPTS, params, use_tqdm=False):
        sample = out.outputs[0]
        ids = out.prompt_token_ids + sample.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(fp32.model(torch.tensor([ids]))[0].double(), dim=-1)
        for t, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert set(entry) == {token}  # logprobs=0: the sampled token only
            row = reference[len(out.prompt_token_ids) - 1 + t]
            assert abs(entry[token].logprob - row[token].item()) < 0.05


def test_the_default_temperature_is_vllms_and_samples(llm):
    assert SamplingParams().temperature == 1.0 and SamplingParams().top_p == 1.0
    a = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, seed=1), use_tqdm=False)
    b = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, seed=2), use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids  # sampled, not greedy


def test_penalties_change_the_logits_as_vllm_defines_them(llm):
    """Greedy with each penalty equals greedy over the model's logits with the penalty written
    out; and each changes the output of this model (which repeats itself)."""
    prompt = llm.encode(PROMPTS[0])
    plain = greedy_reference(llm, prompt, 12)

    def repetition(logits, out):
        seen = torch.tensor(sorted(set(prompt + out)))
        picked = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(picked > 0, picked / 3.0, picked * 3.0)
        return logits

    def counted(freq, pres):
        def adjust(logits, out):
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.shape[0]).double() if out else 0
            return logits - freq * counts - pres * (torch.as_tensor(counts) > 0).double()
        return adjust

    cases = {"repetition_penalty": (3.0, repetition), "frequency_penalty": (1.5, counted(1.5, 0)),
             "presence_penalty": (1.5, counted(0, 1.5))}
    for name, (value, adjust) in cases.items():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **{name: value})
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == greedy_reference(llm, prompt, 12, adjust), name
        assert got != plain, name


def test_min_p_one_keeps_only_the_top_token_and_top_k_minus_one_keeps_all(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)
    only_top = llm.generate(PROMPTS, SamplingParams(temperature=1.0, min_p=1.0, seed=3,
                                                    max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in only_top] == [o.outputs[0].token_ids for o in greedy]
    runs = [llm.generate(PROMPTS[1], SamplingParams(top_k=k, seed=4, max_tokens=10),
                         use_tqdm=False)[0].outputs[0].token_ids for k in (None, -1, 0)]
    assert runs[0] == runs[1] == runs[2]


def test_stop_tokens_eos_min_tokens_and_ignore_eos(llm):
    prompt = llm.encode(PROMPTS[2])
    first = greedy_reference(llm, prompt, 1)[0]
    stop_at_first = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first])
    [out] = llm.generate([prompt], stop_at_first, use_tqdm=False)
    assert out.outputs[0].token_ids == [first] and out.outputs[0].stop_reason == first
    assert out.outputs[0].finish_reason == "stop"
    # min_tokens: the stop token cannot come before 3 tokens (it is masked, so greedy goes on)
    [later] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                                    stop_token_ids=[first]), use_tqdm=False)
    tokens = later.outputs[0].token_ids
    assert len(tokens) >= 3 and first not in tokens[:3]
    # the EOS stops with no stop_reason (vLLM's); ignore_eos runs on to max_tokens
    eos = SamplingParams(temperature=0, max_tokens=8, eos_token_id=first)
    [out] = llm.engine.generate([prompt], eos)
    assert out == [first]
    [out] = llm.engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                         eos_token_id=first, ignore_eos=True))
    assert len(out) == 8


def test_prompts_as_vllm_takes_them_and_max_model_len(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.encode(PROMPTS[0])
    forms = [PROMPTS[0], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}, ids]
    outs = [llm.generate(f, params, use_tqdm=False)[0] for f in forms]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[1].prompt == PROMPTS[0] and outs[2].prompt is None
    with pytest.raises(InvalidRequest, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        llm.generate({"prompt": "a", "images": []}, params)
    # max_tokens=None: as many as max_model_len (96) leaves after the prompt
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 96 - len(ids)
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 96"):
        llm.generate([ids], SamplingParams(max_tokens=96))


def test_the_llm_seed_makes_unseeded_sampling_reproducible(export):
    runs = []
    for seed in (0, 0, 1):
        llm = LLM(model=str(export), seed=seed, trust_remote_code=True)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_what_is_not_implemented_is_refused_by_name(export):
    with pytest.raises(InvalidRequest, match="use_beam_search: vLLM's or OpenAI's, not implemented"):
        SamplingParams(use_beam_search=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: this engine accepts only 1"):
        LLM(model=str(export), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_model_len=1000"):
        LLM(model=str(export), max_model_len=1000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_device_this_machine_lacks_is_refused_before_anything_loads(tmp_path):
    from egmla.imports import load_pretrained

    for device, named in (("cuda", "CUDA is not available"), ("tpu", "expected cpu, cuda")):
        with pytest.raises(ValueError, match=f"device='{device}': .*{named}"):
            LLM(model=str(tmp_path / "never-loaded"), device=device)
        with pytest.raises(ValueError, match=f"device='{device}'"):
            load_pretrained(tmp_path / "never-loaded", device=device)


def test_the_cpu_device_is_where_everything_lives(export):
    from egmla.imports import load_pretrained

    model, _ = load_pretrained(export, device="cpu")
    assert model.tok_emb.weight.device.type == "cpu"
    llm = LLM(model=str(export), device="cpu", seed=0)
    assert llm.engine.device.type == "cpu" and llm.engine.cache.tensors()[0].device.type == "cpu"
    seeded = SamplingParams(max_tokens=4, seed=5)
    assert llm.engine.add_request([1, 2, 3], seeded) is not None  # a generator on the device
    assert llm.engine.sequence(0).generator.device.type == "cpu"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
def test_on_a_gpu_greedy_tokens_and_seeded_draws_match_the_cpus(export):
    """The weights, KV cache and generators on the GPU: greedy tokens as on the CPU (fp32),
    and seeded sampling reproducible there."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cpu = LLM(model=str(export), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    gpu_llm = LLM(model=str(export), dtype="float32", device="cuda")
    gpu = gpu_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    seeded = SamplingParams(max_tokens=12, seed=7)
    a, b = (gpu_llm.generate(PROMPTS, seeded, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_gpu_memory_utilization_sizes_the_pool_on_a_gpu_and_changes_nothing_elsewhere(export, caplog):
    """vLLM's share of device memory: the pool gets the share less what is held and an
    activation reserve; on a CPU (no share to take) a vLLM script's value is accepted, logged,
    and the pool is kv_cache_memory's as without it."""
    from serve.engine import kv_memory_for_share

    assert kv_memory_for_share(0.5, 80 * 2**30, 2**30, 2**29) == 40 * 2**30 - 2**30 - 2**29
    with pytest.raises(ValueError, match="leaves no room for a KV pool"):
        kv_memory_for_share(0.01, 8 * 2**30, 2**30, 0)
    for bad in (0, 1.5, "0.9", True):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization={bad!r}: must be a number"):
            LLM(model=str(export), gpu_memory_utilization=bad)
    if not torch.cuda.is_available():
        with caplog.at_level("INFO", logger="serve"):
            shared = LLM(model=str(export), gpu_memory_utilization=0.9, kv_cache_memory=2**20)
        plain = LLM(model=str(export), kv_cache_memory=2**20)
        assert shared.engine.config.num_blocks == plain.engine.config.num_blocks
        assert "gpu_memory_utilization=0.9 accepted on cpu" in caplog.text


def test_vllm_arguments_that_mean_nothing_here_are_accepted_and_others_refused_by_name(export, caplog):
    """tensor_parallel_size=1, pipeline_parallel_size=1, disable_log_stats, swap_space,
    trust_remote_code, enforce_eager, dtype="auto" and kv_cache_dtype="auto" (vLLM's spelling of
    cache_dtype) run as without them, each no-op logged once; a value that would need more than
    one device is a ValueError naming the argument; kv_cache_dtype="bfloat16" sets the cache's
    dtype."""
    with caplog.at_level("INFO", logger="serve"):
        llm = LLM(model=str(export), tensor_parallel_size=1, pipeline_parallel_size=1,
                  disable_log_stats=True, swap_space=4, enforce_eager=True, dtype="auto",
                  kv_cache_dtype="auto", trust_remote_code=True, num_blocks=16)
    for name in ("tensor_parallel_size=1", "pipeline_parallel_size=1", "disable_log_stats=True",
                 "swap_space=4", "trust_remote_code=True"):
        assert caplog.text.count(f"{name} accepted") == 1, name
    out = llm.generate("The king said", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    for bad, message in (({"tensor_parallel_size": 2}, "tensor_parallel_size=2: this engine accepts only 1"),
                         ({"swap_space": -1}, "swap_space=-1"),
                         ({"trust_remote_code": "yes"}, "trust_remote_code='yes': this engine "
                                                        "accepts only true or false"),
                         ({"kv_cache_dtype": "auto", "cache_dtype": "auto"}, "give one")):
        with pytest.raises(ValueError, match=message):
            LLM(model=str(export), **bad)
    bf16 = LLM(model=str(export), kv_cache_dtype="bfloat16", num_blocks=16)
    assert bf16.engine.cache.dtype == torch.bfloat16


def test_the_tokenizer_the_prompt_forms_and_chat_as_vllm_takes_them(export, llm):
    """get_tokenizer() has vLLM's common methods; tokenizer= takes a directory (or a known
    name) and is honoured, an unknown one refused by name (it was read as an encoding and
    raised LookupError at generate); TokensPrompt and TextPrompt (vllm.inputs' names) are
    prompts; chat takes vLLM's template arguments and returns the rendered prompt."""
    from serve import TextPrompt, TokensPrompt

    tok = llm.get_tokenizer()
    ids = tok.encode("The king said")
    assert tok.decode(ids) == "The king said" and isinstance(tok.eos_token_id, int)
    by_path = LLM(model=str(export), tokenizer=str(export), num_blocks=16)
    assert by_path.get_tokenizer().encode("The king said") == ids
    with pytest.raises(ValueError, match="tokenizer='no-such-tokenizer'"):
        LLM(model=str(export), tokenizer="no-such-tokenizer")
    greedy = SamplingParams(temperature=0, max_tokens=5)
    text, tokens = llm.generate([TextPrompt(prompt="The king said"),
                                 TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    assert text.prompt == "The king said" and tokens.prompt_token_ids == ids
    messages = [{"role": "user", "content": "Who art thou?"}]
    plain = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}{{ greeting }}{% endif %}")
    [own] = llm.chat(messages, greedy, use_tqdm=False, chat_template=plain,
                     chat_template_kwargs={"greeting": "bot:"})
    assert own.prompt == "user: Who art thou?\nbot:" and own.outputs[0].token_ids
    assert own.prompt_token_ids == tok.encode(own.prompt, add_special_tokens=False)
    continued = messages + [{"role": "assistant", "content": "I am"}]
    [more] = llm.chat(continued, greedy, use_tqdm=False, chat_template=plain,
                      add_generation_prompt=False, continue_final_message=True)
    assert more.prompt == "user: Who art thou?\nassistant: I am"  # left open, not closed
    with pytest.raises(InvalidRequest, match="choose one"):
        llm.chat(messages, greedy, chat_template=plain, continue_final_message=True)



def test_more_of_vllms_signatures_run_and_what_asks_for_more_is_refused(llm):
    """vLLM's fields and arguments at values that ask for nothing are accepted (a script passes
    them by habit); other values are refused by name. OpenAI's content parts reach the chat
    template as their texts joined by newlines, as vLLM's string content format does."""
    quiet = SamplingParams(temperature=0, max_tokens=4, detokenize=True,
                           include_stop_str_in_output=False, spaces_between_special_tokens=True,
                           length_penalty=1.0, best_of=None)
    assert quiet == SamplingParams(temperature=0, max_tokens=4)
    for field, value in (("include_stop_str_in_output", True), ("detokenize", False),
                         ("length_penalty", 2.0), ("use_beam_search", 0)):
        with pytest.raises(InvalidRequest, match=field):
            SamplingParams(**{field: value})
    copy = quiet.clone()
    assert copy == quiet and copy is not quiet and copy.stop is not None
    assert llm.get_default_sampling_params() == SamplingParams()
    [plain] = llm.generate("The king said", quiet, use_tqdm=False)
    [again] = llm.generate("The king said", quiet, use_tqdm=False, lora_request=None)
    assert plain.outputs[0].token_ids == again.outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="lora_request"):
        llm.generate("The king said", quiet, lora_request=object())
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who art"},
                                          {"type": "text", "text": "thou?"}]}]
    [joined] = llm.chat(parts, quiet, use_tqdm=False, chat_template=template,
                        chat_template_content_format="string", tools=None)
    assert joined.prompt == "user: Who art\nthou?\n"
    assert parts[0]["content"][0] == {"type": "text", "text": "Who art"}  # the caller's, untouched
    for kwargs, named in (({"chat_template_content_format": "openai"}, "content_format"),
                          ({"tools": [{"type": "function"}]}, "tools"),
                          ({"lora_request": object()}, "lora_request")):
        with pytest.raises(InvalidRequest, match=named):
            llm.chat(parts, quiet, chat_template=template, **kwargs)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[0\]: only parts of type 'text'"):
        llm.chat(image, quiet, chat_template=template)
