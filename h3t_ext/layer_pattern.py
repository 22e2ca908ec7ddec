"""Megatron-LM's per-layer patterns (``--window-attn-skip-freq``, ``--moe-layer-freq``): an integer N, or a Python
list expression of 0/1 entries such as ``[1,1,1,0]*3`` or ``([0]*1+[1]*45)``, which Megatron-LM evaluates. The one
reader of that syntax: lists, ``+`` of lists, ``*`` of a list by an integer and parentheses; nothing else is
evaluated."""
from __future__ import annotations

import ast
from typing import Union

MAX_PATTERN_ENTRIES = 1 << 16
"""Longest pattern evaluated (a model has far fewer layers; a longer one is refused, not built)."""

_PATTERN_NODES = (ast.Expression, ast.List, ast.Constant, ast.BinOp, ast.Add, ast.Mult, ast.Load)


def _evaluate(node: ast.AST):
    """Python list arithmetic of integer constants (``+`` of lists, ``*`` of a list by an integer)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add) and isinstance(a, list) and isinstance(b, list):
            return a + b
        if isinstance(node.op, ast.Mult) and {type(a), type(b)} == {list, int}:
            lst, n = (a, b) if isinstance(a, list) else (b, a)
            if len(lst) * max(n, 0) > MAX_PATTERN_ENTRIES:
                raise ValueError("too long")
            return lst * n
    raise ValueError(ast.dump(node))


def evaluate_pattern(text: str) -> Union[int, list]:
    """The integer or the list a pattern's text says; ValueError when it is neither (or anything else is in it)."""
    s = str(text).strip()
    if "[" not in s:
        return int(s)
    try:
        tree = ast.parse(s, mode="eval")
        if not all(isinstance(n, _PATTERN_NODES) for n in ast.walk(tree)):
            raise ValueError(s)
        return _evaluate(tree)
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(s) from None


__all__ = ["MAX_PATTERN_ENTRIES", "evaluate_pattern"]
