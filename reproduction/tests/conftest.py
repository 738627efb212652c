"""The fixtures of headlab's tests/conftest.py for the reproduction's tests: the same tiny models
and data helpers (the ``support`` package of tests/), one torch thread per test, and the same
``unit``/``integration`` markers (its :data:`INTEGRATION` names these modules too)."""

import pytest
from tests.conftest import INTEGRATION, corpus, one_thread, sample_path, tokenizer  # noqa: F401 (fixtures)


def pytest_collection_modifyitems(items):
    # tests/conftest.py marks every item when both directories are collected; alone, these are marked here.
    for item in items:
        if item.get_closest_marker("unit") is None and item.get_closest_marker("integration") is None:
            item.add_marker("integration" if item.module.__name__.rpartition(".")[2] in INTEGRATION else "unit")


@pytest.fixture
def sleeper():
    """A live process whose pid holds a lock in the tests of locks (as in tests/test_bad_input_cli.py)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()
