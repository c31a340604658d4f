"""The rich console the commands print tables with."""

from __future__ import annotations

from rich.console import Console


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A reader that stopped reading (``fastalign plan | head``) ends the command as a closed pipe
        under ``print`` does (``fastalign.cli.main``: quietly, status 141), not with rich's status 1."""
        self.quiet = True
        raise BrokenPipeError


def console(width: int, **options) -> Console:
    """A console for the terminal, or ``width`` columns wide for logs and pipes (no wrapped tables)."""
    terminal = _Console(**options)
    return terminal if terminal.is_terminal else _Console(width=width, **options)
