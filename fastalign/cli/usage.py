"""argparse's usage errors (an unknown choice, a flag without its value) as fastalign's one line, and
each objective's configuration keys as text (``fastalign train <objective> --help``) and Markdown."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import typing


def one_line_usage_errors(parser: argparse.ArgumentParser, command: str | None) -> None:
    """Make ``parser`` report a usage error as one ``error: fastalign <command>: ...`` line (exit 2),
    not argparse's usage text; ``command`` None is the top-level ``fastalign`` parser."""
    prefix = "fastalign" if command is None else f"fastalign {command}"

    def error(message: str) -> typing.NoReturn:
        print(f"error: {prefix}: {message} (see {prefix} --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = error


def objective_groups(name: str) -> list[tuple[str, list]]:
    """(title, ``KeyDoc``s) of the keys objective ``name`` reads: the general ones by their section of
    ``TrainConfig``, then the objective's own; keys only other objectives read are left out."""
    from fastalign.train.config.docs import key_docs
    from fastalign.train.objectives import OBJECTIVES, own_keys

    anyones = frozenset().union(*(own_keys(other) for other in OBJECTIVES))
    own = own_keys(name)
    groups: dict[str, list] = {}
    for doc in key_docs().values():
        if doc.name not in anyones:
            groups.setdefault(doc.section, []).append(doc)
    own_docs = [doc for doc in key_docs().values() if doc.name in own]
    return list(groups.items()) + ([(f"{name}'s own", own_docs)] if own_docs else [])


def _default(value: object) -> str:
    """A default as it is written in YAML or on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{', '.join(map(str, value))}]"
    return str(value)


def objective_help(name: str, width: int | None = None) -> str:
    """``fastalign train <name> --help``: the objective's keys with type, default and doc, grouped."""
    width = width or min(shutil.get_terminal_size().columns, 110)
    intro = (
        "Keys go in the YAML config or on the command line (--key value, --key=value); a flag wins over the "
        "file. Types: lists as a, b or [a, b]; mappings as JSON; None as none or null."
    )
    lines = [
        f"usage: fastalign train {name} [--config FILE] [--KEY VALUE ...]",
        "",
        *textwrap.wrap(intro, width),
    ]
    for title, docs in objective_groups(name):
        lines += ["", f"{title}:"]
        for doc in docs:
            lines.append(f"  --{doc.name} {doc.type} (default: {_default(doc.default)})")
            lines += textwrap.wrap(doc.doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def objective_markdown(name: str) -> str:
    """The keys of ``objective_help`` as Markdown (a docs page per objective): a table per group."""
    lines = [f"# `fastalign train {name}`", ""]
    for title, docs in objective_groups(name):
        lines += [f"## {title}", "", "| key | type | default | what |", "| --- | --- | --- | --- |"]
        for doc in docs:
            cells = (f"`{doc.name}`", f"`{doc.type}`", f"`{_default(doc.default)}`", doc.doc)
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)
