"""Every ``head_fn`` the trainer hands a patched model passes the model's final-logit softcap on.

The patched forward gives a head_fn ``softcap=`` (Gemma-2's ``final_logit_softcapping``) and refuses one
without that parameter, so a head that drops the parameter fails the Gemma-2 runs at once; one that takes
it and does not pass it on would score another model's logits silently. The TRL comparisons on a capped
Gemma-2 cover DPO, WPO, KTO, GRPO, RLOO and distillation; this covers every head by reading the code:
each nested ``def head(hidden, weight, bias, softcap=None)`` uses ``softcap`` in its body."""

from __future__ import annotations

import ast
from pathlib import Path

import fastalign

TRAIN = Path(fastalign.__file__).parent / "train"


def heads() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "head":
                found.append((f"{path.relative_to(TRAIN.parent)}:{node.lineno}", node))
    return found


def head_fn_values() -> list[tuple[str, ast.expr]]:
    """Every ``head_fn=`` keyword the trainer passes, and where."""
    found = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "head_fn":
                found.append((f"{path.relative_to(TRAIN.parent)}:{node.value.lineno}", node.value))
    return found


def test_every_head_fn_is_a_nested_head():
    """What the next test reads is all there is: each ``head_fn=`` is a local ``head`` or the distill
    teacher's ``self._teacher_head(...)``, whose inner function is a ``head`` too (a lambda or another
    name would escape it: name it ``head``)."""
    values = head_fn_values()
    assert len(values) >= 7, values
    for where, value in values:
        teacher = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "_teacher_head"
        )
        assert (isinstance(value, ast.Name) and value.id == "head") or teacher, where


def test_every_head_fn_takes_the_softcap_and_uses_it():
    found = heads()
    assert len(found) >= 8, found  # dpo, kto, online, online_dpo, distill (3), teacher_logprobs
    for where, node in found:
        assert [arg.arg for arg in node.args.args] == ["hidden", "weight", "bias", "softcap"], where
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert "softcap" in used, f"{where}: takes softcap and drops it"
