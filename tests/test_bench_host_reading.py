"""benchmarks/bench_host_reading.py's code paths on a short sentence (no timing is checked): its
rows, the host total, the table and the JSON, and the steps doing the analysis's own calls."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host_reading.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host_reading", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_table_and_json(bench, tmp_path, capsys):
    path = tmp_path / "rows.json"
    rows = bench.main(["--words", "40", "7", "--repeat", "2", "--vocab", "64", "--json", str(path)])
    assert [row["words"] for row in rows] == [40, 7]
    for row in rows:
        for item in bench.ITEMS:
            assert row[item]["seconds"] > 0 and row[item]["cpu_seconds"] >= 0
        total = sum(row[item]["seconds"] for item in bench.HOST)
        assert row["host total"]["seconds"] == pytest.approx(total, rel=1e-12)
    assert json.loads(path.read_text()) == rows
    table = capsys.readouterr().out
    assert "| 40 | read_conllu |" in table and "| 7 | host total |" in table


def test_steps_make_the_analysis_inputs(bench, tmp_path):
    import bench_chunked_attention

    path = tmp_path / "s.conllu"
    bench_chunked_attention.write_conllu(path, 12, 1, 64)
    tokenizer = bench_chunked_attention.word_tokenizer(64)
    steps, made = bench.steps(path, tokenizer, 20)
    assert steps["conllu.parse_incr"]() == 1
    for item in bench.HOST:
        steps[item]()
    (sentence,) = made["sentences"]
    assert len(sentence) == 12 and made["alignments"][0].n_words == 12
    assert made["side"].token_word[0, :12].tolist() == list(range(12))  # one token per word, EOS after
