"""Progress bars show on a terminal and print nothing anywhere else."""
import io

from tokenmill.progress import bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_draws_on_a_terminal():
    out = Terminal()
    with bar(total=4, desc="collect", unit="req", stream=out) as b:
        b.update(3)
        b.refresh()  # tqdm redraws at most every 0.1 s on its own
    assert "collect" in out.getvalue() and "3/4" in out.getvalue()


def test_a_bar_is_silent_when_not_on_a_terminal():
    out = io.StringIO()
    with bar(total=4, desc="collect", stream=out) as b:
        b.update(4)
    assert out.getvalue() == ""
