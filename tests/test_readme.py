"""The README is what a new user types: its commands are CI's, and its example runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    first = commands(code_blocks("bash")[0])
    assert len(first) == 2
    assert "train.py experiment=quickstart" in first[0] and "pytest" in first[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert first[1] in ci


def test_readme_commands_name_files_that_exist():
    """No placeholders: every Python file a command names is in the repository."""
    named = {token for block in code_blocks("bash") for line in commands(block)
             for token in line.split() if token.endswith(".py")}
    assert "train.py" in named and "examples/sandbox/solution.py" in named
    assert [name for name in sorted(named) if not (ROOT / name).is_file()] == []


def test_readme_sandbox_example_runs_as_written():
    import subprocess
    import sys

    line = next(line for block in code_blocks("bash") for line in commands(block.replace("\\\n", " "))
                if " -m sandbox " in line)
    run = subprocess.run([sys.executable, *line.split()[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and '"status": "passed"' in run.stdout, run.stdout + run.stderr


def test_readme_python_example_runs(capsys):
    exec(compile(code_blocks("python")[0], "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_readme_quotes_the_studys_record():
    """The study's figures in the README are the committed record's (benchmarks/results/study),
    rounded as quoted: a re-run that moves them fails here until the README says so too."""
    import json

    from studies.gating import mqar_mean

    arms = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())["arms"]
    section = README.split("## What the gate buys")[1].split("\n## ")[0]

    def quoted(arm: str, against: str) -> str:
        d = arms[arm]["paired_differences"][against]
        return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    kv = arms["egmla_kv"]["paired_differences"]
    dc32, matched = kv["mla_dc32"], kv["mla_param_matched"]
    assert f"{-dc32['mean']:.3f} nats/token below MLA" in section
    assert f"[{dc32['low']:.3f}, {dc32['high']:.3f}]" in section
    assert f"{-matched['mean']:.3f} below MLA with the FFN widened" in section
    assert f"[{matched['low']:.3f}, {matched['high']:.3f}]" in section
    comparisons = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())["comparisons"]
    holm = {(c["family"], c["arm"], c["against"]): c["p_holm"] for c in comparisons}
    flat = " ".join(section.split())
    assert (f"Holm-adjusted within that family, p = {holm['headline', 'egmla_kv', 'mla_dc32']:.3f} and "
            f"{holm['headline', 'egmla_kv', 'mla_param_matched']:.3f}") in flat
    sizes = {c["family"]: c["family_size"] for c in comparisons}
    assert (f"all {sizes['baselines']} comparisons with a baseline, "
            f"{holm['baselines', 'egmla_kv', 'mla_dc32']:.3f} and "
            f"{holm['baselines', 'egmla_kv', 'mla_param_matched']:.3f}") in flat
    contrast = {(c["family"], c["arm"], c["against"]): c for c in comparisons}
    gated = [contrast["token_identity", a, b] for a, b in (("egmla_kv", "mla_kv_embed"),
                                                           ("egmla_v_gate", "mla_value_embed"))]
    assert (f"{-gated[0]['mean']:.3f} lower ([{gated[0]['low']:.3f}, {gated[0]['high']:.3f}]); "
            f"the gate on V only is {-gated[1]['mean']:.3f} lower") in flat
    assert (f"over the {sizes['token_identity']} token-identity contrasts, p = "
            f"{gated[0]['p_holm']:.3f} and {gated[1]['p_holm']:.3f}") in flat.replace("five", "5")
    assert all(c["p_holm"] < 0.05 for c in gated)  # "multiplying it in beat adding it"
    placed = contrast["placement_post_hoc", "egmla_kv", "egmla_v_gate"]
    assert (f"within {abs(placed['mean']):.3f} of the gate on K and V "
            f"([{placed['low']:+.3f}, {placed['high']:+.3f}]") in flat
    assert not placed["distinguishable_from_zero"]  # "no difference detectable"
    assert quoted("egmla_const_gate", "mla_dc32") in section
    assert quoted("egmla_hidden_gate", "mla_dc32") in section
    const, latent = (contrast["token_identity", a, b] for a, b in (
        ("egmla_kv", "egmla_const_gate"), ("egmla_latent", "egmla_hidden_gate")))
    assert (f"`egmla_kv` is {-const['mean']:.3f} below it ([{const['low']:.3f}, {const['high']:.3f}]; "
            f"Holm-adjusted p = {const['p_holm']:.3f})") in flat and const["p_holm"] < 0.05
    assert (f"not shown to beat it directly ({latent['mean']:+.3f} [{latent['low']:+.3f}, "
            f"{latent['high']:+.3f}])") in flat and not latent["distinguishable_from_zero"]
    assert all(len(arm["val_loss_by_seed"]) >= 3 for arm in arms.values()
               if arm["what"] != "ablation of egmla_kv")  # "three seeds"
    long = {name: arm["long"][0]["val_loss"] for name, arm in arms.items() if arm["long"]}
    for arm in ("egmla_kv", "mla_value_embed"):
        assert f"({long[arm] - long['mla_dc32']:+.3f}" in section.replace("\n  ", " ")
    recall = {name: sorted(mqar_mean(a) for a in arm["mqar_accuracy_by_seed"].values())
              for name, arm in arms.items() if arm["mqar_accuracy_by_seed"]}
    kv = recall.pop("egmla_kv")
    assert f"(recall {kv[2]:.2f} and {kv[1]:.2f})" in section and kv[0] < 0.5 < kv[1]
    others = [r for seeds in recall.values() for r in seeds]
    assert len(others) == 27 and f"(at most {max(others):.2f})" in section and max(others) < 0.5
