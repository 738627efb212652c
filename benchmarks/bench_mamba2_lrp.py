"""What Mamba-2's LRP rule keeps for its backward pass, against the length of the text.

The rule (:mod:`headlab.importance.mixer_rules.mamba`) recomputes a Mamba-2 mixer's scan as ``y = M x + D x`` with
the weights ``M`` held constant. Session 35 built ``M`` whole, ``[b, heads, T, T]``, for each mixer layer, and
autograd keeps it until the backward pass: for a model of 28 such layers that is 28 of them at once. Since session
36 the scan runs by chunks of at most 64 positions (:func:`~headlab.importance.mixer_rules.mamba._mamba2_scan`),
keeping ``[b, heads, T, 64]``. This compares the two on one layer's scan with a Bamba-9B mixer's shape (128 heads of
64 channels, state 128, one group) in float32, batch 1:

* ``saved MiB``: the bytes of the tensors autograd keeps for the backward pass (counted by
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once), what a whole model holds per mixer layer;
* ``peak MiB``: the process's peak resident set size above its size before the scan (each form and length in a
  process of its own);
* ``seconds``: forward and backward of the scan, wall, one thread;
* ``max |dy|``, ``max |dgrad|``: the chunked form against the whole-matrix form (same inputs), where both ran.

The whole-matrix form is skipped above ``--whole-up-to`` tokens (its matrix alone is 4 * 128 * T^2 bytes).

    OMP_NUM_THREADS=1 python benchmarks/bench_mamba2_lrp.py --lengths 256,1024,4096 --whole-up-to 1024
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from headlab.importance.mixer_rules.mamba import _mamba2_scan, _segment_sums  # noqa: E402

HEADS, WIDTH, STATE = 128, 64, 128


def whole_matrix_scan(x, dt, A, B, C, D):
    """Session 35's form: the weights as one ``[b, h, T, T]`` constant."""
    with torch.no_grad():
        weights = torch.einsum("bthn,bshn->bhts", C, B) * torch.exp(_segment_sums((dt * A).permute(0, 2, 1)))
        weights = weights * dt.permute(0, 2, 1)[:, :, None, :]
    return torch.einsum("bhts,bshp->bthp", weights, x) + x * D[:, None]


def inputs(length: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, length, HEADS, WIDTH, generator=g, requires_grad=True)
    dt = torch.rand(1, length, HEADS, generator=g) * 0.1
    A = -torch.rand(HEADS, generator=g) * 8
    B, C = (torch.randn(1, length, HEADS, STATE, generator=g) for _ in range(2))
    return x, dt, A, B, C, torch.randn(HEADS, generator=g)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(form: str, length: int, out: Path | None) -> dict:
    torch.set_num_threads(1)
    args = inputs(length)
    before = rss_mib()
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    scan = whole_matrix_scan if form == "whole" else _mamba2_scan
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = scan(*args)
    (grad,) = torch.autograd.grad(y.sum(), args[0])
    seconds = time.perf_counter() - start
    if out is not None:
        torch.save({"y": y.detach(), "grad": grad}, out)
    return {"form": form, "tokens": length, "saved MiB": sum(saved.values()) / 2**20,
            "peak MiB": rss_mib() - before, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--whole-up-to", type=int, default=1024)
    parser.add_argument("--one", nargs=2, metavar=("FORM", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.out)))
        return
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, float32, batch 1, "
          f"{HEADS} heads x {WIDTH}, state {STATE}")
    print(f"{'tokens':>7} {'form':>8} {'saved MiB':>10} {'peak MiB':>9} {'seconds':>8} {'max |dy|':>9} {'max |dgrad|':>11}")
    tmp = Path("bench_mamba2_lrp.tmp")
    tmp.mkdir(exist_ok=True)
    try:
        for length in (int(v) for v in args.lengths.split(",")):
            rows = {}
            for form in ("whole", "chunked"):
                if form == "whole" and length > args.whole_up_to:
                    continue
                out = tmp / f"{form}-{length}.pt"
                run = subprocess.run([sys.executable, __file__, "--one", form, str(length), "--out", str(out)],
                                     capture_output=True, text=True, check=True)
                rows[form] = json.loads(run.stdout.strip().splitlines()[-1])
            dy = dgrad = ""
            if len(rows) == 2:
                a, b = (torch.load(tmp / f"{form}-{length}.pt", weights_only=True) for form in ("whole", "chunked"))
                dy = f"{float((a['y'] - b['y']).abs().max()):.1e}"
                dgrad = f"{float((a['grad'] - b['grad']).abs().max()):.1e}"
            for form, row in rows.items():
                print(f"{length:>7} {form:>8} {row['saved MiB']:>10.1f} {row['peak MiB']:>9.0f} {row['seconds']:>8.2f} "
                      f"{dy if form == 'chunked' else '':>9} {dgrad if form == 'chunked' else '':>11}")
    finally:
        for f in tmp.glob("*.pt"):
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
