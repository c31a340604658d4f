"""A warning during a command is one ``warning:`` line on stderr, not Python's ``file:line: Category:``
and the source line glued onto the progress bar; the caller's warning display is back afterwards."""

from __future__ import annotations

import warnings

from fastalign.cli import main as cli


def test_a_warning_is_one_line_and_the_callers_display_comes_back(monkeypatch, capsys):
    def warns(argv):
        warnings.warn("the run has collapsed", UserWarning, stacklevel=1)
        warnings.warn("`x` is deprecated", FutureWarning, stacklevel=1)
        return 0

    before = warnings.showwarning
    monkeypatch.setattr(cli, "_run", warns)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main([]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["warning: the run has collapsed", "warning: `x` is deprecated (FutureWarning)"]
    assert warnings.showwarning is before
