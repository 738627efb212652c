"""Fixtures shared by every test module (helpers: the ``support`` package next to this file).

Markers: ``integration`` for tests that run a command, a pipeline or a training end to end (the
modules of :data:`INTEGRATION`), ``unit`` for the rest; ``pytest -m unit`` runs the fast ones.
"""

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels (tests/test_kernel_statistics.py) run in triton's interpreter on a CPU; triton
    # reads this when first imported, which transformers' imports below may already do.
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

from support.nmt import tiny_corpus, tiny_tokenizer  # noqa: E402 (after the path above)
from support.treebank import SAMPLE_CONLLU  # noqa: E402

INTEGRATION = {
    "test_analyze", "test_bad_input_cli", "test_bad_input_nmt", "test_bad_input_outdirs", "test_cli_foundation",
    "test_api_browser", "test_demo", "test_examples",
    "test_families_analyze", "test_functions_cli", "test_importance_cli", "test_lm_bundled", "test_lm_train",
    "test_nmt_bundled", "test_nmt_distributed", "test_nmt_train", "test_nmt_translate", "test_parse", "test_profiles",
    "test_pruned_models", "test_pruning_distributed", "test_pruning_train", "test_report_browser", "test_reproduce",
    "test_reproduce_bad_input", "test_reproduce_docs", "test_reproduce_news_docs", "test_sharded",
}
"""Test modules that run commands, pipelines or training end to end (reproduction/tests' too)."""


def pytest_collection_modifyitems(items):
    def module(item):  # "tests.test_x" (tests/ is a package) -> "test_x"
        return item.module.__name__.rpartition(".")[2]

    for item in items:
        item.add_marker("integration" if module(item) in INTEGRATION else "unit")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread for every test: deterministic, and far faster than two threads fighting
    over a shared 2-core machine. Set again for each test, since commands under test set their own
    (``--threads``); a test that needs more sets them itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus():
    """300 Multi30k pairs (support.nmt.tiny_corpus)."""
    return tiny_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    """A 400-piece tokenizer trained on ``corpus``."""
    return tiny_tokenizer(corpus)


@pytest.fixture
def sample_path(tmp_path):
    """The sample treebank of support.treebank as a CoNLL-U file."""
    path = tmp_path / "sample.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    return path
