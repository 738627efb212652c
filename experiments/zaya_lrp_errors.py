"""The conservation and reference errors of ZAYA's LRP rule (headlab.importance.cca_rule) on tests/test_lrp_zaya.py's
tiny models, as docs/importance.md quotes them (session 36).

Run: ``PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python experiments/zaya_lrp_errors.py``. Prints
compute_lrp's worst ``|with_biases - 1|`` with and without attention biases, the relative error of the relevance at
the first layer's input (bias-free, float64 and float32), and the largest difference between the first attention's
input relevance and a float64 reference's (the attention weights plain constants)."""

from __future__ import annotations

import torch

import test_lrp_zaya as zaya_tests
from headlab.importance import compute_lrp
from headlab.importance.lrp import _KeptWide
from support import family_matrix
from support.lrp_families import lrp_data


def _recorded(check, *args, **kwargs) -> list[float]:
    """What ``check`` compares with torch.testing.assert_close: the largest absolute difference of each pair, and the
    relative one where the expected value is a scalar."""
    seen: list[float] = []
    original = torch.testing.assert_close

    def record(actual, expected, **options):
        difference = (actual.detach() - expected.detach()).abs().max()
        expected = expected.detach()
        seen.append(float(difference / expected.abs() if expected.dim() == 0 else difference))
        original(actual, expected, **options)

    torch.testing.assert_close = record
    try:
        check(*args, **kwargs)
    finally:
        torch.testing.assert_close = original
    return seen


def main() -> None:
    for bias in (True, False):
        model = zaya_tests.zaya(bias)
        record = compute_lrp(model, *lrp_data(model), bootstrap=0).signature["conservation"]["with_biases"]
        print(f"compute_lrp, attention biases {bias}: max |with_biases - 1| = "
              f"{max(abs(record['min'] - 1), abs(record['max'] - 1)):.2g}")
    model = zaya_tests.zaya(dtype=torch.float64)
    with _KeptWide(torch.float64):
        wide = _recorded(family_matrix.check_lrp_conserves, model, model.model.layers[0], rtol=1e-12, atol=1e-12)
    model = zaya_tests.zaya()
    narrow = _recorded(family_matrix.check_lrp_conserves, model, model.model.layers[0], rtol=1e-6, atol=1e-6)
    print(f"first layer's input, bias-free: relative error float64 {wide[0]:.2g}, float32 {narrow[0]:.2g}")
    output, relevance = _recorded(zaya_tests.test_the_value_path_relevance_equals_an_independent_reference)
    print(f"first attention vs float64 reference: output {output:.2g}, input relevance {relevance:.2g} (max abs)")


if __name__ == "__main__":
    main()
