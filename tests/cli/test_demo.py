"""``fastalign demo`` runs offline and shows equal losses and gradients."""

from __future__ import annotations

import re

from fastalign.cli.main import main


def test_demo_small_cpu(capsys):
    assert (
        main(
            [
                "demo",
                "--device",
                "cpu",
                "--tokens",
                "64",
                "--hidden",
                "16",
                "--vocab",
                "300",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fastalign linear_cross_entropy" in out and "PyTorch linear + cross_entropy" in out
    differences = dict(re.findall(r"relative difference in ([a-z ]+): ([0-9.e+-]+)", out))
    assert set(differences) == {"loss", "grad hidden", "grad weight"}
    assert all(float(value) < 1e-5 for value in differences.values()), differences
