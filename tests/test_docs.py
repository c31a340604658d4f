"""The README and ``docs/`` stay true: every relative link (and its anchor) resolves, the README's quick
start runs as written (on tiny shapes), and the generated option pages equal what the code generates."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`+[^`\n]*`+")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file has: its headings' slugs (repeats numbered as GitHub does) and
    explicit ``<a id=...>`` anchors."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = _slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links whose file (or anchor, in a Markdown file) does not exist."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such anchor)")
    return broken


def test_the_link_checker_finds_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Title: `x`\n\n## Other one\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#title-x) [ok](#top) [web](https://example.com)\n\n# Top\n\n"
        "[bad](c.md) [bad](b.md#nope) `[code](not-a-link.md)`\n\n```\n[code](fenced.md)\n```\n"
    )
    assert broken_links(page) == ["c.md (no such file)", "b.md#nope (no such anchor)"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: {broken_links(page)}"


def test_the_readme_keeps_its_set_up_commands_and_stays_short():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text and "pip install -e ." in text
    assert len(text.splitlines()) <= 150


# --- the quick start ---------------------------------------------------------------------------------

_QUICKSTART = re.compile(r"<!-- quickstart -->(.*?)<!-- /quickstart -->", re.S)
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
#: What the test adds to each training command: one step, into the test's directory.
_TINY = ["--max_steps", "1"]


def quickstart() -> tuple[list[list[str]], list[str]]:
    """The README quick start's shell commands (as argv lists, ``source`` lines left out) and Python
    snippets."""
    (section,) = _QUICKSTART.findall(README.read_text(encoding="utf-8"))
    commands, snippets = [], []
    for language, body in _BLOCK.findall(section):
        if language == "python":
            snippets.append(body)
            continue
        assert language in ("bash", "sh", "shell"), language
        for line in body.splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] not in ("source", "."):
                commands.append(argv)
    return commands, snippets


@pytest.mark.slow
def test_the_readme_quick_start_runs(tmp_path, monkeypatch, capsys):
    """Each ``fastalign`` command of the quick start, run as ``python -m fastalign`` runs it (its
    ``main``, in this process, to import the models once), from a directory holding ``examples/``,
    training one step into a fresh ``output_dir``; then the Python snippet."""
    from fastalign.cli.main import main

    commands, snippets = quickstart()
    objectives = {argv[2] for argv in commands if argv[1:2] == ["train"]}
    assert {"sft", "dpo", "grpo"} <= objectives, commands
    assert snippets and any("patch_model" in snippet for snippet in snippets)

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for number, argv in enumerate(commands):
        assert Path(argv[0]).name == "fastalign", f"not a fastalign command: {shlex.join(argv)}"
        args = argv[1:]
        if args[0] == "train" and "--help" not in args and "-h" not in args:
            args += [*_TINY, "--output_dir", str(tmp_path / f"run{number}")]
        assert main(args) == 0, f"{shlex.join(argv)}: {capsys.readouterr().err[-2000:]}"
        if args[0] == "train" and "--help" not in args:
            assert (tmp_path / f"run{number}" / "metrics.jsonl").is_file(), shlex.join(argv)
    for snippet in snippets:
        exec(compile(snippet, "README.md quick start", "exec"), {"__name__": "__readme__"})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["orpo", "simpo", "cpo"])
def test_the_dpo_example_trains_the_reference_free_objectives_it_names(name, tmp_path, capsys):
    """examples/dpo_tiny.yaml and docs/objectives.md say the file also trains these (its loss_type:
    sigmoid, which orpo and simpo do not read, was refused)."""
    from fastalign.cli.main import main

    example = ROOT / "examples" / "dpo_tiny.yaml"
    assert f"{name}" in example.read_text().splitlines()[3]
    args = ["train", name, "--config", str(example), *_TINY, "--output_dir", str(tmp_path / name)]
    assert main(args) == 0, capsys.readouterr().err[-2000:]


# --- the generated pages -----------------------------------------------------------------------------


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_option_pages_are_current():
    """``docs/options/`` is exactly what ``scripts/gen_docs.py`` writes from the code: no page stale,
    missing or left over (run ``python scripts/gen_docs.py`` after changing a key)."""
    gen_docs = _gen_docs()
    pages = gen_docs.pages()
    stale = [
        str(p.relative_to(ROOT)) for p, text in pages.items() if not p.is_file() or p.read_text() != text
    ]
    extra = [str(p.relative_to(ROOT)) for p in gen_docs.OPTIONS.glob("*.md") if p not in pages]
    assert not stale and not extra, f"stale: {stale}, not generated: {extra} (run python scripts/gen_docs.py)"


def test_every_objective_has_an_option_page():
    from fastalign.train.objectives import OBJECTIVES

    for name in OBJECTIVES:
        text = (ROOT / "docs" / "options" / f"{name}.md").read_text()
        assert f"# `fastalign train {name}`" in text
