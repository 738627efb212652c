"""Each finding of Voita et al. 2019, computed from the reproduction's result files only.

A :class:`Claim` is one section of docs/reproduction.md: a list of :class:`Check` rows (the
paper's statement and number, then per model our number and a verdict) plus optional detail
tables. Verdicts: ``holds``, ``partly`` (one part holds, another does not; never for a zero
count), ``does not hold``, ``no difference`` (a BLEU change whose 95% interval contains 0, for
"better than" rows only: "no (noticeable) loss" rows use one non-inferiority bound,
:data:`NOTICEABLE_BLEU`), ``inconclusive`` (the interval, or the data, cannot decide; also every
BLEU verdict that rests on a pruning point whose fine-tuning has not settled, and every number
that is undefined: NaN never makes a claim fail),
``not testable`` (the premise is absent, e.g. no positional head to look at), ``not run`` (an
input file is missing; the reason says which stage makes it) and ``-`` for rows that only report
a number. Every BLEU comparison is judged on its paired-bootstrap interval and every correlation
on its bootstrap interval over heads (:mod:`reproduction.significance`).

The criteria are fixed here, before looking at any result, and use the paper's thresholds
(positional: >= 90% of maxima at one offset; syntactic: >= 10 points over the most frequent
offset; confident: > 0.8). Where the paper states a finding without a number, the criterion
used to call it is written next to the verdict. Sensitivity rows (correlations that need no
threshold) are marked as such and never change a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from headlab import KINDS, HeadScores
from headlab.importance import spearman
from headlab.pruning.dev import FLAT_BLEU
from reproduction.results import ModelResults, kept_mask
from reproduction.significance import bleu_interval, paired_bootstrap, spearman_interval

__all__ = ["Check", "Claim", "Cell", "compute_claims", "PAPER", "POSITIONAL", "SYNTACTIC", "CONFIDENT"]

POSITIONAL = 0.90  # Voita et al. 2019, Sec. 5.1
SYNTACTIC = 0.10  # Sec. 5.2.1: accuracy at least 10 points over the positional baseline
CONFIDENT = 0.80  # Sec. 5.1: positional heads have confidence > 0.8 (the blog post: "more than 80%")
WORDS = "no number in the paper"
PARSED = "functions-parsed"  # the functions pass on the model's validation text, parsed

# The paper's own numbers, copied from Voita et al. 2019 (Tables 1 and 2, Sec. 6.2).
PAPER = {
    "enc_pruned_015": "WMT EN-RU: 10 of 48 encoder heads kept within 0.15 BLEU (Sec. 6.2; abstract: 38 pruned, "
                      "-0.15 BLEU)",
    "enc_pruned_025": "OpenSubtitles EN-RU: 4 of 48 encoder heads kept, -0.25 BLEU (Sec. 6.2)",
}
# Table 1 (EN-RU): (relation, direction label as functions/table1.json writes it) ->
# {data: (best head accuracy, positional baseline)}, in percent.
PAPER_TABLE1 = {
    ("nsubj", "v -> s"): {"WMT": (45, 35), "OpenSubtitles": (77, 45)},
    ("nsubj", "s -> v"): {"WMT": (52, 35), "OpenSubtitles": (70, 45)},
    ("dobj", "v -> o"): {"WMT": (78, 41), "OpenSubtitles": (61, 46)},
    ("dobj", "o -> v"): {"WMT": (73, 41), "OpenSubtitles": (84, 46)},
    ("amod", "noun -> adj"): {"WMT": (74, 72), "OpenSubtitles": (81, 80)},
    ("amod", "adj -> noun"): {"WMT": (82, 72), "OpenSubtitles": (81, 80)},
    ("advmod", "v -> adv"): {"WMT": (48, 46), "OpenSubtitles": (38, 33)},
    ("advmod", "adv -> v"): {"WMT": (52, 46), "OpenSubtitles": (42, 33)},
}
# Table 2 (EN-RU): data -> (full BLEU, [(enc/dec_self/dec_cross heads, BLEU pruned, BLEU from scratch)]).
PAPER_TABLE2 = {
    "WMT": (29.6, [((14, 31, 30), 29.62, 29.47), ((12, 21, 25), 29.36, 28.95), ((8, 13, 15), 29.06, 28.56),
                   ((5, 9, 12), 28.90, 28.41)]),
    "OpenSubtitles": (32.4, [((27, 31, 46), 32.24, 32.23), ((13, 17, 31), 32.23, 31.98), ((6, 9, 13), 32.27, 31.84)]),
}


def _syntactic(accuracy: float, baseline: float, reading: str) -> bool:
    """The paper's "at least 10% higher than the baseline": 10 points, or 10% of the baseline."""
    return accuracy >= (baseline + SYNTACTIC if reading == "points" else baseline * (1 + SYNTACTIC)) - 1e-12


def _paper_table1_count(data: str, reading: str) -> int:
    return sum(_syntactic(v[data][0] / 100, v[data][1] / 100, reading) for v in PAPER_TABLE1.values())


@dataclass
class Cell:
    value: str
    verdict: str = "-"


@dataclass
class Check:
    label: str
    paper: str
    cells: dict[str, Cell] = field(default_factory=dict)
    criterion: str = ""


@dataclass
class Claim:
    key: str
    title: str
    statement: str
    stages: list[str]
    checks: list[Check] = field(default_factory=list)
    details: dict[str, list[str]] = field(default_factory=dict)  # model -> markdown lines
    figures: dict[str, str] = field(default_factory=dict)  # model -> figure name (without extension)
    notes: list[str] = field(default_factory=list)  # markdown lines shown above the table


def _head(kind_layer_head) -> str:
    _, layer, head = kind_layer_head
    return f"L{layer} H{head}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _missing(what: str, stage: str) -> Cell:
    return Cell("", f"not run: no {what} yet (stage `{stage}`)")


def _fill(checks: tuple[Check, ...], name: str, cell: Cell) -> None:
    """Give model ``name`` the same cell in every check (a missing input, an untestable premise)."""
    for check in checks:
        check.cells[name] = cell


def _enc(scores: HeadScores | None) -> np.ndarray | None:
    return None if scores is None or "enc_self" not in scores.scores else np.asarray(scores["enc_self"], dtype=float)


def _argmax(a: np.ndarray) -> tuple[int, int] | None:
    """(layer, head) of the largest value; None when every value is NaN."""
    if np.all(np.isnan(a)):
        return None
    flat = int(np.nanargmax(a))
    return divmod(flat, a.shape[1])


def _kept(point: dict, kind: str, shape: tuple[int, int] | None) -> np.ndarray:
    """:func:`kept_mask` of a point with a kept record, of a kind whose shape is known (checked before)."""
    assert shape is not None, f"no shape for {kind}"
    mask = kept_mask(point, kind, shape)
    assert mask is not None, "the point has no kept record"
    return mask


def _best(a: np.ndarray) -> tuple[int, int]:
    """:func:`_argmax` of values checked before not to be all NaN."""
    best = _argmax(a)
    assert best is not None, "every value is NaN"
    return best


def _rank_in_layer(values: np.ndarray, layer: int, head: int) -> int:
    """1 = the largest value of its layer."""
    row = np.nan_to_num(values[layer], nan=-np.inf)
    return int((row > row[head]).sum()) + 1


# ----------------------------------------------------------------------------- positional data


def _final_point(r: ModelResults) -> dict | None:
    """The specialisation stage's ``final`` point (the model itself), if it was measured."""
    return next((p for p in (r.specialisation or {}).get("checkpoints", []) if p["checkpoint"] == "final"), None)


def _positional(r: ModelResults) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """The primary positional measurement: in-domain (first N validation sentences), subword
    tokens, the final model (the specialisation stage's ``final`` point), as the paper measured
    on its own data over BPE tokens. Returns (share, offset, description); None (in the
    files: null) becomes NaN."""
    p = _final_point(r)
    if p is None:
        return None, None, ""
    share, offset = np.array(p["token_share"], dtype=float), np.array(p["token_offset"], dtype=float)
    return share, offset, f"{(r.specialisation or {})['n_sentences']} validation sentences, subword tokens"


def _positional_tokens(r: ModelResults) -> int:
    """Query tokens behind the in-domain positional shares (0 when the file does not say)."""
    p = _final_point(r)
    return int(p.get("n_tokens") or 0) if p else 0


