"""BLEU and chrF with sacreBLEU on detokenized text (Post 2018), reported with signatures."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF

from headlab.errors import HeadlabError

__all__ = ["Scores", "compute_scores"]


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
            f"{len(hypotheses)} hypotheses but {len(references)} references: they must match line for line"
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
