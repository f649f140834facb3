"""The offline task data (eval/tasks/corpus, eval/tasks/mqar) and the suites' composition."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from egmla.data.corpus import split_corpus
from support import ROOT

TASKS = ROOT / "eval" / "tasks"
PAPER = ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "social_iqa", "mmlu"]


def task_utils(folder: str):
    """A task folder's utils.py, loaded by path as lm-eval's `!function` does."""
    spec = importlib.util.spec_from_file_location(f"{folder}_utils", TASKS / folder / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_yaml(path: Path) -> dict:
    """A task YAML without lm-eval's `!function` tags resolved."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(path.read_text(), Loader=Loader)


def test_mqar_documents_ask_for_a_value_that_was_given():
    mqar = task_utils("mqar")
    items = mqar.mqar_items(size=50, num_pairs=16, num_queries=4, seed=0)
    assert items == mqar.mqar_items(size=50, num_pairs=16, num_queries=4, seed=0)  # seeded
    assert items != mqar.mqar_items(size=50, num_pairs=16, num_queries=4, seed=1)
    for item in items:
        lines = item["context"].split("\n")
        assert lines[0] == "Remember these pairs."
        pairs = dict(line.split(": ") for line in lines[1:17])
        assert len(pairs) == 16 and len(set(pairs.values())) == 16  # distinct keys and values
        answered = lines[17:20]  # three earlier queries, answered correctly
        assert all(pairs[k] == v for k, v in (line.split(": ") for line in answered))
        key = lines[20].removesuffix(":")
        assert item["choices"] == [f" {v}" for v in pairs.values()]
        assert item["choices"][item["label"]] == f" {pairs[key]}"
        assert key not in (line.split(": ")[0] for line in answered)  # a fresh query
    with pytest.raises(ValueError, match="num_queries=17"):
        mqar.mqar_items(size=1, num_pairs=16, num_queries=17)


def test_cloze_answer_is_the_true_next_held_out_line():
    cloze = task_utils("corpus")
    items = cloze.cloze_items(size=100, seed=0)
    assert items == cloze.cloze_items(size=100, seed=0)
    held_out = cloze._held_out()  # (source, text)
    assert [text for _, text in held_out] == split_corpus(0.05)[1]
    for item in items:
        answer = item["choices"][item["label"]]
        home = [s for s, text in held_out if item["context"] + answer + "\n" in text]
        assert home == [item["source"]]  # the true continuation, in exactly one text
        assert len(set(item["choices"])) == 4 and item["context"].endswith("\n")
        for wrong in item["choices"]:
            if wrong != answer:  # a whole line of another text of the same source
                lines = [text.split("\n") for s, text in held_out if s == item["source"]
                         and item["context"] not in text]
                assert any(wrong in text_lines for text_lines in lines)
    assert {item["source"] for item in items} == {"kjv", "shakespeare"}


def test_perplexity_documents_are_the_training_validation_split():
    corpus = task_utils("corpus")
    assert corpus.load_perplexity()["test"]["text"] == split_corpus(0.05)[1]
    scores = corpus.perplexity_results({"text": "Thou art  a villain."}, [-7.5])
    assert scores == {"word_perplexity": (-7.5, 4), "byte_perplexity": (-7.5, 20),
                      "bits_per_byte": (-7.5, 20)}


def test_offline_suite_composes_and_loads_with_no_hub():
    from lm_eval.tasks import TaskManager

    from eval.local_tasks import install

    install()
    loaded = TaskManager(include_path=str(TASKS), include_defaults=False).load("egmla_offline")
    assert set(loaded["tasks"]) == {
        "gsm8k_offline", "corpus_perplexity", "corpus_cloze", "mqar_recall", "rg_basic_arithmetic",
        "rg_chain_sum", "rg_leg_counting", "rg_letter_counting", "rg_simple_equations"}
    assert all(task.eval_docs for task in loaded["tasks"].values())  # data is there, offline


def test_paper_suite_composes_from_lm_evals_own_tasks():
    """The data needs the hub; here the group must only name tasks lm-eval knows."""
    from lm_eval.tasks import TaskManager

    group = load_yaml(TASKS / "egmla_paper.yaml")
    assert group["group"] == "egmla_paper" and group["task"] == PAPER
    manager = TaskManager(include_path=str(TASKS))
    assert "egmla_paper" in manager.all_groups
    assert set(PAPER) <= set(manager.all_tasks)


def test_the_scripts_task_list_is_the_group_lm_eval_loads():
    """The studies and benchmarks read their task list from the group YAML (no list kept by
    hand): what they read is what lm-eval composes for the group, in the YAML's order."""
    from lm_eval.tasks import TaskManager

    from eval.local_tasks import group_tasks, install

    install()
    tasks = group_tasks("egmla_loglikelihood")
    assert tasks == ("corpus_cloze", "corpus_perplexity", "mqar_recall")
    loaded = TaskManager(include_path=str(TASKS), include_defaults=False).load("egmla_loglikelihood")
    assert set(loaded["tasks"]) == set(tasks)
    with pytest.raises(ValueError, match="no lm-eval group 'nope'"):
        group_tasks("nope")
