"""A code-editing set: a given function and a request to change one thing in it (the answer copies most of the
function, as real edits do). Written for the n-gram lookup benchmark (bench.lookup); eight cases."""

from __future__ import annotations

CASES: list[tuple[str, str]] = [
    ('''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
''', "Make it return 0.0 for an empty list instead of dividing by zero."),
    ('''def read_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
''', "Rename the variable `settings` to `config`."),
    ('''def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None
''', "Make the name comparison case-insensitive."),
    ('''def fibonacci(n):
    a, b = 0, 1
    result = []
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result
''', "Add a docstring that explains what the function returns."),
    ('''def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
''', "Add type hints for lists of integers."),
    ('''def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts
''', "Strip punctuation from each word before counting it."),
    ('''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0
''', "Add a `peek` method that returns the top item without removing it."),
    ('''def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
''', "Raise a ValueError when low is greater than high."),
]


def code_edit_messages() -> list[list[dict[str, str]]]:
    """Each case as a one-message chat: the function in a code block, then the request."""
    return [[{"role": "user", "content": f"Here is a Python function:\n\n```python\n{code}```\n\n{request} Reply with the "
              "whole changed code."}] for code, request in CASES]
