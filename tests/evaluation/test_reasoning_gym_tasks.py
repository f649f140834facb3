"""The offline reasoning-gym tasks (eval/tasks/reasoning_gym): fixed data, reasoning-gym's own
scoring, and lm-eval resolving and running them through the egmla adapter."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from support import ROOT

TASKS = ROOT / "eval" / "tasks"
# The first problem of each family under seed 42: a different one means the data changed.
FIRST = {
    "basic_arithmetic": ("Calculate -5 * -6.", "30"),
    "chain_sum": ("State the final answer to the following arithmetic problem: 4 + 3 =", "7"),
    "simple_equations": ("Find the value of u in the equation: 32*u + 4 = 3044", "95"),
    "leg_counting": (("Your task is to count how many legs there are in total when given a list "
                      "of animals.\n\nNow, how many legs are there in total if you have 3 sea "
                      "slugs, 12 deers, 2 giraffes, 11 elephants?\n"), "100"),
    "letter_counting": (('How many times does the letter "a" appear in the text: "bed and enters '
                         'his mechanical dresser Two minutes later the machine deposited him all '
                         'dressed"?'), "6"),
}
FAMILIES = sorted(FIRST)


def load_utils():
    spec = importlib.util.spec_from_file_location("rg_task_utils", TASKS / "reasoning_gym" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


utils = load_utils()


def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    return {f: list(utils.load(family=f, seed=42, size=100)["test"]) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_data_is_fixed(family, docs):
    again = list(utils.load(family=family, seed=42, size=100, version=1.0)["test"])
    assert again == docs[family]  # metadata kwargs from lm-eval are ignored, the rest is seeded
    assert len(docs[family]) == 100
    first = docs[family][0]
    assert (first["question"], first["answer"]) == FIRST[family]
    assert [d["index"] for d in docs[family]] == list(range(100))
    for doc in docs[family]:
        entry = json.loads(doc["entry"])
        assert doc["question"].strip() and doc["answer"].strip()
        assert (entry["question"], entry["answer"]) == (doc["question"], doc["answer"])
        assert entry["metadata"]["source_dataset"] == family


@pytest.mark.parametrize("family", FAMILIES)
def test_own_answer_scores_one_and_a_wrong_one_less(family, docs):
    for doc in docs[family]:
        answer = doc["answer"]
        for generation in (answer, f" {answer}", f"Answer: {answer}", f"\n answer:{answer}\nAnd so on."):
            assert utils.process_results(doc, [generation]) == {"score": 1.0, "exact_match": 1.0}
        # A digit appended makes every answer wrong; reasoning-gym may give partial credit.
        for wrong in (answer + "1", f"Answer: {answer}1\n{answer}", "", "\n\n"):
            scored = utils.process_results(doc, [wrong])
            assert scored["score"] < 1 and scored["exact_match"] == 0, (wrong, scored)


def test_extract_answer():
    assert utils.extract_answer(" 30") == "30"
    assert utils.extract_answer("\n  \nAnswer: -12.5\nBecause 5 * 2.5") == "-12.5"
    assert utils.extract_answer("ANSWER: two words") == "two words"
    assert utils.extract_answer("Answer:\n42") == "42"
    assert utils.extract_answer("") is None and utils.extract_answer("Answer:") is None


def test_a_doc_from_other_data_is_refused(docs):
    doc = {**docs["chain_sum"][0], "question": "What is 1 + 1?"}
    with pytest.raises(ValueError, match="reasoning-gym version"):
        utils.process_results(doc, ["7"])


def test_missing_package_names_the_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "reasoning_gym" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"pip install reasoning-gym==0\.1\.25"):
        utils.load(family="chain_sum", seed=7, size=3)  # a size not cached yet


def test_another_version_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.26")
    with pytest.raises(ImportError, match=r"reasoning-gym 0\.1\.26 is installed.*0\.1\.25"):
        utils.load(family="chain_sum", seed=7, size=4)


def test_tasks_resolve_by_name_and_tag():
    manager = task_manager()
    names = [f"rg_{f}" for f in FAMILIES]
    assert set(names) <= set(manager.all_tasks)
    assert not [t for t in manager.all_tasks if t.startswith("_")]  # the base YAML is no task
    by_tag = manager.load(["egmla_reasoning_gym"])["tasks"]
    assert sorted(by_tag) == names
    by_name = manager.load(["rg_chain_sum"])["tasks"]
    assert list(by_name) == ["rg_chain_sum"]
    for name, task in by_tag.items():
        assert task.config.output_type == "generate_until"
        assert task.config.dataset_kwargs == {"family": name[3:], "seed": 42, "size": 100}
        kwargs = task.config.generation_kwargs
        assert kwargs["do_sample"] is False and kwargs["max_gen_toks"] <= 64
        docs = list(task.test_docs())
        assert len(docs) == 100
        prompt = task.doc_to_text(docs[0])
        assert prompt == f"Question: {FIRST[name[3:]][0].strip()}\nAnswer:"


@pytest.fixture(scope="module")
def lm(smollm2_llm):
    from eval.adapter import EgmlaLM

    return EgmlaLM(smollm2_llm, batch_size=4)


@pytest.mark.slow
def test_tasks_run_through_the_adapter(lm):
    import lm_eval

    tasks = ["rg_chain_sum", "rg_letter_counting"]
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(), limit=2,
                                  log_samples=True)
    for name in tasks:
        result = out["results"][name]
        assert 0 <= result["score,none"] <= 1 and 0 <= result["exact_match,none"] <= 1
        samples = out["samples"][name]
        assert sorted(s["doc_id"] for s in samples) == [0, 1]
        for sample in samples:
            response = sample["resps"][0][0]
            assert isinstance(response, str)
            rescored = utils.process_results(sample["doc"], [response])
            assert (sample["score"], sample["exact_match"]) == (rescored["score"],
                                                                rescored["exact_match"])
        mean = sum(s["score"] for s in samples) / len(samples)
        assert result["score,none"] == pytest.approx(mean)
