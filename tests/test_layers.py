"""The layer rule of docs/architecture.md, checked on the source: every ``fastalign`` import (module level or
inside a function) looks down. ``kernels`` ← ``ops`` ← ``losses`` ← (``patching`` ← ``integrations``,
``train``) ← ``cli``, with the floors ``models`` (model structure, streaming loader), ``builtin`` (tiny
offline models and data), ``errors`` and ``sampling`` (the rollout engine) below whatever uses them;
``plan`` beside, used by ``train`` and ``cli``, reading ``ops``' head workspace rule."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastalign"
#: What each subpackage may import from fastalign ("fastalign": the top-level API, e.g. patch_model).
ALLOWED = {
    "kernels": set(),
    "errors": set(),
    "models": set(),
    "builtin": set(),
    "ops": {"kernels"},
    "losses": {"ops", "models"},
    "data": {"errors", "models"},
    "patching": {"errors", "ops", "models"},
    "integrations": {"ops", "patching", "sampling"},  # patching: trl.patch_model; sampling: serve_generate
    "sampling": {"models"},
    "quant": {"ops", "models"},
    "plan": {"builtin", "errors", "models", "ops"},  # ops: the heads' workspace rule, as kernels'
    "bench": set(),
    "train": {
        "fastalign",
        "builtin",
        "data",
        "errors",
        "losses",
        "models",
        "ops",
        "patching",
        "plan",
        "quant",
        "sampling",
    },
    "cli": {"fastalign", "bench", "builtin", "errors", "ops", "plan", "train", "data", "models", "quant"},
    "__init__": {"ops", "patching"},
    "__main__": {"cli"},
}


def _imports(path: Path) -> set[str]:
    """The fastalign subpackages (or "fastalign" itself) that a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "fastalign":
                found.add(parts[1] if len(parts) > 1 else "fastalign")
    return found


def test_every_import_looks_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        layer = relative.parts[0].removesuffix(".py")
        assert layer in ALLOWED, f"{relative}: a new layer; place it in tests/test_layers.py's ALLOWED"
        upward += [f"{relative} imports {other}" for other in _imports(path) - ALLOWED[layer] - {layer}]
    assert not upward, upward
