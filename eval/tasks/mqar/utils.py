"""MQAR recall in words: the text form of Zoology's multi-query associative recall.

A document lists `num_pairs` key-value pairs, then queries some keys that were already answered
(the "multi-query" part) and ends on one more query. The model must pick that key's value among
all values of the document; chance is 1 / num_pairs. The token-level MQAR used for training is
`egmla.data.mqar`; this task asks the same question of any lm-eval model, whatever its tokenizer.

Worked example with 3 pairs and 1 earlier query (real documents use 16 pairs, 4 queries):

    Remember these pairs.
    lamp: 41
    river: 17
    stone: 83
    river: 17
    lamp:                 choices " 41", " 17", " 83"; the answer is " 41"
"""

from __future__ import annotations

import random

KEYS = (
    "apple bell bird boat book bread brick cake candle chair cloud coat corn cup desk door drum "
    "egg fish flag flower fork frog glass goat hat horse house key kite lamp leaf lion map milk "
    "moon mouse nail nest net owl pan pear pen pig pipe plate queen ring river road rope salt "
    "sheep ship shoe sock spoon star stone sun table tent tree wall wheel"
).split()


def mqar_items(size: int = 500, num_pairs: int = 16, num_queries: int = 4, seed: int = 0) -> list[dict]:
    """`size` documents, the same for a given seed; keys and values are distinct within one."""
    if not 1 <= num_pairs <= min(len(KEYS), 90):
        raise ValueError(f"num_pairs={num_pairs}: must be in [1, {min(len(KEYS), 90)}]")
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"num_queries={num_queries}: must be in [1, num_pairs={num_pairs}]")
    rng = random.Random(seed)
    items = []
    for _ in range(size):
        keys = rng.sample(KEYS, num_pairs)
        values = [str(v) for v in rng.sample(range(10, 100), num_pairs)]
        queried = rng.sample(range(num_pairs), num_queries)  # the last one is scored
        lines = [f"{keys[i]}: {values[i]}" for i in range(num_pairs)]
        lines += [f"{keys[i]}: {values[i]}" for i in queried[:-1]]
        target = queried[-1]
        items.append({"context": "Remember these pairs.\n" + "\n".join(lines) + f"\n{keys[target]}:",
                      "choices": [f" {v}" for v in values], "label": target})
    return items


def load(size: int = 500, num_pairs: int = 16, num_queries: int = 4, seed: int = 0, **_kwargs):
    """{"test": rows with `context`, `choices` and `label`}."""
    import datasets

    rows = mqar_items(size, num_pairs, num_queries, seed)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
