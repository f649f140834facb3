"""A program to judge: the README's `python -m sandbox` example runs it against tests.py."""


def add(a, b):
    return a + b


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
