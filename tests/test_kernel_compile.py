"""The statistics kernel compiles for NVIDIA GPUs (sm_90: H100/H200; sm_80: A100; sm_86) and fits them,
checked on the CPU, ahead of time (benchmarks/compile_kernel.py), before a GPU's minutes are spent.

The compiler runs in a process of its own: this one may have imported triton in interpreter mode
(``TRITON_INTERPRET=1``, tests/conftest.py), where triton's library is defined for the interpreter
and nothing compiles. Skipped only where triton or its bundled ``ptxas`` is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compile_kernel.py"

SPILL_BUDGET = 1024
"""Bytes of spill stores per thread a configuration may have: a few words are harmless, the kilobytes
of local memory the first blocks spilled (up to 21 KB at float32, d_head 64) are not."""


def _ptxas() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        paths = [get_ptxas(arch).path for arch in (80, 90)]
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this triton
        return None
    return None if any(not p or not os.path.exists(p) for p in paths) else paths[0]


pytestmark = pytest.mark.skipif(_ptxas() is None, reason="triton's NVIDIA backend or its bundled ptxas is absent")


def _compile(tmp_path: Path, *options: str) -> list[dict]:
    """The tool's results, run without the interpreter and with an empty cache (a real compile)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *sys.path])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *options, "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert done.returncode == (0 if all(r["ok"] for r in results) else 1), done.stderr
    return results


def _check(results: list[dict]) -> None:
    from headlab.data.attention_kernel import launch_blocks

    problems = []
    for r in results:
        c = r["config"]
        where = f"sm_{r['target']} {c['dtype']} d_head {c['d_head']} causal {c['causal']} mask {c['mask']} F {c['features']}"
        if r["error"]:
            problems.append(f"{where}: does not compile: {r['error']}")
            continue
        if r["shared"] > r["shared_limit"]:
            problems.append(f"{where}: {r['shared']} bytes of shared memory, over the {r['shared_limit']} of a block")
        if r["spill_stores"] is None or r["spill_stores"] > SPILL_BUDGET:
            problems.append(f"{where}: {r['spill_stores']} bytes of spill stores ({r['registers']} registers)")
        D = max(16, 1 << (c["d_head"] - 1).bit_length())
        blocks = launch_blocks(getattr(torch, c["dtype"]), D, divmod(r["target"], 10))
        assert (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"]) == \
            (blocks.block_m, blocks.block_n, blocks.num_warps, blocks.num_stages), where  # what the launcher picks
    assert not problems, "\n".join(problems)


def test_the_benchmark_configuration_compiles_for_sm90(tmp_path):
    """bfloat16, d_head 128, causal, masked, with the aggregate's features: the Llama-3-8B launch."""
    results = _compile(tmp_path, "--targets", "90", "--dtypes", "bfloat16", "--d-heads", "128", "--quick")
    assert {(r["config"]["d_head"], r["config"]["features"]) for r in results} == {(128, 22), (128, 0)}
    _check(results)


@pytest.mark.slow
def test_every_dtype_and_head_size_compiles_and_fits_sm90_sm80_and_sm86(tmp_path):
    """The heaviest configuration of each dtype and d_head (16 to 256) and the lightest, for an H100,
    an A100 and an sm_86 GPU (99 KB of shared memory per block; sm_89's limit is the same)."""
    results = _compile(tmp_path, "--targets", "90", "80", "86", "--d-heads", "16", "64", "128", "256", "--quick")
    assert len(results) == 3 * (4 * 4 + 4)
    _check(results)
