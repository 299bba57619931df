"""The speculative benchmark's prompts: the input-grounded workload (Python standard-library
functions to rewrite with type hints or with docstrings added, so the output copies much of the
input) and held-out chat questions; and how a batch's pairs are cut from them."""

from __future__ import annotations

import ast
import dataclasses
import zlib
from typing import Optional

HELD_OUT = 0.15  # configs/distill_draft.py eval_fraction: prompts the draft never trained on
GROUNDED, CHAT = "input-grounded", "chat"  # the two workloads' names (rows, JSON keys)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its token ids (chat template applied) and where it came from."""

    ids: tuple[int, ...]
    source: str
    held_out: bool = True
    function_tokens: Optional[int] = None  # input-grounded: the function's own length


def _function_node(source: str) -> Optional[ast.FunctionDef]:
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _annotated(node) -> bool:
    args = node.args
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg,
                                                                           args.kwarg) if a]
    return node.returns is not None or any(a.annotation is not None for a in every)


def without_docstring(source: str) -> Optional[str]:
    """The function's source with its own docstring removed (None if nothing would be left)."""
    node = _function_node(source)
    if node is None or len(node.body) < 2 or ast.get_docstring(node) is None:
        return None
    doc = node.body[0]
    if doc.lineno == node.lineno:  # "def f(): '''doc'''" on one line
        return None
    lines = source.splitlines()
    return "\n".join(lines[:doc.lineno - 1] + lines[doc.end_lineno:])


def rewrite_request(module: str, source: str, variant: str) -> str:
    """The user message: rewrite one stdlib function with type hints or a docstring added."""
    task = {"type hints": "with type hints added to its parameters and return value",
            "docstring": "with a docstring added that explains what it does, its arguments "
                         "and what it returns"}[variant]
    return (f"Here is a function from Python's `{module}` module. Rewrite it {task}."
            f"\n\n```python\n{source}\n```")


def grounded_prompts(cfg, tokenizer) -> list[Prompt]:
    """``num_grounded`` stdlib functions of ``grounded_tokens`` tokens, one per module (modules
    in crc32 order, functions in source order), alternating type hints / docstring requests."""
    from llmserve.training import prompts as prompt_lib

    lo, hi = cfg.grounded_tokens
    by_module: dict[str, list[dict]] = {}
    for fn in prompt_lib.stdlib_functions(min_lines=8, max_lines=150):
        by_module.setdefault(fn["module"], []).append(fn)
    out: list[Prompt] = []
    for module in sorted(by_module, key=lambda m: (zlib.crc32(m.encode()), m)):
        for fn in by_module[module]:
            variant = ("type hints", "docstring")[len(out) % 2]
            node = _function_node(fn["source"])
            if node is None or (variant == "type hints" and _annotated(node)):
                continue
            source = fn["source"] if variant == "type hints" else without_docstring(fn["source"])
            n = len(tokenizer.encode(source)) if source is not None else 0
            if not lo <= n <= hi:
                continue
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": rewrite_request(module, source, variant)}],
                add_generation_prompt=True)
            out.append(Prompt(tuple(tokenizer.encode(text)),
                              f"{module}.{fn['name']} ({variant})", function_tokens=n))
            break
        if len(out) == cfg.num_grounded:
            return out
    raise ValueError(f"only {len(out)} stdlib functions of {lo}-{hi} tokens; "
                     f"num_grounded={cfg.num_grounded}")


def chat_prompts(cfg, tokenizer, count: int) -> list[Prompt]:
    """Every chat question of <= max_chat_prompt_tokens tokens, the held-out ones first."""
    from llmserve.training import prompts as prompt_lib

    questions = sorted(prompt_lib.CHAT_QUESTIONS,
                       key=lambda q: not prompt_lib.is_held_out(q, HELD_OUT))
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text)
        if len(ids) <= cfg.max_chat_prompt_tokens:
            out.append(Prompt(tuple(ids), q, prompt_lib.is_held_out(q, HELD_OUT)))
    if len(out) < count:
        raise ValueError(f"only {len(out)} chat prompts of <= {cfg.max_chat_prompt_tokens} "
                         f"tokens; need {count}")
    return out


def groups(prompts: list[Prompt], batch: int, pairs: int) -> tuple[list[list[Prompt]], bool]:
    """The prompts of each pair, and whether every pair reuses one group.

    New prompts each pair while ``batch * pairs`` of them exist (only held-out ones for chat);
    otherwise the first ``batch`` prompts every time.
    """
    pool = [p for p in prompts if p.held_out]
    if batch * pairs <= len(pool):
        return [pool[i * batch:(i + 1) * batch] for i in range(pairs)], False
    return [prompts[:batch]] * pairs, True
