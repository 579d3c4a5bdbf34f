"""Progress bars on a terminal only (issue 54, item 5): a log file, a pipe or a scheduler's log gets the log
lines, not carriage-return frames."""

import io
import subprocess
import sys

from wsod.progress import bars_shown, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_only_when_asked_for_and_stderr_is_a_terminal(monkeypatch):
    assert bars_shown(True, _Terminal()) and not bars_shown(False, _Terminal())
    assert not bars_shown(True, io.StringIO()) and not bars_shown(True, object())
    for stream, drawn in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        for _ in progress_bar(range(3), shown=True, desc="work"):
            pass
        assert ("work" in stream.getvalue() and "\r" in stream.getvalue()) == drawn, stream.getvalue()


def test_a_run_whose_stderr_is_a_pipe_writes_no_bar_frames():
    script = (
        "from wsod.progress import progress_bar\n"
        "for _ in progress_bar(range(50), shown=True, desc='work'): pass\n"
        "print('done')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "done\n"
    assert result.stderr == "", result.stderr
