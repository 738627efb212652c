"""How close experiments/family_sweep.py's checks come to their bounds (session 40, task bf16).

The sweep says pass or FAIL; this runs the same sweep and prints, per model type, the largest ``difference / bound``
of each check that compares two tensors (``check_capture``: maps; ``check_mask`` and ``check_prune``: logits) over
every element it compared: 0 where the two ways to the numbers agree to the bit, near 1 where a tolerance decides.
In half precision it shows whether the bounds of ``family_sweep.tolerance_for`` (the library's, not tuned) are what
lets a row pass.

    cd <checkout> && PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python experiments/family_sweep_margins.py --dtype bfloat16 [--only TYPE ...] [--multimodal]
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_sweep as fs  # noqa: E402 - beside this script

_close = fs.close
WORST: dict[str, float] = defaultdict(float)  # the calling check -> its largest difference / bound


def ratio(a: torch.Tensor, b: torch.Tensor, atol, kind: str) -> float:
    """The largest ``|a - b| / bound`` of ``fs.close``'s comparison (its bound, element by element)."""
    tol = atol if isinstance(atol, fs.Tolerance) else fs.Tolerance(atol)
    a, b = a.double(), b.double()
    diff = torch.where(a == b, 0.0, (a - b).abs().nan_to_num(nan=float("inf")))
    if kind == "maps":
        bound = tol.atol + tol.map_rtol * b.abs()
    else:
        bound = torch.full_like(b, tol.atol + tol.logit_rel * max(b.abs().nan_to_num(posinf=0, neginf=0).max().item(),
                                                                  1.0))
    return (diff / bound).max().item()


def measured_close(a: torch.Tensor, b: torch.Tensor, atol, kind: str = "logits") -> tuple[bool, float]:
    result = _close(a, b, atol, kind)
    if a.shape == b.shape and a.numel():
        caller = sys._getframe(1).f_code.co_name
        WORST[caller] = max(WORST[caller], ratio(a, b, atol, kind))
    return result


def main() -> None:
    parser = fs.arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=list(fs.DTYPES), default="float64")
    parser.add_argument("--timeout", type=int, default=120)
    parser.add_argument("--multimodal", action="store_true")
    args = parser.parse_args()
    fs.MULTIMODAL = args.multimodal
    fs.close = measured_close
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    def check(model_type: str, config_class) -> tuple[str, str, str]:
        WORST.clear()
        outcome, step, message = fs.sweep(model_type, config_class, args.timeout, fs.DTYPES[args.dtype])
        if outcome != "pass":
            return outcome, step, message
        return outcome, step, " ".join(f"{name}={value:.3g}" for name, value in sorted(WORST.items()))

    fs.run_types(check, only=args.only, timeout=args.timeout, columns=2)


if __name__ == "__main__":
    main()
