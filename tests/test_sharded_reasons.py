"""A sharded ``functions``/``aggregate`` run says what one process says about the engine's paths:
``chunked_statistics`` (``--engine fused``) and ``kernel_fallback`` (``--engine kernel``) merged
over the processes, in the one-process order, even where only another process's batch took the
other path.

The two processes run one after the other in this process (no gloo: starting two Pythons with
torch costs seconds), each gather answered with the other's part recorded in its last run. Both
make the same gathers in the same order (as the collectives they stand for require). A part can
depend on what an earlier gather returned (variability's deviations from the combined means), so
the pair runs twice: process 1, 0, 1, 0; the last process 0 combines what a real pair would.
"""

from __future__ import annotations

import copy

import pytest

from headlab.functions import AnalysisConfig, analyze_heads
from headlab.shard import Shard, sharding
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, TREEBANK_TEXTS, bpe_tokenizer
from test_chunked_statistics import _written


def _tokenizer():
    """Whole words for sentences 1 and 3 (process 0's batches, one sentence a batch), letters for
    the words of 2 and 4 (process 1's): only process 1 sees words of several subwords."""
    whole = [TREEBANK_TEXTS[i].replace(".", " .") for i in (0, 2)] * 20
    letters = " ".join(sorted(set(TREEBANK_TEXTS[1] + TREEBANK_TEXTS[3]) - {" "}))
    return bpe_tokenizer([*whole, letters], vocab_size=90)


def _process(rank: int, sent: list, received: list) -> Shard:
    """Process ``rank`` of two: records its part of each gather in ``sent``; the other's part is
    the next of ``received`` (its own where none was recorded yet: the first run of process 1)."""

    class Process(Shard):
        def gather(self, value):
            sent.append(copy.deepcopy(value))
            other = received.pop(0) if received else value
            return [value, other] if self.rank == 0 else [other, value]

    return Process(rank, 2)


def _run(tmp_path, engine, shard=None):
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    model = tiny_model("bert", attn_implementation="sdpa").double()
    config = AnalysisConfig(batch_size=1, window=4, top_k=3, engine=engine)
    if shard is None:
        return analyze_heads(model, _tokenizer(), path, config=config)
    with sharding(shard):
        return analyze_heads(model, _tokenizer(), path, config=config)


@pytest.mark.parametrize(("engine", "field"), [("fused", "chunked_statistics"), ("kernel", "kernel_fallback")])
def test_every_process_reasons_reach_the_report(tmp_path, engine, field):
    if engine == "kernel":
        pytest.importorskip("triton")
        from headlab.data.attention_kernel import interpreted

        if not interpreted():
            pytest.skip("runs in triton's interpreter (CPU)")
    one = _run(tmp_path, engine)
    assert getattr(one.report, field)  # process 1's batches take the other path (the test's premise)
    parts: dict[int, list] = {0: [], 1: []}
    for _ in range(2):
        for rank in (1, 0):
            received = list(parts[1 - rank])
            parts[rank] = []
            two = _run(tmp_path, engine, _process(rank, parts[rank], received))
            assert not received or len(parts[1 - rank]) == len(parts[rank])  # the same gathers
    assert getattr(two.report, field) == getattr(one.report, field)
    assert list(getattr(two.report, field)) == list(getattr(one.report, field))  # the one-process order
    expected, got = one.report.to_json(), two.report.to_json()
    del expected["seconds"], got["seconds"]
    assert got == expected
    assert _written(two.results.values(), tmp_path / "two") == _written(one.results.values(), tmp_path / "one")


def test_the_reasons_merge_in_the_order_of_the_batches_that_noted_them():
    """Process 0 noted its reason at batch 2, process 1 its at batch 1: one process would have
    noted process 1's first (and the same name noted by both counts at its earlier batch)."""
    from headlab.functions.analysis import RunReport, _merge_reasons

    class Two(Shard):
        def gather(self, value):
            return [value, ({"aggregate": "a"}, {"word statistics": "w"},
                            {("chunked_statistics", "aggregate"): 1, ("kernel_fallback", "word statistics"): 1})]

    report = RunReport(chunked_statistics={"positional": "p", "aggregate": "a"}, kernel_fallback={"model": "m"})
    _merge_reasons(Two(0, 2), report, {("kernel_fallback", "model"): 2, ("chunked_statistics", "positional"): 0,
                                       ("chunked_statistics", "aggregate"): 2})
    assert list(report.kernel_fallback.items()) == [("word statistics", "w"), ("model", "m")]
    assert list(report.chunked_statistics) == ["positional", "aggregate"]
