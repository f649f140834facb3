# The tests for solution.py: each top-level assert is one test (see `python -m sandbox --help`).
assert add(2, 3) == 5
assert add(-1, 1) == 0
assert median([3, 1, 2]) == 2
assert median([4, 1, 3, 2]) == 2.5