def _function_scores(r: ModelResults) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Per encoder head: the in-domain positional share, the syntactic margin, the rare-token share."""
    share, _, _ = _positional(r)
    return share, _enc(r.functions_scores("syntactic_margin")), _enc(r.functions_scores("rare_rarest"))


def _function_masks(r: ModelResults) -> dict[str, np.ndarray] | None:
    """Boolean encoder masks per function (paper thresholds): positional, syntactic, rare."""
    share, margin, rarest = _function_scores(r)
    if share is None or margin is None or rarest is None:
        return None
    rare_mask = np.zeros(share.shape, dtype=bool)
    rare = _argmax(rarest)
    if rare is not None:  # None: no sentence qualified for the rare-token test
        rare_mask[rare] = True
    return {"positional": np.nan_to_num(share) >= POSITIONAL, "syntactic": np.nan_to_num(margin, nan=-1) >= SYNTACTIC - 1e-12,
            "rare": rare_mask}


# ----------------------------------------------------------------------------- sweeps


def _series(result: dict) -> str:
    """``fixed`` (a fixed lambda > 0: the paper's mode), ``budget`` (Lagrangian, ``keep``) or
    ``control`` (lambda = 0: the same fine-tuning with gates and no penalty)."""
    if result.get("keep") is not None:
        return "budget"
    return "fixed" if result.get("lam") else "control"


def _rows(sweep: dict) -> list[dict]:
    """One row per finished point: heads kept per kind, BLEU (sorted by total heads, descending)."""
    rows = []
    for name, point in sweep["points"].items():
        result = point["result"]
        kept = result.get("heads_kept", {})
        metrics = result.get("metrics", {})
        rows.append({"point": name, **{k: kept.get(k) for k in KINDS}, "heads": sum(kept.values()),
                     "bleu": metrics.get("bleu"), "polarized": metrics.get("polarized"), "total": result.get("heads_total", {}),
                     "lam": result.get("lam"), "keep": result.get("keep"), "step": result.get("step"),
                     "series": _series(result), "dev": result.get("dev")})
    return sorted(rows, key=lambda row: (-row["heads"], row["point"]))


def _pruning_points(sweep: dict) -> list[dict]:
    """The points that prune (every series but the lambda = 0 control)."""
    return [p for p in sweep["points"].values() if _series(p["result"]) != "control"]


def _survival(sweep: dict, kind: str, shape: tuple[int, int]) -> np.ndarray | None:
    """Share of the sweep's pruning points that keep each head: 1 = never pruned. (Pruning order.)"""
    masks = [m for m in (kept_mask(p, kind, shape) for p in _pruning_points(sweep)) if m is not None]
    return None if not masks else np.mean(masks, axis=0)


def _shape(r: ModelResults, kind: str) -> tuple[int, int] | None:
    for method in ("confidence", "lrp", "ablation"):
        s = r.importance(method)
        if s is not None and kind in s.scores:
            return s[kind].shape
    for sweep in ("enc", "all"):
        for p in r.sweep(sweep)["points"].values():
            if p["gates"] is not None and kind in p["gates"].scores:
                return p["gates"][kind].shape
    return None


# ----------------------------------------------------------------------------- claims


def _dominance(values: np.ndarray) -> tuple[float, float, int, float]:
    """One layer's LRP relevance by magnitude: (the largest |relevance|'s share of the layer's
    sum of |relevance|, largest / second largest |relevance| (inf when every other head has 0),
    head of the largest, its signed relevance). Signed LRP relevances can be negative (a layer
    can have no positive head at all), so a share of a signed sum is no share; a head's weight
    in the layer is its magnitude. NaN (a layer with no relevance) leaves the share undefined."""
    row = np.nan_to_num(np.asarray(values, dtype=float))
    size = np.abs(row)
    order = np.argsort(-size, kind="stable")
    top, second = size[order[0]], size[order[1]]
    total = size.sum()
    share = top / total if total > 0 else math.nan
    ratio = top / second if second > 0 else math.inf
    return float(share), float(ratio), int(order[0]), float(row[order[0]])


def _ratio(x: float) -> str:
    return "no other head with relevance" if math.isinf(x) else f"{x:.1f}x"


def _dominance_verdict(shares: list[float], n_heads: int) -> str:
    """Sec. 4's "a few heads dominate": every layer's top head holds at least twice the equal
    share. An undefined share (NaN) never fails it: the claim is then inconclusive."""
    bar = 2.0 / n_heads
    if any(not math.isnan(s) and s < bar for s in shares):
        return "does not hold"
    if any(math.isnan(s) for s in shares):
        return "inconclusive: a layer has no relevance to share"
    return "holds"


LOW_CONFIDENCE = 0.25  # Sec. 4's "low confidence": below the encoder's lower quartile (Figure 1 gives no number)


def _low_confidence_verdict(value: float, confidences: np.ndarray) -> tuple[str, float, float]:
    """Sec. 4: layer 1's most relevant head has low confidence. (verdict, lower quartile, median)
    of the encoder's confidences: holds below the lower quartile, does not hold at or above the
    median, inconclusive between them or when a number is undefined (NaN)."""
    values = np.asarray(confidences, dtype=float)
    quartile, median = float(np.nanquantile(values, LOW_CONFIDENCE)), float(np.nanmedian(values))
    if math.isnan(value) or math.isnan(median):
        return "inconclusive: a confidence is undefined", quartile, median
    if value < quartile:
        return "holds", quartile, median
    if value >= median:
        return "does not hold", quartile, median
    return "inconclusive: below the encoder median, not below its lower quartile", quartile, median


def _rho_verdict(rho: float, low: float, high: float) -> str:
    if low > 0:
        return "holds" if rho >= 0.5 else "partly"
    return "does not hold" if high < 0 else "inconclusive: the interval contains 0"


POOLING_NAMES = {"sum": "sum (default)", "first": "first subword", "max": "max"}


def _best_share(share: np.ndarray | None) -> str:
    """``36.7% (L4 H6)``: the largest share of a head, and which head."""
    if share is None or _argmax(share) is None:
        return "-"
    l, h = _best(share)
    return f"{_pct(share[l, h])} (L{l} H{h})"


def _poolings(r: ModelResults) -> list[str]:
    """The other word poolings with result files, in the order of POOLING_NAMES."""
    return [p for p in POOLING_NAMES if p != "sum" and r.functions_json("table1", f"functions-{p}") is not None]


def _mean_interval(mean: float, sd: float, n: int) -> tuple[float, float]:
    """95% normal interval of a mean of ``n`` per-sentence shares."""
    half = 1.959963984540054 * sd / math.sqrt(n) if n > 1 else math.nan
    return mean - half, mean + half


def claim_setting(results: dict[str, ModelResults]) -> Claim:
    c = Claim("setting", "What differs from the paper: training and pruning budgets",
              "How much each model and each pruning point was trained, against the paper's setting.", [])
    updates = Check("updates (epochs) behind the exported model", "not given in the paper (trained to convergence)")
    batch = Check("tokens per update (mean; target side)", "about 16,000 source tokens (App. B)")
    seen = Check("target tokens seen in training",
                 "not given; one epoch of WMT is about 2.5M pairs x 24 tokens = 60M tokens (Sec. 3, 6.3.2)")
    prune = Check("pruning points: method, fine-tuning updates, gates polarised (P(open) < 0.05 or > 0.95) at the end",
                  "fixed lambda (L_xent + lambda L_C) from the converged model, updates not given; at test time each "
                  "gate is set to 0 or 1 (Sec. 6.1, footnote 7)")
    weights = Check("weights the pruning results were made from (model_sha256 of prune/<sweep>/full.json) against "
                    "the bundled model's", "-")
    for name, r in results.items():
        history = r.train_history
        if not history:
            _fill((updates, batch, seen), name, Cell("no train_history.json in the model directory"))
        else:
            # The exported epoch's record: a run may have gone on after its best epoch.
            last = next((e for e in history if e["epoch"] == r.exported_epoch), history[-1])
            # The trainer's running count where it is recorded; else speed x time, which undercounts an
            # epoch that a resumed run began inside (its minutes count only the part after the resume).
            total = last.get("tokens_seen") or sum(e["tokens_per_s"] * e["epoch_minutes"] * 60
                                                   for e in history[: history.index(last) + 1])
            updates.cells[name] = Cell(f"{last['step']:,} ({last['epoch']} epochs of {history[0]['step']} updates)")
            batch.cells[name] = Cell(f"{total / last['step']:,.0f}")
            seen.cells[name] = Cell(f"{total / 1e6:.1f}M ({total / last['epoch'] / 1e6:.2f}M per epoch)")
        parts = [f"{sweep} {row['point']}: {_method(row)}, {row['step']} updates, {_pct(row['polarized'])} polarised"
                 for sweep in ("enc", "all") for row in _rows(r.sweep(sweep))]
        prune.cells[name] = Cell("; ".join(parts) if parts else "no pruning point")
        note = sweep_weights_note(r)
        weights.cells[name] = Cell(note[0] if note else "no pruning result")
    c.checks = [updates, batch, seen, prune, weights]
    return c


def sweep_weights_note(r: ModelResults) -> tuple[str, bool] | None:
    """(what the sweeps' full.json record against the bundled weights, whether they are the bundled
    ones); None when no sweep has a full.json."""
    recorded = {sweep: r.sweep_weights(sweep) for sweep in ("enc", "all") if r.sweep(sweep)["full"] is not None}
    if not recorded:
        return None
    now = r.bundled_weights
    if now is not None and all(sha == now for sha in recorded.values()):
        return f"the bundled weights ({now[:12]})", True
    made = ", ".join(f"{sweep}: {(sha or 'not recorded')[:12]}" for sweep, sha in recorded.items())
    if now is None:
        return f"{made}; the bundled model was not found, so they are not checked against it", False
    return (f"other weights than the bundled ones ({made}; bundled now: {now[:12]}); the sweep on the bundled "
            f"weights is pending"), False


def claim_sec4(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec4", "Section 4: a few heads dominate; relevance agrees with confidence",
              "In each encoder layer only a small number of heads are important by LRP; the most relevant heads "
              "are also the most confident; the exception is the most relevant head of the first layer, whose "
              "confidence is low (it is the rare-token head).", ["importance"])
    top = Check("LRP relevance by magnitude: the top head's share of its layer's total |relevance| (top / second "
                "head; the top head's sign), per encoder layer",
                f"in every layer a few heads carry most relevance (Sec. 4, Figure 1; {WORDS})",
                criterion="holds if in every encoder layer the head of largest |relevance| holds at least twice the "
                          "equal share (2/n_heads) of the layer's total |relevance|; does not hold if a layer's falls "
                          "below it; inconclusive if a layer has no relevance (share undefined)")
    agree = Check("Spearman's rho of LRP with confidence, encoder heads (95% bootstrap interval over heads)",
                  f"agree \"to a reasonable extent\" ({WORDS})",
                  criterion="holds if the interval excludes 0 and rho >= 0.5; partly if it excludes 0 and rho < 0.5; "
                            "inconclusive if it contains 0")
    first = Check("confidence of encoder layer 1's most relevant head, against the encoder's lower quartile and "
                  "median",
                  f"the most relevant head of layer 1 has low confidence (Sec. 4, Figure 1; {WORDS})",
                  criterion="holds if it is below the lower quartile of all encoder heads' confidence (low: among "
                            "the least confident quarter, as Figure 1 shows it); does not hold if it is at or above "
                            "the median; inconclusive in between")
    for name, r in results.items():
        lrp, conf = r.importance("lrp"), r.importance("confidence")
        if lrp is None or conf is None:
            _fill((top, agree, first), name, _missing("importance/lrp.json or confidence.json", "importance"))
            continue
        enc_lrp, enc_conf = _enc(lrp), _enc(conf)
        assert enc_lrp is not None and enc_conf is not None, "a translation model's scores have enc_self"
        n_heads = enc_lrp.shape[1]
        per_layer = [_dominance(row) for row in enc_lrp]
        top.cells[name] = Cell(", ".join(f"L{layer} H{h} {_pct(share)} ({_ratio(ratio)}{', negative' if sign < 0 else ''})"
                                         for layer, (share, ratio, h, sign) in enumerate(per_layer)) +
                               f" (equal share {_pct(1 / n_heads)})",
                               _dominance_verdict([share for share, _, _, _ in per_layer], n_heads))
        rho, low, high = spearman_interval(enc_lrp, enc_conf)
        agree.cells[name] = Cell(f"{rho:+.2f} [{low:+.2f}, {high:+.2f}]", _rho_verdict(rho, low, high))
        h0 = int(np.nanargmax(enc_lrp[0]))
        verdict, quartile, median = _low_confidence_verdict(float(enc_conf[0, h0]), enc_conf)
        value = f"L0 H{h0}: {_f(float(enc_conf[0, h0]))} (encoder lower quartile {quartile:.2f}, median {median:.2f})"
        first.cells[name] = Cell(value, verdict)
        c.figures[name] = "lrp-confidence"
    c.checks = [top, agree, first]
    return c


def claim_sec51(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec5.1", "Section 5.1: positional heads",
              "Positional heads (at least 90% of a head's maxima at one relative position, mostly -1 or +1) exist, "
              "are among the most relevant and confident heads, and have confidence above 0.8.",
              ["specialisation", "functions", "importance", "functions-parsed", "pooling"])
    exist = Check("encoder heads with >= 90% of maxima at one offset (in-domain, subword tokens) [95% interval of "
                  "the best head]",
                  "exist in every model, among the important encoder heads (Sec. 5.1; threshold 90%)",
                  criterion="holds if a head reaches 90% with its Wilson interval over query tokens above 90%; does "
                            "not hold if the best head's interval lies below 90%; inconclusive otherwise")
    ewt = Check("the same on UD EWT dev (words / subword tokens)", "-")
    relevant = Check("positional heads among the two most relevant (LRP) of their layer",
                     f"positional heads are among the most relevant of their layer (Sec. 5.1; {WORDS})",
                     criterion="holds if every positional head is first or second by LRP in its layer")
    confident = Check("confidence of the positional heads", "> 0.8 for every positional head, every language pair (Sec. 5.1)",
                      criterion="holds if every positional head has confidence > 0.8")
    interior = Check("sensitivity: the best head's positional share over words with both neighbours, against all "
                     "words (UD EWT dev; the validation text parsed)", "-")
    pooled = Check("sensitivity: the best head's positional share (words, UD EWT dev) under each subword-to-word "
                   "mapping: " + " / ".join(POOLING_NAMES.values()), "-")
    for name, r in results.items():
        share, offset, where = _positional(r)
        if share is None or offset is None or _argmax(share) is None:  # (offset is None with share)
            exist.cells[name] = _missing("specialisation.json (final model)", "specialisation")
            relevant.cells[name] = confident.cells[name] = Cell("", "not run: no positional measurement")
        else:
            heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(np.nan_to_num(share) >= POSITIONAL))]
            bl, bh = _best(share)
            n = _positional_tokens(r)
            low, high = _binomial_interval(float(share[bl, bh]), n) if n else (math.nan, math.nan)
            best = (f"best L{bl} H{bh} {_pct(share[bl, bh])} [{_pct(low)}, {_pct(high)}] at {int(offset[bl, bh]):+d} "
                    f"({n:,} query tokens)")
            verdict = "holds" if heads and low >= POSITIONAL else "does not hold" if high < POSITIONAL else \
                "inconclusive: the best head's interval contains 90%"
            exist.cells[name] = Cell(f"{len(heads)}; {best}", verdict)
            lrp, conf = _enc(r.importance("lrp")), _enc(r.importance("confidence"))
            if lrp is None or conf is None:
                relevant.cells[name] = confident.cells[name] = _missing("importance", "importance")
            elif not heads:
                relevant.cells[name] = Cell(f"no positional head; the closest, L{bl} H{bh}, is #"
                                            f"{_rank_in_layer(lrp, bl, bh)} by LRP in its layer",
                                            "not testable: no positional head")
                confident.cells[name] = Cell(f"closest head L{bl} H{bh}: {conf[bl, bh]:.2f}; encoder max "
                                             f"{np.nanmax(conf):.2f}", "not testable: no positional head")
            else:
                ranks = [_rank_in_layer(lrp, l, h) for l, h in heads]
                relevant.cells[name] = Cell(", ".join(f"L{l} H{h} #{k}" for (l, h), k in zip(heads, ranks)),
                                            "holds" if all(k <= 2 for k in ranks) else "does not hold")
                values = [conf[l, h] for l, h in heads]
                confident.cells[name] = Cell(", ".join(f"L{l} H{h} {v:.2f}" for (l, h), v in zip(heads, values)),
                                             "holds" if all(v > CONFIDENT for v in values) else "does not hold")
        word, token = _enc(r.functions_scores("positional_share")), _enc(r.functions_scores("token_share"))
        if word is None or token is None:
            ewt.cells[name] = _missing("functions/positional_share.json", "functions")
        else:
            ewt.cells[name] = Cell(f"words: {(np.nan_to_num(word) >= POSITIONAL).sum()} (max {_pct(np.nanmax(word))}); "
                                   f"tokens: {(np.nan_to_num(token) >= POSITIONAL).sum()} (max {_pct(np.nanmax(token))})")
        parts = []
        for text, run in (("EWT", "functions"), ("val", PARSED)):
            every, inner = r.functions_scores("positional_share", run), r.functions_scores("interior_share", run)
            if every is not None and inner is not None:
                inner_enc = _enc(inner)
                assert inner_enc is not None, "a translation model's scores have enc_self"
                parts.append(f"{text}: all words {_best_share(_enc(every))}, both neighbours {_best_share(inner_enc)}; "
                             f"heads >= 90%: {(np.nan_to_num(inner_enc) >= POSITIONAL).sum()}")
        interior.cells[name] = Cell("; ".join(parts)) if parts else \
            _missing("functions/interior_share.json", "functions")
        word = r.functions_scores("positional_share")
        if word is None or not _poolings(r):
            pooled.cells[name] = _missing("functions-first/positional_share.json", "pooling")
        else:
            shares = [_enc(word)] + [_enc(r.functions_scores("positional_share", f"functions-{p}")) for p in _poolings(r)]
            pooled.cells[name] = Cell(" / ".join(_best_share(x) for x in shares))
    c.checks = [exist, ewt, relevant, confident, interior, pooled]
    return c


