"""Bad-input catalogue, processes (docs/cli.md): Ctrl-C while headlab starts, a killed
``--num-processes`` launcher, a killed worker. Each case runs small scripts, not models: the
launcher (:func:`headlab.shard.launch`) starts any command the way it starts headlab."""

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import headlab.cli
from headlab import shard
from headlab.cli import main
from headlab.errors import RunFailed
from support.bad_input import save_tiny_marian
from support.treebank import SAMPLE_CONLLU

SRC = str(Path(headlab.cli.__file__).resolve().parents[1])


def test_ctrl_c_while_the_commands_load(capsys, monkeypatch):
    """Regression (issue 32 row 8): Ctrl-C within the first tenth of a second (headlab importing
    its command modules, parsing) was a KeyboardInterrupt traceback, exit -2 (SIGINT)."""
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(headlab.cli, "build_parser", interrupted)
    assert main(["nmt", "translate", "--model", "m", "--input", "x"]) == 130
    err = capsys.readouterr().err
    assert err == "headlab: interrupted while starting; nothing was done\n"


def test_ctrl_c_while_python_m_headlab_imports_the_cli(capsys, monkeypatch):
    """The same for ``python -m headlab`` interrupted while it imports headlab.cli."""
    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "headlab.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "headlab.cli")
    monkeypatch.delitem(sys.modules, "headlab.__main__", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("headlab", run_name="__main__")
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "headlab: interrupted while starting; nothing was done\n"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by init counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_launcher_ends_its_workers(tmp_path):
    """Regression (issue 32 row 9): kill -9 of the --num-processes launcher left its workers
    computing to the end. Each worker runs headlab.cli.main (with a parser that writes the
    worker's pid and sleeps a minute); the launcher is killed; the workers end within seconds."""
    worker = (
        "import os, sys, time\n"
        "import headlab.cli as cli\n"
        "def slow():\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'pid-' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "    time.sleep(60)\n"
        "cli.build_parser = slow\n"
        "cli.main([])\n"
    )
    launcher_code = (f"import sys\nsys.path.insert(0, {SRC!r})\nfrom headlab import shard\n"
                     f"shard.launch([], 2, command=[sys.executable, '-c', {worker!r}])\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env=dict(os.environ, PYTHONPATH=SRC))
    try:
        _wait_for_workers(tmp_path)
        pids = [int(path.read_text()) for path in sorted(tmp_path.glob("pid-*"))]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, "a worker outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()
        _kill_workers(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGTERM")
def test_terminated_launcher_exits_143(tmp_path):
    """Regression (qa6): a --num-processes launcher sent SIGTERM exited 130 (headlab.shard.launch
    caught the interruption as Ctrl-C), where a single process exits 143 (128 + 15); now 143,
    its workers stopped. The launcher runs with headlab.cli's SIGTERM handler, as `headlab` does."""
    worker = (f"import os, time\nopen(os.path.join({str(tmp_path)!r}, 'pid-' + os.environ['RANK']), 'w')"
              ".write(str(os.getpid()))\ntime.sleep(60)\n")
    launcher_code = (f"import signal, sys\nsys.path.insert(0, {SRC!r})\nfrom headlab import shard\n"
                     "from headlab.cli import _terminate\nsignal.signal(signal.SIGTERM, _terminate)\n"
                     f"sys.exit(shard.launch([], 2, command=[sys.executable, '-c', {worker!r}]))\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env=dict(os.environ, PYTHONPATH=SRC))
    try:
        _wait_for_workers(tmp_path)
        launcher.terminate()
        assert launcher.wait(timeout=60) == 143
        assert all(_gone(int(path.read_text())) for path in tmp_path.glob("pid-*"))
    finally:
        launcher.kill()
        _kill_workers(tmp_path)


def test_killed_worker_is_exit_1_with_its_rank(tmp_path, capsys, monkeypatch):
    """Regression (issue 32 row 9): a worker killed with -9 ended the command with exit 247
    (-9 passed to sys.exit) and no message; now exit 1, naming the rank and the signal."""
    script = "import os, signal, time\nif os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)"
    start = time.perf_counter()
    with pytest.raises(RunFailed, match=r"process rank 1 of 2 was killed by SIGKILL \(signal 9\)"):
        shard.launch([], 2, command=[sys.executable, "-c", script])
    assert time.perf_counter() - start < 30  # rank 0 was stopped, not waited for

    # Through the command line: one line, exit 1.
    monkeypatch.setattr(shard, "check_processes", lambda args, count: 2)
    real_launch = shard.launch
    monkeypatch.setattr(shard, "launch", lambda argv, n: real_launch(argv, n, command=[sys.executable, "-c", script]))
    model = save_tiny_marian(tmp_path / "model")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    code = main(["functions", str(model), "--conllu", str(tmp_path / "tb.conllu"), "--out", str(tmp_path / "o"),
                 "--num-processes", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert "headlab functions: error: process rank 1 of 2 was killed by SIGKILL (signal 9)" in err
    assert "Traceback" not in err


def test_failing_worker_names_its_rank(capsys):
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(2)\ntime.sleep(60)"
    assert shard.launch([], 2, command=[sys.executable, "-c", script]) == 2
    assert "process rank 1 of 2 failed (exit 2" in capsys.readouterr().err


@pytest.mark.parametrize("n, said", [(1, "the 1 sentence of"), (3, "the 3 sentences of")])
def test_more_processes_than_sentences_counts_them_in_the_right_number(n, said, tmp_path, capsys, monkeypatch):
    """Regression: `--num-processes 2` on a one-sentence treebank said "the 1 sentences"."""
    monkeypatch.setattr(shard, "launch", lambda *a, **k: pytest.fail("no process may start"))
    conllu = tmp_path / "tb.conllu"
    conllu.write_text("".join(s.strip() + "\n\n" for s in SAMPLE_CONLLU.split("\n\n")[:n]), encoding="utf-8")
    model = save_tiny_marian(tmp_path / "model")
    assert main(["functions", str(model), "--conllu", str(conllu), "--out", str(tmp_path / "o"),
                 "--num-processes", str(n + 1)]) == 2
    assert f"--num-processes {n + 1}: more processes than {said} {conllu}; use at most" in capsys.readouterr().err


def _wait_for_workers(tmp_path, n: int = 2) -> None:
    """Until each of the ``n`` workers wrote its pid file under ``tmp_path``."""
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid-*"))) < n:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)


def _kill_workers(tmp_path) -> None:
    """SIGKILL to every worker that wrote a pid file, wherever the test stopped."""
    for path in tmp_path.glob("pid-*"):
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
