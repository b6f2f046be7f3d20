"""`tokenmill bench NAME --help` is that benchmark's own help, not the parent command's."""
from __future__ import annotations

import pytest

from tokenmill import cli


@pytest.mark.parametrize("name", sorted(cli.BENCHES))
def test_each_benchmark_answers_help_with_its_own_flags(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tokenmill bench {name}") and "--json" in out


def test_an_unknown_benchmark_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "nonsense"])
    assert exc.value.code == 2
    assert "control-plane" in capsys.readouterr().err
