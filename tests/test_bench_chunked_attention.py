"""benchmarks/bench_chunked_attention.py's code paths on a tiny model (no timing is checked): the
rows of each mode, the GPU's memory fields (torch.cuda's counters stubbed, so that the CUDA branch
runs here), the presets, and the rows of runs that do not run (skipped, out of budget)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chunked_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_chunked_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(bench, *argv):
    return bench.build_parser().parse_args(["--shape", "tiny", "--query-chunk", "16", *argv])


def test_presets_are_llama_config_fields(bench):
    from transformers import LlamaConfig

    args = _args(bench, "--shape", "llama3-8b", "--layers", "2")
    config = LlamaConfig(**bench.model_fields(args))
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 32, 8)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (4096, 14336, 128256)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.head_dim == 128
    assert bench.model_fields(_args(bench))["num_hidden_layers"] == 2  # the tiny preset, no override


@pytest.mark.parametrize("mode", ["sdpa", "fused", "chunked", "eager"])
def test_child_rows_on_cpu_in_bfloat16(bench, mode):
    row = bench.child(_args(bench, "--dtype", "bfloat16", "--child-mode", mode, "--child-length", "40"))
    assert row["mode"] == mode and row["length"] == 40 and row["status"] == "ok"
    assert row["seconds_per_sentence"] > 0 and row["peak_total_mb"] >= row["base_mb"] > 0
    assert "gpu_peak_total_mb" not in row
    # the CoNLL-U is read before the timed region and timed apart; the analysis's total includes it
    assert row["read_seconds_per_sentence"] > 0 and row["read_cpu_seconds_per_sentence"] >= 0
    included = row["statistics_seconds_per_sentence"] + (mode != "sdpa") * row["read_seconds_per_sentence"]
    assert row["seconds_per_sentence"] == pytest.approx(included, rel=1e-12)


def test_child_reports_the_gpu_counters(bench, monkeypatch):
    """The CUDA branch: peak growth over the allocation before the timed region, weights apart."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 10 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stub GPU")

    class CudaMeter(bench.Meter):  # the model stays on the CPU; the meter takes the GPU's branch
        def __init__(self, cuda):
            super().__init__(True)

    monkeypatch.setattr(bench, "Meter", CudaMeter)
    row = bench.child(_args(bench, "--child-mode", "chunked", "--child-length", "24"))
    assert calls == ["sync", "reset", "sync"] * 2  # the reading's meter, then the analysis's
    assert (row["gpu"], row["gpu_base_mb"], row["gpu_peak_growth_mb"], row["gpu_peak_total_mb"]) == \
        ("stub GPU", 3, 7, 10)
    fields = bench.model_fields(_args(bench))
    embeddings = 2 * fields["vocab_size"] * fields["hidden_size"]  # untied input and output tables
    assert row["gpu_weights_mb"] > embeddings * 4 / 2**20


def test_runs_that_do_not_run_are_rows(bench, capsys):
    args = _args(bench, "--eager-max-length", "100", "--budget-s", "0")
    skipped = bench.run_one(args, "eager", 512, deadline=None)
    assert skipped["status"] == "skipped" and "map alone is 4 MiB in float32" in skipped["detail"]
    late = bench.run_one(args, "chunked", 200, deadline=0.0)
    assert late["status"] == "timeout" and "--budget-s" in late["detail"]
    ok = {"mode": "sdpa", "length": 200, "status": "ok", "seconds_per_sentence": 2.0, "cpu_seconds_per_sentence": 1.0,
          "peak_growth_mb": 10.0, "peak_total_mb": 50.0}
    bench.print_table([ok, {**ok, "mode": "chunked", "seconds_per_sentence": 3.0}, skipped, late], cuda=False)
    table = capsys.readouterr().out.splitlines()
    # rows of an older run (no reading apart) keep their columns, "-" in the new ones
    assert table[3] == "| 200 | chunked | 3.00 | 1.50 | - | - | - | - | 1.00 | 1.00 | 10 | 1.00 | 50 | 1.00 |"
    assert table[4].startswith("| 512 | eager | skipped: eager beyond --eager-max-length 100")
    # the analysis without its reading and the reading, each against the SDPA forward's time
    read = {"statistics_seconds_per_sentence": 2.0, "read_seconds_per_sentence": 0.5}
    bench.print_table([{**ok, **read}, {**ok, **read, "mode": "fused", "seconds_per_sentence": 3.5,
                                         "statistics_seconds_per_sentence": 3.0}], cuda=False)
    table = capsys.readouterr().out.splitlines()
    assert table[2] == "| 200 | sdpa | 2.00 | 1.00 | 2.00 | 1.00 | 0.50 | 0.25 | 1.00 | 1.00 | 10 | 1.00 | 50 | 1.00 |"
    assert table[3] == "| 200 | fused | 3.50 | 1.75 | 3.00 | 1.50 | 0.50 | 0.25 | 1.00 | 1.00 | 10 | 1.00 | 50 | 1.00 |"


def test_kernel_mode_is_cuda_only(bench, monkeypatch, capsys):
    """``--modes kernel`` on the CPU says it needs a CUDA GPU (exit 2) before any run."""
    monkeypatch.setattr("sys.argv", [str(SCRIPT), "--modes", "sdpa", "kernel", "--lengths", "40"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "runs on a CUDA GPU" in capsys.readouterr().err
