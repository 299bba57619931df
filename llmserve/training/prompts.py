"""Offline prompt and text sources: the Python standard library and a list of chat questions.

Nothing here imports the stdlib modules it reads: ``pkgutil`` lists them, ``importlib``
finds their files, and ``ast`` extracts functions and docstrings, so reading e.g.
``antigravity`` opens no browser. Everything is deterministic for a given Python version.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import sysconfig
import zlib
from typing import Iterator, Optional

# Modules not worth reading (tests, GUIs, generated tables, demos).
_SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                  "pydoc_data", "encodings", "unicodedata", "_")

CHAT_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion to a ten-year-old.",
    "How do I reverse a string in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for writing clean code.",
    "What is a hash table and why is lookup fast?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How does a binary search work?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a haiku about autumn rain.",
    "Explain what an API is in simple terms.",
    "What are the health benefits of regular exercise?",
    "How do vaccines train the immune system?",
    "What is the difference between weather and climate?",
    "Write a short email asking a colleague to review my pull request.",
    "How do I read a CSV file in Python?",
    "What is photosynthesis?",
    "Explain the difference between TCP and UDP.",
    "Give me a recipe for a simple tomato pasta.",
    "What does Big-O notation measure?",
    "Why is the sky blue?",
    "How do I create a virtual environment in Python?",
    "What is the Pythagorean theorem? Give an example.",
    "Write a limerick about a cat who loves coffee.",
    "Explain what a neural network is in one paragraph.",
    "What are some good habits for better sleep?",
    "How does compound interest work?",
    "What is the difference between HTTP and HTTPS?",
    "Explain the concept of supply and demand.",
    "How do I sort a dictionary by value in Python?",
    "What is a black hole?",
    "List five fruits that are rich in vitamin C.",
    "What is the purpose of a unit test?",
    "Explain Git branches to a beginner.",
    "Write a short motivational message for someone starting a new job.",
    "How does a refrigerator keep food cold?",
    "What is the difference between a process and a thread?",
    "Describe the water cycle.",
    "How can I improve my public speaking skills?",
    "What is a prime number? List the first ten.",
    "Explain the difference between 'affect' and 'effect'.",
    "What are Python decorators and when would I use one?",
    "How do airplanes stay in the air?",
    "Give me a packing list for a weekend camping trip.",
    "What is machine learning?",
    "How do I handle exceptions in Python?",
    "What is the tallest mountain in the world?",
    "Write a two-sentence horror story.",
    "Explain what DNS does when I type a website address.",
    "What is the difference between RAM and storage?",
    "How do I make a good cup of tea?",
    "What is a generator in Python and how is it different from a list?",
    "Why do we have leap years?",
    "Explain inflation in simple words.",
    "Give me three ideas for a birthday party for a seven-year-old.",
    "How do I count the words in a text file with Python?",
    "What were the main causes of World War I?",
    "How does a solar panel produce electricity?",
    "What is the difference between '==' and 'is' in Python?",
    "Suggest a name for a friendly robot and explain why.",
    "What is an operating system?",
    "How can I save money on groceries?",
    "Explain what a linked list is.",
    "What is the speed of light?",
    "Write a thank-you note to a teacher.",
    "How do I merge two dictionaries in Python?",
    "What is the greenhouse effect?",
    "Explain object-oriented programming in a few sentences.",
    "What should I consider when adopting a dog?",
    "How do I remove duplicates from a list while keeping the order?",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bill becomes a law in general terms.",
    "What is a SQL join? Give an example.",
    "Explain the Monty Hall problem.",
    "How do I write a for loop that counts down from ten?",
    "What is the role of the mitochondria in a cell?",
    "Give me a short workout I can do at home without equipment.",
    "Explain what JSON is and show a small example.",
    "Why do cats purr?",
    "What is the difference between a compiler and an interpreter?",
    "How do I find the largest number in a list without using max()?",
    "What is a haiku? Write one about the sea.",
    "How do noise-cancelling headphones work?",
    "Explain the difference between mean, median and mode.",
    "What is a regular expression? Show one that matches an email address.",
    "How do bees make honey?",
    "Write a Python function that checks whether a word is a palindrome.",
    "What are the planets of the solar system in order?",
    "Explain what recursion depth means in Python.",
    "How can I stay focused while studying?",
    "What is an index in a database and why does it help?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the difference between stack and heap memory?",
    "Explain what a closure is in Python with an example.",
    "Why does ice float on water?",
    "How do I measure how long a piece of Python code takes to run?",
    "What is the difference between a simile and a metaphor?",
    "Write a short story opening about a lighthouse keeper.",
    "How does public-key cryptography work, in simple terms?",
    "What is the Fibonacci sequence? Write code to print the first ten numbers.",
)


def stdlib_module_names() -> list[str]:
    """Sorted names of the pure-Python top-level stdlib modules and packages."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = {m.name for m in pkgutil.iter_modules([stdlib])}
    return sorted(n for n in names if not n.startswith(_SKIP_PREFIXES))


def _module_source(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_sources(max_modules: Optional[int] = None) -> Iterator[tuple[str, str]]:
    """(module name, source text) of stdlib modules, in name order."""
    count = 0
    for name in stdlib_module_names():
        src = _module_source(name)
        if src is None:
            continue
        yield name, src
        count += 1
        if max_modules is not None and count >= max_modules:
            return


def stdlib_functions(max_modules: Optional[int] = None, min_lines: int = 4,
                     max_lines: int = 40) -> Iterator[dict]:
    """Functions with docstrings from stdlib sources: {module, name, source, docstring}."""
    for module, src in stdlib_sources(max_modules):
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            n_lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if not doc or node.name.startswith("_") or not min_lines <= n_lines <= max_lines:
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            seg = "\n".join(line[indent:] for line in body)
            yield {"module": module, "name": node.name, "source": seg,
                   "docstring": doc.strip()}


def is_held_out(key: str, fraction: float) -> bool:
    """A stable split: crc32(key) decides whether ``key`` belongs to the held-out set."""
    return (zlib.crc32(key.encode()) % 10_000) < fraction * 10_000


def _head(text: str, max_lines: int) -> str:
    return "\n".join(text.splitlines()[:max_lines])


def code_prompts(fn: dict) -> list[dict]:
    """Prompts made from one stdlib function: a raw completion and two chat requests.

    Each prompt is {"kind": "completion", "text": ...} or {"kind": "chat", "messages": [...]}.
    """
    first = fn["docstring"].splitlines()[0]
    lines = fn["source"].splitlines()
    # The signature, the docstring and a line or two of body: the model continues the code.
    cut = min(len(lines), max(3, len(lines) // 3))
    completion = {"kind": "completion", "text": "\n".join(lines[:cut]) + "\n"}
    explain = {"kind": "chat", "messages": [{"role": "user", "content": (
        f"Explain what this Python function from the `{fn['module']}` module does:\n\n"
        f"```python\n{_head(fn['source'], 20)}\n```")}]}
    write = {"kind": "chat", "messages": [{"role": "user", "content": (
        f"Write a Python function `{fn['name']}` that does the following: {first}")}]}
    return [completion, explain, write]


def chat_prompts(questions=CHAT_QUESTIONS) -> list[dict]:
    """One single-turn chat prompt per question."""
    return [{"kind": "chat", "messages": [{"role": "user", "content": q}]} for q in questions]


def stdlib_corpus(max_modules: Optional[int] = None) -> Iterator[str]:
    """Raw stdlib source texts (a local corpus for training small models from scratch)."""
    for _, src in stdlib_sources(max_modules):
        yield src
