"""Reference check: SmolLM2-135M-Instruct through `--model egmla` and through lm-eval's own `hf`
model (transformers, the same GGUF file) on the offline tasks, with a limit. Multiple-choice
accuracy must be identical and every loglikelihood within 1e-3."""

from __future__ import annotations

import pytest

from egmla.imports import KNOWN_MODELS
from eval.adapter import EgmlaLM
from support import ROOT

LIMITS = {"mqar_recall": 8, "corpus_cloze": 8, "corpus_perplexity": 2}


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    """(doc_id, request index) -> the loglikelihood lm-eval logged (first of (ll, is_greedy))."""
    out = {}
    for sample in samples:
        for r, resp in enumerate(sample["resps"]):
            value = resp[0]
            out[sample["doc_id"], r] = float(value[0] if isinstance(value, (list, tuple)) else value)
    return out


@pytest.fixture(scope="module")
def both(smollm2_llm):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from eval.local_tasks import install

    install()
    gguf = KNOWN_MODELS["SmolLM2-135M-Instruct"].path()
    hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32", device="cpu",
              batch_size=8)
    ours = EgmlaLM(smollm2_llm, batch_size=8)
    manager = TaskManager(include_path=str(ROOT / "eval" / "tasks"), include_defaults=False)
    results = {}
    for name, model in [("egmla", ours), ("hf", hf)]:
        results[name] = {task: lm_eval.simple_evaluate(
            model=model, tasks=[task], task_manager=manager, limit=limit, log_samples=True)
            for task, limit in LIMITS.items()}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("task", ["mqar_recall", "corpus_cloze"])
def test_multiple_choice_accuracy_is_identical_to_the_hf_model(both, task):
    ours, ref = (both[m][task]["results"][task] for m in ("egmla", "hf"))
    metrics = [k for k in ref if k.startswith("acc")]
    assert metrics and "acc,none" in metrics
    assert {k: ours[k] for k in metrics} == {k: ref[k] for k in metrics}
    assert ours["sample_len"] == ref["sample_len"] == LIMITS[task]


@pytest.mark.slow
@pytest.mark.parametrize("task", list(LIMITS))
def test_loglikelihoods_within_1e_3_of_the_hf_model(both, task):
    ours = loglikelihoods(both["egmla"][task]["samples"][task])
    ref = loglikelihoods(both["hf"][task]["samples"][task])
    assert ours.keys() == ref.keys() and len(ours) >= LIMITS[task]
    worst = max(abs(ours[k] - ref[k]) for k in ref)
    assert worst < 1e-3, f"{task}: max |loglikelihood difference| {worst:.2e}"
