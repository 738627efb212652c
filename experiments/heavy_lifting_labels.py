"""The labels of the heavy-lifting experiments (heavy_lifting_lm.md, heavy_lifting_nmt.md): one
label per head from a ``headlab functions`` run by Voita et al.'s criteria (positional: one offset
holds >= 90% of the maxima, Sec. 5.1; syntactic: >= 10 points above the offset baseline on a
scored relation-direction, Sec. 5.2.1; rare-token: the head whose maxima land most often on the
rarest token, Sec. 5.3), and a specialisation score (the largest of the three, each as a fraction
of its bar) that ranks the least specialised heads.
"""

from __future__ import annotations

POSITIONAL_BAR, SYNTACTIC_BAR = 0.90, 0.10  # Voita et al. 2019, Sec. 5.1 and 5.2.1 (headlab's defaults)


def label_rows(heads: list[tuple[int, int]], share, offset, margin, rarest) -> list[dict]:
    """One row per (layer, head) of ``heads`` from the score tables ``[layer][head]`` of one kind."""
    top_rare = max(heads, key=lambda lh: rarest[lh[0]][lh[1]])
    best_rare = rarest[top_rare[0]][top_rare[1]]
    rows = []
    for layer, head in heads:
        m = margin[layer][head]
        parts = {"positional": share[layer][head] / POSITIONAL_BAR,
                 "syntactic": (m / SYNTACTIC_BAR) if m is not None else 0.0,
                 "rare": rarest[layer][head] / best_rare}
        functions = [name for name, value in parts.items() if value >= 1.0]
        rows.append({"layer": layer, "head": head, "positional_share": share[layer][head],
                     "positional_offset": offset[layer][head], "syntactic_margin": m,
                     "rarest_share": rarest[layer][head], "functions": functions,
                     "specialised": bool(functions), "score": max(parts.values())})
    return rows


def least_specialised(labels: dict, k: int) -> list[tuple[int, int]]:
    """The ``k`` heads of lowest specialisation score (ties: layer, head order)."""
    ranked = sorted(labels["heads"], key=lambda r: (r["score"], r["layer"], r["head"]))
    return sorted((r["layer"], r["head"]) for r in ranked[:k])
