"""BLEU and chrF with sacreBLEU on detokenized text (Post 2018), reported with signatures."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence, cast

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from headlab.errors import HeadlabError, counted

__all__ = ["Scores", "compute_scores", "paired_bootstrap", "bleu_interval", "N_SAMPLES", "SEED"]


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_text: str  # sacreBLEU's one-line report, e.g. "BLEU = 35.90 66.1/41.8/..."
    chrf_text: str
    n_sentences: int

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        return (
            f"{self.bleu_text}\n  signature: {self.bleu_signature}\n"
            f"{self.chrf_text}\n  signature: {self.chrf_signature}"
        )


def compute_scores(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
    """Corpus BLEU (13a tokenisation, exp smoothing) and chrF2 of detokenized hypotheses."""
    if len(hypotheses) != len(references):
        raise HeadlabError(
            f"{counted(len(hypotheses), 'hypothesis', 'hypotheses')} but {counted(len(references), 'reference')}: "
            "they must match line for line"
        )
    if not references:
        raise HeadlabError("no sentences to score")
    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
    return Scores(
        bleu=bleu_score.score,
        chrf=chrf_score.score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
        bleu_text=str(bleu_score),
        chrf_text=str(chrf_score),
        n_sentences=len(references),
    )


# ----------------------------------------------------------------------------- bootstrap over sentences

N_SAMPLES = 1000  # sacreBLEU's default number of resamples
SEED = 12345  # sacreBLEU's default seed (SACREBLEU_SEED)


def paired_bootstrap(baseline: Sequence[str], system: Sequence[str], references: Sequence[str], *,
                     n_samples: int = N_SAMPLES, seed: int = SEED) -> dict:
    """BLEU(system) - BLEU(baseline) with its 95% paired-bootstrap interval and sacreBLEU's p-value
    (Koehn 2004: the same resampled sentences score both systems)."""
    from sacrebleu.significance import PairedTest, Result

    if not len(baseline) == len(system) == len(references):
        raise ValueError(f"{len(baseline)} / {len(system)} hypotheses for {len(references)} references")
    metric = BLEU()
    refs = [list(references)]
    stats_b = np.array(metric._extract_corpus_statistics(list(baseline), refs), dtype="float64")
    stats_s = np.array(metric._extract_corpus_statistics(list(system), refs), dtype="float64")
    score = lambda stats: metric._compute_score_from_stats(list(stats.sum(0))).score  # noqa: E731
    idxs = np.random.default_rng(seed).choice(len(references), size=(n_samples, len(references)), replace=True)
    diffs = np.array([score(stats_s[i]) - score(stats_b[i]) for i in idxs])
    _, results = PairedTest([("baseline", list(baseline)), ("system", list(system))], {"BLEU": BLEU()}, refs,
                            test_type="bs", n_samples=n_samples)()
    p = cast(Result, results["BLEU"][1]).p_value
    assert p is not None  # a bootstrap test always sets it
    low, high = np.percentile(diffs, [2.5, 97.5])
    return {"baseline": score(stats_b), "system": score(stats_s), "delta": score(stats_s) - score(stats_b),
            "low": float(low), "high": float(high), "p": float(p), "n_sentences": len(references),
            "n_samples": n_samples}


def bleu_interval(hypotheses: Sequence[str], references: Sequence[str], *, n_samples: int = N_SAMPLES,
                  seed: int = SEED) -> tuple[float, float, float]:
    """Corpus BLEU and its 95% bootstrap interval over test sentences."""
    metric = BLEU()
    stats = np.array(metric._extract_corpus_statistics(list(hypotheses), [list(references)]), dtype="float64")
    idxs = np.random.default_rng(seed).choice(len(references), size=(n_samples, len(references)), replace=True)
    scores = [metric._compute_score_from_stats(list(stats[i].sum(0))).score for i in idxs]
    low, high = np.percentile(scores, [2.5, 97.5])
    return metric._compute_score_from_stats(list(stats.sum(0))).score, float(low), float(high)