def _binomial_interval(p: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a proportion ``p`` measured on ``n`` items."""
    z = 1.959963984540054
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _table1_cells(table: dict) -> tuple[Cell, Cell | None]:
    """Relation-directions with a syntactic head under both readings, and the largest margin."""
    rows = [row for row in table["table"] if row.get("status") == "ok" and row.get("best_head")]
    counts, verdicts = [], []
    for reading in ("points", "relative"):
        above, below = [], []
        for row in rows:
            low, high = _binomial_interval(row["best_accuracy"], row["n_arcs"])
            bar = row["baseline"] + SYNTACTIC if reading == "points" else row["baseline"] * (1 + SYNTACTIC)
            above += [row] if low >= bar else []
            below += [row] if high < bar else []
        met = [row for row in rows if _syntactic(row["best_accuracy"], row["baseline"], reading)]
        counts.append(len(met))
        verdicts.append("holds" if above else "does not hold" if len(below) == len(rows) else
                        "inconclusive: a best head's interval contains the bar")
    verdict = _readings_verdict(counts, verdicts)
    margins = [(row["best_accuracy"] - row["baseline"], row) for row in rows]
    best = None
    if margins:
        m, row = max(margins, key=lambda t: t[0])
        l, h = row["best_head"]
        best = Cell(f"{100 * m:+.1f} points ({row['relation']} {row['label']}, L{l} H{h})")
    return Cell(f"{counts[0]} / {counts[1]} of {len(rows)}", verdict), best


def _readings_verdict(counts: list[int], verdicts: list[str]) -> str:
    """One verdict from the points and the relative reading of "10% higher". ``partly`` only when
    one reading holds and the other does not; no syntactic head under either reading (both counts
    0) does not hold, whatever the intervals of the best heads (a zero count is never ``partly``);
    otherwise inconclusive, naming both readings."""
    if verdicts[0] == verdicts[1]:
        return verdicts[0]
    named = f"{verdicts[0].split(':')[0]} under the points reading, {verdicts[1].split(':')[0]} under the relative"
    if not any(counts):
        return f"does not hold: no relation-direction meets the bar under either reading ({named})"
    if "holds" in verdicts:
        return f"partly: {named}"
    return f"inconclusive: {named}"


def _table1_lines(table: dict) -> list[str]:
    lines = ["| relation | direction | arcs | best head | accuracy [95% interval] | baseline (offset) | "
             "heads >= baseline + 10 points | heads >= 1.1 x baseline | paper WMT: accuracy / baseline |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in table["table"]:
        paper = PAPER_TABLE1.get((row["relation"], row.get("label", "")), {}).get("WMT")
        paper_cell = f"{paper[0]}% / {paper[1]}%" if paper else ""
        if row.get("status") != "ok":
            lines.append(f"| {row['relation']} | {row.get('label', '')} | 0 | absent from the data | | | | | "
                         f"{paper_cell} |")
            continue
        l, h = row["best_head"]
        low, high = _binomial_interval(row["best_accuracy"], row["n_arcs"])
        lines.append(f"| {row['relation']} | {row['label']} | {row['n_arcs']:,} | L{l} H{h} | "
                     f"{_pct(row['best_accuracy'])} [{_pct(low)}, {_pct(high)}] | {_pct(row['baseline'])} "
                     f"({row['baseline_offset']:+d}) | {row['n_syntactic']} | "
                     f"{'>= 1' if _syntactic(row['best_accuracy'], row['baseline'], 'relative') else 0} | "
                     f"{paper_cell} |")
    return lines


def _parser_text(parser: dict | None) -> str:
    if not parser:
        return "the EWT parser"
    return (f"the EWT parser (EWT test, gold words: UAS {_pct(parser['uas'])}, LAS {_pct(parser['las'])}, "
            f"UPOS {_pct(parser['upos'])})")


def claim_sec52(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec5.2", "Section 5.2: syntactic heads (Table 1 analogue)",
              "For some dependency relations (nsubj, dobj, amod, advmod) an encoder head points to the related word "
              "\"at least 10% higher\" than the relation's most frequent relative position.",
              ["functions", "functions-parsed", "pooling"])
    paper_count = (f"WMT: {_paper_table1_count('WMT', 'points')} / {_paper_table1_count('WMT', 'relative')} of 8; "
                   f"OpenSubtitles: {_paper_table1_count('OpenSubtitles', 'points')} / "
                   f"{_paper_table1_count('OpenSubtitles', 'relative')} of 8 (Table 1, EN-RU)")
    criterion = ("per reading: holds if a best head's 95% Wilson interval lies above the bar, does not hold if every "
                 "best head's interval lies below it, inconclusive otherwise; when the readings disagree: partly if "
                 "one holds, does not hold if no relation-direction meets the bar under either (a zero count), "
                 "inconclusive otherwise (both are named)")
    check = Check("relation-directions with a syntactic head: points reading (accuracy >= baseline + 10 points) / "
                  "relative reading (accuracy >= 1.1 x baseline), UD EWT dev gold trees",
                  paper_count, criterion=criterion)
    parsed = Check("the same in domain: the model's validation text parsed by models/ewt-parser, "
                   "as the paper parsed its own text (CoreNLP)", paper_count, criterion=criterion)
    paper_best = max(PAPER_TABLE1.items(), key=lambda kv: kv[1]["WMT"][0] - kv[1]["WMT"][1])
    (rel, label), numbers = paper_best
    best = Check("largest margin of a head over the baseline (points): EWT gold / validation text parsed",
                 f"WMT: {numbers['WMT'][0] - numbers['WMT'][1]:+d} points ({rel} {label}, "
                 f"{numbers['WMT'][0]} vs {numbers['WMT'][1]})")
    pooled = Check("sensitivity: the EWT gold-tree count and largest margin under each subword-to-word mapping: "
                   + " / ".join(POOLING_NAMES.values()), "-")
    for name, r in results.items():
        table, table_parsed = r.functions_json("table1"), r.functions_json("table1", PARSED)
        margins = []
        for count_check, data, run in ((check, table, "functions"), (parsed, table_parsed, PARSED)):
            if data is None:
                count_check.cells[name] = _missing(f"{run}/table1.json", run)
            else:
                count_check.cells[name], margin = _table1_cells(data)
                margins.append(margin.value if margin else "-")
        best.cells[name] = Cell(" / ".join(margins)) if margins else _missing("functions/table1.json", "functions")
        lines: list[str] = []
        if table is not None:
            lines += ["UD EWT dev, gold trees:", ""] + _table1_lines(table)
        if table_parsed is not None:
            summary = r.functions_json("summary", PARSED) or {}
            n = (summary.get("report") or {}).get("n_sentences")
            parser = _parser_text(r.functions_json("parser", PARSED))
            text = r.parsed_text or "the validation text"
            lines += ([""] if lines else []) + [
                f"{text}{f' ({n:,} sentences)' if n else ''}, parsed by {parser}:", ""] + _table1_lines(table_parsed)
        if lines:
            c.details[name] = lines
        if table is None or not _poolings(r):
            pooled.cells[name] = _missing("functions-first/table1.json", "pooling")
            continue
        parts = []
        for pooling, data in [("sum", table)] + [(p, r.functions_json("table1", f"functions-{p}")) for p in _poolings(r)]:
            count, margin = _table1_cells(data)
            parts.append(f"{POOLING_NAMES[pooling]}: {count.value} ({count.verdict.split(':')[0]}), "
                         f"{margin.value.split(' (')[0] if margin else '-'}")
        pooled.cells[name] = Cell("; ".join(parts))
    c.checks = [check, parsed, best, pooled]
    return c


def claim_sec53(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec5.3", "Section 5.3: the rare-token head",
              "A head of the first encoder layer points to the least frequent token of the sentence; it is the most "
              "relevant head of that layer.", ["functions", "importance"])
    where = Check("the encoder head pointing most often to the rarest token, and its layer [95% intervals: it / the "
                  "best head of the other layers or of layer 1]",
                  f"a head of the first layer, in every model (Sec. 5.3; {WORDS})",
                  criterion="holds if it is in encoder layer 1 (L0) and its Wilson interval over the query tokens it "
                            "was measured on lies above the best other layer's head; does not hold if it is elsewhere "
                            "and its interval lies above layer 1's best head; inconclusive if the intervals overlap")
    sentence = Check("sensitivity: the same per sentence (each eligible sentence's share of its query tokens, averaged "
                     "over sentences) [95% normal intervals over sentences]", "-")
    relevant = Check("it is the most relevant (LRP) head of layer 1",
                     f"ranked by LRP far above the other heads of layer 1 (Sec. 5.3; {WORDS})",
                     criterion="holds if the top rare-token head is in L0 and first by LRP there")
    pct = Check("rarest / one of the two rarest tokens, top head",
                "OpenSubtitles: 66% / 83%; WMT: two rarest in more than 50% (Sec. 5.3)")
    layer0 = Check("rarest / two rarest, layer 1's best head; mean of all encoder heads", "-")
    for name, r in results.items():
        rarest, two = _enc(r.functions_scores("rare_rarest")), _enc(r.functions_scores("rare_two_rarest"))
        if rarest is None or two is None:
            _fill((where, relevant, pct, layer0), name, _missing("functions/rare_rarest.json", "functions"))
            continue
        if _argmax(rarest) is None:
            _fill((where, relevant, pct, layer0), name, Cell("no sentence has its rarest token outside the most frequent ones",
                                                             "not testable: no qualifying sentence"))
            continue
        l, h = _best(rarest)
        rl, rh = _rival(rarest, l)
        per_sentence = r.functions_json("rare_per_sentence")
        if per_sentence is not None:  # query tokens per head: the unit the shares are measured on
            tokens = np.array([per_sentence[f"enc_self:{layer}"]["query_tokens"] for layer in range(rarest.shape[0])])
            n, n_rival, unit = int(tokens[l, h]), int(tokens[rl, rh]), "query tokens"
        else:  # older result files: only the sentence count
            n = n_rival = int(((r.functions_json("rare_summary") or {}).get("n_eligible") or {}).get("enc_self") or 0)
            unit = "sentences"
        if n and n_rival:
            top_iv = _binomial_interval(float(rarest[l, h]), n)
            rival_iv = _binomial_interval(float(rarest[rl, rh]), n_rival)
            apart = top_iv[0] > rival_iv[1]
            value = (f"L{l} H{h} [{_pct(top_iv[0])}, {_pct(top_iv[1])}]; L{rl} H{rh} [{_pct(rival_iv[0])}, "
                     f"{_pct(rival_iv[1])}] ({n:,} {unit})")
            verdict = ("holds" if l == 0 else "does not hold") if apart else "inconclusive: the intervals overlap"
        else:
            value, verdict = f"L{l} H{h}", "inconclusive: no count in rare_summary.json"
        where.cells[name] = Cell(value, verdict)
        sentence.cells[name] = _per_sentence_cell(per_sentence, rarest.shape)
        pct.cells[name] = Cell(f"{_pct(rarest[l, h])} / {_pct(two[l, h])}")
        h0 = int(np.nanargmax(rarest[0]))
        layer0.cells[name] = Cell(f"L0 H{h0}: {_pct(rarest[0, h0])} / {_pct(two[0, h0])}; mean "
                                  f"{_pct(np.nanmean(rarest))} / {_pct(np.nanmean(two))}")
        lrp = _enc(r.importance("lrp"))
        if lrp is None:
            relevant.cells[name] = _missing("importance/lrp.json", "importance")
        else:
            top0 = int(np.nanargmax(lrp[0]))
            ok = l == 0 and top0 == h
            relevant.cells[name] = Cell(f"layer 1's most relevant head: L0 H{top0}", "holds" if ok else "does not hold")
    c.checks = [where, relevant, pct, layer0, sentence]
    return c


def _rival(shares: np.ndarray, layer: int) -> tuple[int, int]:
    """The best head outside layer 1 when ``layer`` is layer 1 (L0), else layer 1's best head."""
    rival = shares.copy()
    if layer == 0:
        rival[0] = np.nan
    else:
        rival[1:] = np.nan
    return _best(rival)


def _per_sentence_cell(data: dict | None, shape: tuple[int, int]) -> Cell:
    """The rare-token head under the per-sentence reading: which head, its layer, intervals over sentences."""
    if data is None:
        return _missing("functions/rare_per_sentence.json", "functions")
    rows = [data[f"enc_self:{layer}"] for layer in range(shape[0])]
    mean = np.array([row["rarest_mean"] for row in rows], dtype=float)  # None (null) -> NaN
    sd = np.array([row["rarest_sd"] for row in rows], dtype=float)
    n = np.array([row["sentences"] for row in rows])
    if _argmax(mean) is None:
        return Cell("no eligible sentence")
    l, h = _best(mean)
    rl, rh = _rival(mean, l)
    top_iv = _mean_interval(mean[l, h], sd[l, h], int(n[l, h]))
    rival_iv = _mean_interval(mean[rl, rh], sd[rl, rh], int(n[rl, rh]))
    apart = top_iv[0] > rival_iv[1]
    reading = ("in layer 1, apart" if l == 0 else "outside layer 1, apart") if apart else "intervals overlap"
    return Cell(f"L{l} H{h} {_pct(mean[l, h])} [{_pct(top_iv[0])}, {_pct(top_iv[1])}]; L{rl} H{rh} "
                f"{_pct(mean[rl, rh])} [{_pct(rival_iv[0])}, {_pct(rival_iv[1])}] ({int(n[l, h]):,} sentences; "
                f"{reading})")


def _baseline_means(rows: list[dict], kind: str = "enc_self") -> dict[str, dict[int, float]]:
    groups: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row.get("bleu") is None or row.get("from_scratch"):
            continue
        steps = row.get("finetune_steps")
        label = row["method"] + (f" + {steps} updates of all weights" if steps else ", not fine-tuned")
        kept = row.get("heads_kept", {}).get(kind, row["keep"])
        groups.setdefault((label, kept), []).append(row["bleu"])
    out: dict[str, dict[int, float]] = {}
    for (label, kept), values in groups.items():
        out.setdefault(label, {})[kept] = float(np.mean(values))
    return out


def _delta(r: ModelResults, sweep: str, row: dict, reference: float, base: str = "full") -> dict:
    """A sweep point's BLEU change against the full model (or the translations ``base``, e.g. the
    lambda = 0 control's ``enc-lam-0``, whose BLEU is ``reference``) with its 95% interval.

    ``paired``: paired bootstrap over test sentences (both translations on file, and each gives
    the BLEU its result file records). ``bound``: no such translations of the point (its weights
    were not kept): the change plus or minus twice the base's bootstrap half-width, an unpaired
    bound that takes the point's spread to equal the base's. ``none``: not even the base's
    translations exist."""
    delta = row["bleu"] - reference
    refs, full = r.references, r.hypotheses(base)
    if refs is None or full is None or len(full) != len(refs):
        return {"delta": delta, "kind": "none"}
    system = r.hypotheses(f"{sweep}-{row['point']}")
    if system is not None and len(system) == len(refs):
        out = paired_bootstrap(full, system, refs)
        # Translations that do not give the result files' BLEU come from other weights: not used.
        if abs(out["baseline"] - reference) < 0.01 and abs(out["system"] - row["bleu"]) < 0.01:
            return {**out, "kind": "paired"}
    _, low, high = bleu_interval(full, refs)
    half = high - low  # twice the half-width
    return {"delta": delta, "low": delta - half, "high": delta + half, "kind": "bound"}


def _scratch_delta(r: ModelResults, row: dict, scratch_bleu: float, *, sweep: str = "all",
                   name: str | None = None) -> dict:
    """A sweep point's BLEU minus that of the same configuration trained from scratch (translations
    ``name``, by default ``scratch-<heads>``), with its 95% interval: paired bootstrap when both
    translations are on file (and give both BLEUs), else the unpaired bound of :func:`_delta`
    around the pruned point's own bootstrap."""
    delta = row["bleu"] - scratch_bleu
    refs, pruned = r.references, r.hypotheses(f"{sweep}-{row['point']}")
    if refs is None or pruned is None or len(pruned) != len(refs):
        return {"delta": delta, "kind": "none"}
    scratch = r.hypotheses(name or f"scratch-{row['heads']}")
    if scratch is not None and len(scratch) == len(refs):
        out = paired_bootstrap(scratch, pruned, refs)
        if abs(out["baseline"] - scratch_bleu) < 0.01 and abs(out["system"] - row["bleu"]) < 0.01:
            return {**out, "kind": "paired"}
    _, low, high = bleu_interval(pruned, refs)
    return {"delta": delta, "low": delta - (high - low), "high": delta + (high - low), "kind": "bound"}


def _versus_scratch(deltas: list[dict]) -> str:
    if any(d["kind"] == "none" for d in deltas):
        return "inconclusive: no interval (translations not on file)"
    if all(d["low"] > 0 for d in deltas):
        return "holds"
    if all(d["high"] < 0 for d in deltas):
        return "does not hold"
    if all(d["low"] <= 0 <= d["high"] for d in deltas):
        return "no difference"
    return "inconclusive"


def _interval(d: dict) -> str:
    if d["kind"] == "none":
        return f"{d['delta']:+.2f} (no interval)"
    mark = "" if d["kind"] == "paired" else " (unpaired bound)"
    return f"{d['delta']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]{mark}"


NOTICEABLE_BLEU = 0.15  # "no noticeable loss": the drop the paper itself calls small (abstract and Sec. 6.2: 38 of
# 48 encoder heads pruned at -0.15 BLEU); the non-inferiority bound of every "no (noticeable) loss" row


def _unsettled(row: dict | None) -> str | None:
    """Why a point's BLEU is not settled, or None when it is: its development curve over the second
    half of its updates excludes a further gain of FLAT_BLEU (``flat``, headlab.pruning.dev). A
    point still rising, undecided or without a curve has a BLEU cost that more fine-tuning may
    change, so no verdict may rest on it."""
    if row is None:
        return None
    plateau = (row.get("dev") or {}).get("plateau")
    if plateau is None:
        return "no development curve"
    call = plateau.get("call")
    if call == "flat":
        return None
    change = f"{plateau['delta']:+.2f} [{plateau['low']:+.2f}, {plateau['high']:+.2f}] over its second half"
    return f"still rising, {change}" if call == "rising" else f"may still rise, {change}"


def _settled(verdict: str, rows: list[dict | None]) -> str:
    """``verdict`` when every point it rests on has settled; else inconclusive, naming the first that has not."""
    if verdict.startswith(("inconclusive", "not ")):
        return verdict
    for row in rows:
        why = _unsettled(row)
        if why is not None and row is not None:  # (a row of None is settled: why is None)
            return f"inconclusive: {row['point']} has not settled ({why})"
    return verdict


def _non_inferior(small: list[tuple[dict, dict | None]], larger: tuple[int, dict, dict | None] | None,
                  d: float, what: str) -> str:
    """The one non-inferiority rule of every "within d BLEU" / "no noticeable loss" row. ``small``:
    (change, point row) of the points that meet the row's head condition; ``larger``: (heads, change,
    row) of the next larger point, or None. Holds if a point's interval lies above -d (its loss
    excludes more than d); does not hold if every such point and the next larger one lie below -d
    (fewer heads assumed to cost no less); inconclusive otherwise: an interval that contains 0 but
    reaches below -d is not "no loss". Each verdict needs the points it rests on settled
    (:func:`_unsettled`)."""
    def known(x):
        return x["kind"] != "none"

    witnesses = [row for x, row in small if known(x) and x["low"] >= -d]
    if witnesses:
        return next(("holds" for row in witnesses if _unsettled(row) is None), None) or _settled("holds", witnesses[:1])
    decided_small = all(known(x) and x["high"] < -d for x, _ in small)
    if larger is not None and known(larger[1]) and larger[1]["high"] < -d and decided_small:
        return _settled("does not hold", [row for _, row in small] + [larger[2]])
    if not all(known(x) for x, _ in small):
        return "inconclusive: a point has no interval"
    if not decided_small:
        return f"inconclusive: an interval reaches below -{d}"
    if larger is None:
        return f"inconclusive: no point between {what} and the full model"
    if not known(larger[1]):
        return "inconclusive: a point has no interval"
    return f"inconclusive: the next larger point ({larger[0]} heads) does not lie below -{d}"


def _within(points: list[tuple], n: int, d: float) -> str:
    """Is some point with at most ``n`` heads within ``d`` BLEU of the full model? (the verdict;
    ``points``: (heads, change) or (heads, change, point row), the row for :func:`_unsettled`)."""
    points = [(p[0], p[1], p[2] if len(p) > 2 else None) for p in points]
    small = [(x, row) for k, x, row in points if k <= n]
    large = sorted([p for p in points if p[0] > n], key=lambda t: t[0])
    return _non_inferior(small, large[0] if large else None, d, f"{n} heads")


FLAT = "holds if the interval's upper end is below +{tol} BLEU (a further gain of {tol} BLEU over as many updates is " \
       "excluded; a decline counts as stopped); does not hold if the interval lies above 0 (still rising); " \
       "inconclusive otherwise"


def _control(rows: list[dict]) -> dict | None:
    """The lambda = 0 control among a sweep's rows (the first, if several)."""
    return next((row for row in rows if row["series"] == "control"), None)


def _flat_cell(row: dict | None, sweep: str) -> Cell:
    """Whether the control's fine-tuning stopped moving, from its development curve's plateau."""
    if row is None:
        return _missing("lambda = 0 point", f"prune-{sweep}")
    flat = (row.get("dev") or {}).get("plateau")
    if flat is None and row.get("dev"):
        return Cell(f"{row['point']}: {len(row['dev']['curve'])} development evaluation(s)",
                    "inconclusive: fewer than two evaluations with their translations")
    if flat is None:
        return Cell(f"{row['point']}: no development curve", f"not run: {row['point']} ran without --dev-every "
                                                             f"(stage `prune-{sweep}`)")
    text = (f"{row['point']}: {flat['delta']:+.2f} [{flat['low']:+.2f}, {flat['high']:+.2f}] from update "
            f"{flat['from_step']} to {flat['to_step']} ({row['dev']['n_sentences']:,} sentences)")
    verdict = {"flat": "holds", "rising": "does not hold: still rising"}.get(
        flat["call"], f"inconclusive: the interval contains 0 and reaches +{flat['tolerance']}")
    return Cell(text, verdict)


def _control_cells(r: ModelResults, sweep: str, rows: list[dict], reference: float,
                   kind: str) -> tuple[Cell, Cell, dict[str, dict]]:
    """The control against the full model, the fixed-lambda points against the control, and
    those changes by point (for the details table)."""
    control = _control(rows)
    if control is None:
        cell = _missing("lambda = 0 point", f"prune-{sweep}")
        return cell, cell, {}
    own = _delta(r, sweep, control, reference)
    versus = {row["point"]: _delta(r, sweep, row, control["bleu"], base=f"{sweep}-{control['point']}")
              for row in rows if row["series"] == "fixed"}
    listing = "; ".join(f"{_heads(row[kind]) if kind else _heads(row['heads'])} (lambda {row['lam']:g}): "
                        f"{_interval(versus[row['point']])}" for row in rows if row["point"] in versus)
    return (Cell(f"{control['point']} ({control['step']} updates): {_f(control['bleu'])}, {_interval(own)}"),
            Cell(listing or "no fixed-lambda point"), versus)


def _tied_at_cut(row: dict, record: dict) -> bool:
    """Whether a development point's heads were chosen by position among tied gates: its record says so
    (``tied_at_cut``, from session 45), or it is a budget point's step 0, where every gate has the same initial log
    alpha (the records written before say nothing)."""
    return bool(record.get("tied_at_cut")) or (record["step"] == 0 and row.get("keep") is not None)


def _dev_table(rows: list[dict], kind: str | None) -> list[str]:
    """Development BLEU (greedy) at each evaluated update, per point with a curve; in brackets the
    heads whose test-time gate is open (``kind``, or all gated kinds)."""
    curves = [row for row in rows if (row.get("dev") or {}).get("curve")]
    if not curves:
        return []
    steps = sorted({record["step"] for row in curves for record in row["dev"]["curve"]})
    n = curves[0]["dev"]["n_sentences"]
    lines = ["", f"Development curves: greedy BLEU on the first {n:,} validation sentences after each number of "
                 f"updates (in brackets: {kind or 'gated'} heads open at that step).", "",
             "| updates | " + " | ".join(row["point"] for row in curves) + " |",
             "|---:|" + "---:|" * len(curves)]
    for step in steps:
        cells = []
        for row in curves:
            record = next((x for x in row["dev"]["curve"] if x["step"] == step), None)
            if record is None:
                cells.append("")
                continue
            heads = record["heads_open"].get(kind) if kind else sum(record["heads_open"].values())
            cells.append(f"{record['bleu']:.2f} ({heads}){' †' if _tied_at_cut(row, record) else ''}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if any(_tied_at_cut(row, record) for row in curves for record in row["dev"]["curve"]):
        lines += ["", "† the budget's cut fell among gates of equal log alpha (every gate before the first update), so "
                      "position, not the gates, chose which of those heads were evaluated."]
    return lines


def _flat_check() -> Check:
    """The row that calls, from the lambda = 0 control's development curve, whether fine-tuning stopped moving."""
    return Check("fine-tuning has stopped moving: development BLEU of the lambda = 0 control over the second half of "
                 "its updates (change [95% paired interval])",
                 "the paper fine-tunes a converged model; the number of updates is not given",
                 criterion=FLAT.format(tol=FLAT_BLEU))


def claim_sec62(results: dict[str, ModelResults], targets=((10, 0.15), (4, 0.25))) -> Claim:
    c = Claim("sec6.2", "Section 6.2: pruning encoder heads (Figure 7)",
              "With the decoder fixed, most encoder heads can be removed with Hard Concrete gates and an L0 penalty "
              "at a small cost in BLEU.", ["prune-enc", "hypotheses", "baselines", "scratch"])
    full = Check("BLEU of the full model on the sweep's evaluation set [95% bootstrap interval]",
                 "29.6 (WMT), 32.4 (OpenSubtitles) (Table 2; beam search)")
    control = Check("fine-tuning alone: the lambda = 0 control (gates, no penalty, the same updates) against the full "
                    "model (change [95% interval])",
                    "no such control in the paper: its pruned models are fine-tuned, its full model is not")
    flat = _flat_check()
    paper = {0.15: PAPER["enc_pruned_015"], 0.25: PAPER["enc_pruned_025"]}
    needed = {(n, d): Check(f"{n} or fewer encoder heads within {d} BLEU of the full model, fixed-lambda points (the "
                            f"paper's mode; change [95% interval] per point)", paper[d],
                            criterion=f"holds if a point with <= {n} heads has its interval above -{d}; does not hold "
                                      f"if those points and the next larger one all lie below -{d} (fewer heads "
                                      f"assumed to cost no less); inconclusive otherwise, and whenever a point the "
                                      f"verdict rests on has not settled (development BLEU still able to rise by "
                                      f"{FLAT_BLEU} over its second half, or no curve)")
              for n, d in targets}
    versus = Check("the fixed-lambda points against the lambda = 0 control (change [95% interval]): what the penalty "
                   "costs beyond fine-tuning", "-")
    footnote = Check("fine-tuning with the penalty against training with it from the start, or the same heads from "
                     "scratch", "fine-tuning better by 0.2 to 0.6 BLEU (footnote 8)",
                     criterion="the same heads from scratch (encoder heads of a fixed-lambda point, decoder whole): "
                               "as Table 2's row; partly while the run with the penalty from the start is not made")
    for name, r in results.items():
        sweep = r.sweep("enc")
        rows = [row for row in _rows(sweep) if row["bleu"] is not None]
        if sweep["full"] is None or not rows:
            _fill((full, control, flat, versus, footnote, *needed.values()), name,
                  _missing("prune/enc points", "prune-enc"))
            continue
        reference = sweep["full"]["metrics"]["bleu"]
        refs, hyps = r.references, r.hypotheses("full")
        if refs is not None and hyps is not None and len(hyps) == len(refs):
            _, low, high = bleu_interval(hyps, refs)
            full.cells[name] = Cell(f"{reference:.2f} [{low:.2f}, {high:.2f}] ({sweep['full']['heads_kept']['enc_self']} "
                                    f"encoder heads, beam {sweep['full']['metrics'].get('beam', '?')})")
        else:
            full.cells[name] = Cell(f"{reference:.2f} (no interval: stage `hypotheses` not run)")
        deltas = {row["point"]: _delta(r, "enc", row, reference) for row in rows}
        control.cells[name], versus.cells[name], against = _control_cells(r, "enc", rows, reference, "enc_self")
        flat.cells[name] = _flat_cell(_control(rows), "enc")
        fixed = [row for row in rows if row["series"] == "fixed"]
        points = [(row["enc_self"], deltas[row["point"]], row) for row in fixed]
        listing = "; ".join(f"{_heads(row['enc_self'])}: {_interval(deltas[row['point']])}" for row in fixed)
        for (n, d), check in needed.items():
            check.cells[name] = Cell(listing, _within(points, n, d)) if fixed else \
                _no_fixed("prune-enc")
        footnote.cells[name] = _footnote_cell(r, fixed)
        means = _baseline_means(r.baselines)
        lines = ["| point | method | updates | gates polarised | encoder heads | BLEU | change [95% interval] | "
                 "p | against lambda = 0 [95% interval] | dev BLEU, second half [95% interval] | " +
                 " | ".join(means) + " |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(means)]
        for row in rows:
            others = [f"{means[label][row['enc_self']]:.2f}" if row["enc_self"] in means[label] else ""
                      for label in means]
            x = deltas[row["point"]]
            lines.append(f"{_point_cells(row)} {row['enc_self']} | {_f(row['bleu'])} | {_interval(x)} | "
                         f"{_f(x.get('p'), 3) if x['kind'] == 'paired' else ''} | "
                         f"{_interval(against[row['point']]) if row['point'] in against else ''} | {_dev_change(row)} | "
                         + " | ".join(others) + " |")
        lines += _stale_note(sweep) + _dev_table(rows, "enc_self")
        c.details[name] = lines
        c.figures[name] = "fig7"
    c.checks = [full, control, flat, *needed.values(), versus, footnote]
    return c


def _per_kind(row: dict) -> tuple[int, ...]:
    """A sweep point's heads kept per kind, in KINDS' order (a from-scratch run's key)."""
    return tuple(row.get(k) or 0 for k in KINDS)


def _footnote_value(matched: list[tuple]) -> str:
    """Footnote 8's cell: each fixed-lambda point against the same encoder heads from scratch."""
    return "; ".join(f"{_heads(row['enc_self'])} ({row['point']}): {row['bleu']:.2f} vs {s:.2f} from scratch, "
                     f"{_interval(d)}" for row, s, d in matched)


def _footnote_cell(r: ModelResults, fixed: list[dict]) -> Cell:
    """Footnote 8: fixed-lambda encoder points against their heads trained from scratch (the run
    trained with the penalty from the start is not a stage: that half stays not run)."""
    scratch = {row["heads_kept"]["enc_self"]: row["bleu"] for row in r.scratch_enc
               if row.get("from_scratch") and row.get("bleu") is not None}
    matched = [(row, scratch[row["enc_self"]],
                _scratch_delta(r, row, scratch[row["enc_self"]], sweep="enc", name=f"scratch-enc-{row['enc_self']}"))
               for row in fixed if row["enc_self"] in scratch]
    if not matched:
        return Cell("", "not run: no run trained with the penalty from the start, no encoder-only from-scratch run "
                        "(config scratch.enc_points)")
    verdict = _settled(_versus_scratch([d for _, _, d in matched]), [row for row, _, _ in matched])
    if verdict.startswith("inconclusive"):
        return Cell(_footnote_value(matched), verdict)
    verdict = verdict.split(":")[0]
    value = _footnote_value(matched)
    if verdict == "holds":
        return Cell(value, "partly: above the same heads from scratch; training with the penalty from the start not run")
    return Cell(value, f"{verdict}: against the same heads from scratch; training with the penalty from the start "
                       "not run")


def _no_fixed(stage: str) -> Cell:
    return Cell("", f"not run: no fixed-lambda point yet (stage `{stage}`); the budget points are another method")


def _dev_change(row: dict) -> str:
    flat = (row.get("dev") or {}).get("plateau")
    if flat is None:
        return ""
    return f"{flat['delta']:+.2f} [{flat['low']:+.2f}, {flat['high']:+.2f}]"


def _stale_note(sweep: dict) -> list[str]:
    if not sweep.get("stale"):
        return []
    return ["", f"Not used: {', '.join(sweep['stale'])}, made from other weights than the full model's result "
                "(a model retrained since; `python -m reproduction` redoes them)."]


def _heads(n: int) -> str:
    return f"{n} head" if n == 1 else f"{n} heads"


def _method(row: dict) -> str:
    """The paper's mode is a fixed penalty (lambda); a budget point is a different method."""
    if row.get("keep") is not None:
        return f"budget {row['keep']} (Lagrangian)"
    if not row.get("lam"):
        return "lambda 0 (control)"
    return f"fixed lambda {row['lam']:g}"


def _point_cells(row: dict) -> str:
    """A sweep point's first cells in a details table: point, method, updates, gates polarised."""
    return f"| {row['point']} | {_method(row)} | {row['step']} | {_pct(row['polarized'])} |"


def claim_sec622(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec6.2.2", "Section 6.2.2: functions of the retained heads (Figure 8)",
              "As encoder heads are pruned, the positional, syntactic and rare-token heads are the last to go.",
              ["prune-enc", "specialisation", "functions"])
    last = Check("specialised heads (paper thresholds) survive longer than the others",
                 f"OpenSubtitles: the model with 17 encoder heads still has every function of Sec. 5 (Sec. 6.2.2, "
                 f"Figure 8; {WORDS} beyond the head count)",
                 criterion="holds if their mean share of sweep points that keep them exceeds the others'")
    sens = Check("sensitivity (no threshold): Spearman of survival with positional share / syntactic margin / "
                 "rare-token share [95% intervals over heads]", "-")
    for name, r in results.items():
        sweep = r.sweep("enc")
        masks = _function_masks(r)
        shape = _shape(r, "enc_self")
        if not sweep["points"] or shape is None:
            last.cells[name] = sens.cells[name] = _missing("prune/enc points", "prune-enc")
            continue
        if masks is None:
            last.cells[name] = sens.cells[name] = _missing("functions or specialisation results", "functions")
            continue
        survival = _survival(sweep, "enc_self", shape)
        if survival is None:  # only the lambda = 0 control has finished: nothing pruned yet
            last.cells[name] = sens.cells[name] = _missing("pruning point besides the lambda = 0 control", "prune-enc")
            continue
        special = masks["positional"] | masks["syntactic"] | masks["rare"]
        # The top rare-token head is "rare" by construction (the paper names one head); the
        # positional and syntactic labels need the thresholds.
        thresholded = masks["positional"] | masks["syntactic"]
        if not thresholded.any():
            last.cells[name] = Cell(f"no positional or syntactic head at the paper's thresholds; the top "
                                    f"rare-token head survives in {_pct(survival[masks['rare']].mean())} of points "
                                    f"(others {_pct(survival[~masks['rare']].mean())})",
                                    "not testable: no specialised head")
        else:
            a = float(survival[special].mean())
            b = float(survival[~special].mean()) if (~special).any() else math.nan
            verdict = "not testable: every head is specialised" if math.isnan(b) else \
                "holds" if a > b else "does not hold"
            last.cells[name] = Cell(f"specialised {_pct(a)} vs others {_pct(b)} ({int(special.sum())} heads)", verdict)
        share, margin, rarest = _function_scores(r)
        if np.ptp(survival) == 0:  # a rank correlation with a constant is undefined
            sens.cells[name] = Cell(f"not defined: every head survives in the same share of points "
                                    f"({_pct(survival.flat[0])})")
        else:
            sens.cells[name] = Cell(" / ".join("{:+.2f} [{:+.2f}, {:+.2f}]".format(*spearman_interval(survival, x))
                                               for x in (share, margin, rarest)))
        lines = ["| point | encoder heads kept | positional | syntactic | rare-token | other |",
                 "|---|---:|---:|---:|---:|---:|"]
        for point, n_kept, counts in _kept_by_function(sweep, masks, shape):
            lines.append(f"| {point} | {n_kept} | " + " | ".join(map(str, counts.values())) + " |")
        c.details[name] = lines
        c.figures[name] = "fig8"
    c.checks = [last, sens]
    return c


def _kept_by_function(sweep: dict, masks: dict[str, np.ndarray], shape: tuple[int, int]) -> list[tuple]:
    """Per pruning point with a kept mask: (point, encoder heads kept, {function or "other": heads kept})."""
    special = masks["positional"] | masks["syntactic"] | masks["rare"]
    out = []
    for row in _rows(sweep):
        kept = kept_mask(sweep["points"][row["point"]], "enc_self", shape)
        if kept is not None and row["series"] != "control":
            counts = {f: int((kept & masks[f]).sum()) for f in ("positional", "syntactic", "rare")}
            out.append((row["point"], int(kept.sum()), {**counts, "other": int((kept & ~special).sum())}))
    return out


def _paper_table2() -> str:
    rows = [f"{data}: " + "; ".join(f"{'/'.join(map(str, heads))} {pruned:.2f} vs {scratch:.2f}"
                                    for heads, pruned, scratch in points)
            for data, (_, points) in PAPER_TABLE2.items()]
    return "pruned above from scratch in all 7 rows: " + " \u2014 ".join(rows) + " (Table 2)"


def claim_sec63(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec6.3", "Section 6.3: pruning all attention kinds (Table 2, Figure 9)",
              "Pruning all three kinds of attention together, a model with a fraction of the heads keeps most of its "
              "BLEU and beats the same configuration trained from scratch; decoder-encoder attention keeps the most "
              "heads and encoder self-attention is pruned first.", ["prune-all", "hypotheses", "scratch"])
    table2 = Check("pruned against from scratch at the same heads (Table 2; pruned minus from scratch [95% interval])",
                   _paper_table2(),
                   criterion="holds if every matched point's interval lies above 0; no difference if every one "
                             "contains 0; does not hold if every one lies below 0; inconclusive otherwise, and whenever "
                             "a pruned point has not settled")
    control = Check("fine-tuning alone: the lambda = 0 control (gates on every kind, no penalty, the same updates) "
                    "against the full model (change [95% interval])",
                    "no such control in the paper: its pruned models are fine-tuned, its full model is not")
    flat = _flat_check()
    versus = Check("the fixed-lambda points against the lambda = 0 control (change [95% interval]): what the penalty "
                   "costs beyond fine-tuning", "-")
    half = Check("more than half of all heads pruned within 0.25 BLEU, fixed-lambda points (the paper's mode; "
                 "change [95% interval])",
                 "WMT: 12/21/25 (58 of 144 heads kept) 29.36 against 29.6, -0.24 (Sec. 6.3.1, Table 2)",
                 criterion="holds if a point keeping fewer than half the heads has its interval above -0.25; does not "
                           "hold if those points and the next larger one all lie below -0.25 (fewer heads assumed to "
                           "cost no less); inconclusive otherwise, and whenever a point the verdict rests on has not "
                           "settled")
    quiet = Check("encoder heads pruned by almost 3/4 (>= 70%) and each decoder kind by more than 1/3, with no "
                  "noticeable loss, fixed-lambda points", "WMT: 14/31/30 kept, 29.62 against 29.6 (Sec. 6.3.1, Table 2)",
                  criterion=f"no noticeable loss = non-inferior by {NOTICEABLE_BLEU} BLEU (the drop the paper calls "
                            f"small, abstract): holds if such a point's interval lies above -{NOTICEABLE_BLEU}; does "
                            f"not hold if every such point and the next larger one lie below -{NOTICEABLE_BLEU} (fewer "
                            "heads assumed to cost no less); inconclusive otherwise (an interval containing 0 that "
                            "reaches below the bound is not 'no loss'); every point used must have settled")
    fig9 = Check("share of heads kept per kind: enc_self / dec_self / dec_cross (Figure 9), fixed-lambda points (the "
                 "budget points where there are none)",
                 f"encoder self-attention pruned first, decoder-encoder kept longest (Sec. 6.3.2, Figure 9; {WORDS})",
                 criterion="holds if at every pruned point dec_cross keeps the largest and enc_self the smallest share")
    for name, r in results.items():
        sweep = r.sweep("all")
        rows = [row for row in _rows(sweep) if row["bleu"] is not None]
        if sweep["full"] is None or not rows:
            _fill((table2, control, flat, versus, half, quiet, fig9), name, _missing("prune/all points", "prune-all"))
            continue
        reference = sweep["full"]["metrics"]["bleu"]
        deltas = {row["point"]: _delta(r, "all", row, reference) for row in rows}
        control.cells[name], versus.cells[name], against = _control_cells(r, "all", rows, reference, "")
        flat.cells[name] = _flat_cell(_control(rows), "all")
        fixed = [row for row in rows if row["series"] == "fixed"]
        # matched by the heads of every kind, not their total: a budget point with a fixed-lambda point's total
        # (EN-FR's keep-70, 2/26/42, and lam-0.005, 5/26/39) is another configuration than the one trained from scratch
        scratch = {tuple(row["heads_kept"].get(k) or 0 for k in KINDS): row["bleu"] for row in r.scratch
                   if row.get("from_scratch") and row.get("bleu") is not None}
        matched = [(row, scratch[_per_kind(row)], _scratch_delta(r, row, scratch[_per_kind(row)]))
                   for row in rows if _per_kind(row) in scratch]
        table2.cells[name] = Cell("; ".join(f"{row['heads']} heads ({row['point']}): {row['bleu']:.2f} vs {s:.2f}, "
                                            f"{_interval(d)}" for row, s, d in matched),
                                  _settled(_versus_scratch([d for _, _, d in matched]), [row for row, _, _ in matched])) \
            if matched else Cell("no from-scratch run", "not run: stage `scratch` has no result") if not scratch \
            else Cell("no from-scratch run of a point's heads", "not run: the from-scratch runs keep "
                      f"{', '.join('/'.join(map(str, k)) for k in scratch)} heads (enc_self/dec_self/dec_cross), no "
                      "point the same")
        total = sum(sweep["full"]["heads_kept"].values())
        sparse = [row for row in fixed if row["heads"] < total / 2]
        if not fixed:
            half.cells[name] = _no_fixed("prune-all")
        elif not sparse:
            half.cells[name] = Cell("no fixed-lambda point keeps fewer than half the heads", "not testable: no such point")
        else:
            text = "; ".join(f"{row['heads']} of {total}: {_interval(deltas[row['point']])}" for row in sparse)
            # A point cut short of half the heads may cost more than one at just under half would.
            half.cells[name] = Cell(text, _within([(row["heads"], deltas[row["point"]], row) for row in fixed],
                                                  math.ceil(total / 2) - 1, 0.25))
        full_kept = sweep["full"]["heads_kept"]
        light = [row for row in fixed if row["enc_self"] <= 0.3 * full_kept["enc_self"]
                 and row["dec_self"] < 2 / 3 * full_kept["dec_self"] and row["dec_cross"] < 2 / 3 * full_kept["dec_cross"]]
        if not fixed:
            quiet.cells[name] = _no_fixed("prune-all")
        elif not light:
            quiet.cells[name] = Cell("no point prunes that much of every kind", "not testable: no such point")
        else:
            text = "; ".join(f"{row['enc_self']}/{row['dec_self']}/{row['dec_cross']}: {_interval(deltas[row['point']])}"
                             for row in light)
            most = max(row["heads"] for row in light)
            larger = sorted((row for row in fixed if row["heads"] > most), key=lambda row: row["heads"])
            following = (larger[0]["heads"], deltas[larger[0]["point"]], larger[0]) if larger else None
            verdict = _non_inferior([(deltas[row["point"]], row) for row in light], following, NOTICEABLE_BLEU,
                                    f"{most} heads")
            quiet.cells[name] = Cell(text, verdict)
        pruned = [row for row in _figure_rows(rows) if row["heads"] < sum(row["total"].values())]
        fractions, ok = [], []
        for row in pruned:
            f = {k: row[k] / row["total"][k] for k in KINDS if row["total"].get(k)}
            fractions.append(f"{row['heads']} ({row['point']}): " + " / ".join(_pct(f[k]) for k in KINDS if k in f))
            ok.append(f["dec_cross"] >= max(f.values()) and f["enc_self"] <= min(f.values()))
        fig9.cells[name] = Cell("; ".join(fractions), "holds" if ok and all(ok) else "does not hold") if pruned else \
            Cell("no point removed a head", "not testable: nothing pruned")
        lines = ["| point | method | updates | gates polarised | enc_self | dec_self | dec_cross | total | "
                 "BLEU pruned | change [95% interval] | against lambda = 0 [95% interval] | "
                 "dev BLEU, second half [95% interval] | BLEU from scratch |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines.append(f"| full | | | | {full_kept['enc_self']} | {full_kept['dec_self']} | {full_kept['dec_cross']} | "
                     f"{total} | {reference:.2f} | | | | |")
        for row in rows:
            s = scratch.get(_per_kind(row))
            lines.append(f"{_point_cells(row)} {row['enc_self']} | {row['dec_self']} | {row['dec_cross']} | {row['heads']} | "
                         f"{_f(row['bleu'])} | {_interval(deltas[row['point']])} | "
                         f"{_interval(against[row['point']]) if row['point'] in against else ''} | {_dev_change(row)} | "
                         f"{'' if s is None else f'{s:.2f}'} |")
        lines += _stale_note(sweep) + _dev_table(rows, None)
        c.details[name] = lines
        c.figures[name] = "fig9"
    c.checks = [table2, control, flat, versus, half, quiet, fig9]
    return c


def _figure_rows(rows: list[dict]) -> list[dict]:
    """The points behind Figures 9 and 10: the fixed-lambda series (the paper's), or the budget
    series where there is none; never the control."""
    fixed = [row for row in rows if row["series"] == "fixed"]
    return fixed or [row for row in rows if row["series"] == "budget"]


def _layer_rows(r: ModelResults) -> list[dict]:
    """The points Figure 10 may be read at, densest first: fixed-lambda (else budget) points with a
    kept record that keep a head of each decoder kind. Where a kind has none, its mean layer is
    undefined and says nothing about where heads remain."""
    sweep = r.sweep("all")
    shapes = {kind: _shape(r, kind) for kind in ("dec_self", "dec_cross")}
    if any(shape is None for shape in shapes.values()):
        return []
    rows = [row for row in _figure_rows(_rows(sweep)) if sweep["points"][row["point"]]["kept"] is not None]
    return [row for row in rows if all(_kept(sweep["points"][row["point"]], kind, shape).any()
                                       for kind, shape in shapes.items())]


def claim_sec632(results: dict[str, ModelResults]) -> Claim:
    c = Claim("sec6.3.2", "Section 6.3.2: which decoder layers keep heads (Figure 10)",
              "After pruning all kinds, decoder self-attention heads remain mostly in the lower layers and "
              "decoder-encoder attention heads in the higher layers.", ["prune-all"])
    check = Check("mean layer (1 = lowest) of the kept dec_self / dec_cross heads at the sparsest fixed-lambda point that "
                  "keeps heads of both kinds (the sparsest such budget point where there is no fixed-lambda point)",
                  f"decoder self-attention heads mostly in the lower layers, decoder-encoder in the higher "
                  f"(Sec. 6.3.2, Figure 10; {WORDS})",
                  criterion="holds if the dec_self mean is below the middle layer and the dec_cross mean above it")
    for name, r in results.items():
        sweep = r.sweep("all")
        rows = [row for row in _figure_rows(_rows(sweep)) if sweep["points"][row["point"]]["kept"] is not None]
        shape_s, shape_c = _shape(r, "dec_self"), _shape(r, "dec_cross")
        if not rows or shape_s is None or shape_c is None:
            check.cells[name] = _missing("prune/all points", "prune-all")
            continue
        shapes = {"dec_self": shape_s, "dec_cross": shape_c}
        usable = _layer_rows(r)
        if not usable:
            check.cells[name] = Cell(f"no point keeps heads of both decoder kinds ({', '.join(x['point'] for x in rows)})",
                                     "not testable: no point keeps heads of both kinds")
            continue
        row = usable[-1]
        skipped = [x["point"] for x in rows if x["heads"] < row["heads"] and x not in usable]
        point = sweep["points"][row["point"]]
        means, lines = {}, ["| layer | " + " | ".join(f"{k} kept" for k in ("dec_self", "dec_cross")) + " |",
                            "|---:|---:|---:|"]
        per_layer = {}
        for kind, shape in shapes.items():
            mask = _kept(point, kind, shape)
            per_layer[kind] = mask.sum(axis=1)
            means[kind] = float((np.nonzero(mask)[0] + 1).mean())
        middle = (shape_s[0] + 1) / 2
        ok = means["dec_self"] < middle < means["dec_cross"]
        note = f"; sparser, with a kind at 0 heads: {', '.join(skipped)}" if skipped else ""
        check.cells[name] = Cell(f"{row['point']}, {_method(row)}: {_f(means['dec_self'], 1)} / {_f(means['dec_cross'], 1)} "
                                 f"(middle {middle:.1f}){note}", "holds" if ok else "does not hold")
        for layer in range(shape_s[0]):
            lines.append(f"| {layer + 1} | {per_layer['dec_self'][layer]} of {shape_s[1]} | "
                         f"{per_layer['dec_cross'][layer]} of {shape_c[1]} |")
        c.details[name] = [f"At {row['point']} ({row['heads']} heads kept):", ""] + lines
        c.figures[name] = "fig10"
    c.checks = [check]
    return c


def claim_beyond(results: dict[str, ModelResults]) -> Claim:
    c = Claim("beyond", "Beyond the paper: which importance measure predicts ablation and pruning order",
              "Not in the paper. Spearman's rho of each measure with the loss increase when the head alone is "
              "masked (ablation), and with the pruning order (share of sweep points that keep the head).",
              ["importance", "prune-enc", "prune-all"])
    best_ablation = Check("best predictor of ablation over all heads (rho [95% interval over heads])", "-")
    best_order = Check("best predictor of the encoder pruning order (rho [95% interval over heads])", "-")
    measures = ("confidence", "lrp", "gradient", "gradient_raw")
    for name, r in results.items():
        lines = ["| measure | ablation: enc_self | dec_self | dec_cross | all | pruning order: enc sweep (enc_self) "
                 "| all sweep (all heads) |", "|---|---:|---:|---:|---:|---:|---:|"]
        agreement = (r.agreement or {}).get("spearman", {})
        scores = {m: r.importance(m) for m in measures}
        enc_sweep, all_sweep = r.sweep("enc"), r.sweep("all")
        shape = _shape(r, "enc_self")
        enc_survival = _survival(enc_sweep, "enc_self", shape) if shape else None
        all_survival = {kind: _survival(all_sweep, kind, kind_shape) for kind in KINDS if (kind_shape := _shape(r, kind))}
        order_rho, all_rho = {}, {}
        for m in measures:
            s = scores[m]
            if s is None:
                continue
            if enc_survival is not None:
                order_rho[m] = spearman(s["enc_self"], enc_survival)
            if all_survival and all(v is not None for v in all_survival.values()):
                a = np.concatenate([np.ravel(s[k]) for k in all_survival])
                b = np.concatenate([np.ravel(v) for v in all_survival.values() if v is not None])  # (all are)
                all_rho[m] = spearman(a, b)
            row = agreement.get(m, {})
            cells = [_f(row.get(k)) for k in ("enc_self", "dec_self", "dec_cross", "all")]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {_f(order_rho.get(m))} | {_f(all_rho.get(m))} |")
        if agreement:
            pooled = {m: v.get("all") for m, v in agreement.items() if v.get("all") is not None}
            m = max(pooled, key=lambda k: pooled[k])
            ablation, scores_m = r.importance("ablation"), scores.get(m)
            interval = ""
            if ablation is not None and scores_m is not None:
                kinds = [k for k in KINDS if k in ablation.scores and k in scores_m.scores]
                _, low, high = spearman_interval(np.concatenate([np.ravel(scores_m[k]) for k in kinds]),
                                                 np.concatenate([np.ravel(ablation[k]) for k in kinds]))
                interval = f" [{low:+.2f}, {high:+.2f}]"
            best_ablation.cells[name] = Cell(f"{m} ({pooled[m]:+.2f}{interval})")
        else:
            best_ablation.cells[name] = _missing("importance/agreement.json", "importance")
        valid = {m: v for m, v in order_rho.items() if not math.isnan(v)}
        if valid:
            m = max(valid, key=lambda k: valid[k])
            best_scores = scores[m]
            assert best_scores is not None  # order_rho has only the measures with scores
            _, low, high = spearman_interval(best_scores["enc_self"], enc_survival)
            best_order.cells[name] = Cell(f"{m} ({valid[m]:+.2f} [{low:+.2f}, {high:+.2f}])")
        else:
            best_order.cells[name] = _missing("prune/enc points or importance", "prune-enc")
        if agreement or valid:
            c.details[name] = lines
    c.checks = [best_ablation, best_order]
    return c


def claim_specialisation(results: dict[str, ModelResults]) -> Claim:
    c = Claim("specialisation", "When specialisation appears: encoder heads over training checkpoints",
              "Not in the paper (issue 8, item 4): the confidence and best positional share of every encoder head "
              "after each training epoch, on a fixed sample of validation sentences.", ["specialisation"])
    first = Check("first checkpoint with an encoder head >= 90% at one offset (subword tokens)", "-")
    final = Check("final model: largest positional share (tokens / words), largest confidence", "-")
    for name, r in results.items():
        spec = r.specialisation
        if not spec:
            first.cells[name] = final.cells[name] = _missing("specialisation.json", "specialisation")
            continue
        points = spec["checkpoints"]
        met = [p["checkpoint"] for p in points if p["summary"]["n_positional_token"] > 0]
        first.cells[name] = Cell(met[0] if met else f"never (in {len(points)} checkpoints)")
        last = points[-1]["summary"]
        final.cells[name] = Cell(f"{_pct(last['token_share']['max'])} / {_pct(last['word_share']['max'])}, "
                                 f"{last['confidence']['max']:.2f}")
        lines = ["| checkpoint | val BLEU (greedy) | positional share, tokens: max / mean | words: max | "
                 "heads >= 90% | confidence: max / mean |", "|---|---:|---:|---:|---:|---:|"]
        for p in points:
            s = p["summary"]
            lines.append(f"| {p['checkpoint']} | {_f(p.get('bleu'))} | {_pct(s['token_share']['max'])} / "
                         f"{_pct(s['token_share']['mean'])} | {_pct(s['word_share']['max'])} | "
                         f"{s['n_positional_token']} | {s['confidence']['max']:.2f} / {s['confidence']['mean']:.2f} |")
        c.details[name] = lines
        c.figures[name] = "specialisation"
    c.checks = [first, final]
    return c


CLAIMS = (claim_setting, claim_sec4, claim_sec51, claim_sec52, claim_sec53, claim_sec62, claim_sec622, claim_sec63, claim_sec632,
          claim_beyond, claim_specialisation)
"""Every section of docs/reproduction.md, in order."""


def compute_claims(results: dict[str, ModelResults]) -> list[Claim]:
    claims = [claim(results) for claim in CLAIMS]
    notes = {name: sweep_weights_note(r) for name, r in results.items()}
    stale = {name: note[0] for name, note in notes.items() if note is not None and not note[1]}
    for c in claims:  # a pruning section says when its numbers are not of the bundled weights
        if stale and {"prune-enc", "prune-all"} & set(c.stages):
            c.notes = [f"*{name}: {note}.*" for name, note in stale.items()]
    return claims
