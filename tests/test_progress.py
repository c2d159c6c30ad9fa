"""Progress bars: tqdm on a terminal, a few whole lines in a log."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

from laplace_diffjac._progress import LogProgress, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _log(items, interval, enabled=True, total=None):
    stream = io.StringIO()
    return LogProgress(items, "Steps", total, stream, enabled, interval), stream


def test_a_log_gets_one_line_at_the_end_with_the_last_postfix():
    bar, stream = _log(range(200), interval=3600.0)
    for i in bar:
        bar.set_postfix(objective=f"{1 / (i + 1):.3g}", refresh=True)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("Steps: 200/200 in ")
    assert lines[0].endswith(" s (objective=0.005)")
    assert "\r" not in stream.getvalue()


def test_a_log_gets_a_line_per_interval():
    bar, stream = _log(range(5), interval=0.0)
    assert list(bar) == [0, 1, 2, 3, 4]
    counts = [line.split()[1] for line in stream.getvalue().splitlines()]
    # a line before each item after the first (every interval is over), one at the end
    assert counts == ["0/5", "1/5", "2/5", "3/5", "4/5", "5/5"]


def test_a_loop_that_breaks_counts_the_step_it_ran_and_closes_once():
    bar, stream = _log(range(10), interval=3600.0)
    for i in bar:
        if i == 3:
            break
    bar.close()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Steps: 4/10 in ")


def test_an_iterator_without_length_and_a_disabled_bar():
    bar, stream = _log(iter([1, 2]), interval=3600.0)
    assert list(bar) == [1, 2]
    assert stream.getvalue().startswith("Steps: 2 in ")
    bar, stream = _log(range(3), interval=0.0, enabled=False)
    assert list(bar) == [0, 1, 2]
    assert stream.getvalue() == ""


def test_progress_is_tqdm_on_a_terminal_and_lines_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress(range(3), desc="Steps")
    assert isinstance(bar, tqdm)
    bar.close()
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress(range(3), desc="Steps")
    assert isinstance(bar, LogProgress)
    assert list(bar) == [0, 1, 2]
    assert log.getvalue().startswith("Steps: 3/3 in ")
    monkeypatch.setattr(sys, "stderr", None)
    assert list(progress(range(2), desc="Steps")) == [0, 1]
