"""The decision rules of experiments/heavy_lifting_nmt.md, applied to the finished configurations.

    python experiments/heavy_lifting_nmt.py report --root RUNS --labels docs/results/heavy-lifting-nmt/labels.json \
        --out docs/results/heavy-lifting-nmt [--stage 2]

Reads ``<root>/<configuration>/eval.json`` (the kept test translations) and, for the gated side,
the reproduction's EN-DE results (``--results``: ``hypotheses/enc-<point>.txt``,
``hypotheses/all-<point>.txt``, ``hypotheses/full.txt``, ``prune/<kinds>/<point>/result.json``
with the development plateau) or, at stage 2, the continued gated points under ``<root>``. At
stage 2 the controls' ``eval-1728.json``: in a run directory beside stage 1's ``eval.json``, in an
archive under ``<configuration>/stage-2/``.
Writes ``results.json`` (every number) and ``results.md`` (tables and verdicts) under ``--out``.
A rule whose runs are not all there says which are missing; nothing is filled in.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

# Holm's step-down and the hypergeometric tail are the LM test's (experiments/heavy_lifting_report.py, beside this file).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from heavy_lifting_report import holm, hypergeometric_tail  # noqa: E402

KS = (8, 5, 2, 1)
GATED = {8: "lam-0.005", 5: "lam-0.01", 2: "lam-0.02", 1: "lam-0.05"}
SEEDS = (1, 2, 3)
RESAMPLES = 10_000
SEED = 12345  # sacreBLEU's default bootstrap seed
DELTA = 1.0  # non-inferiority bound in BLEU (heavy_lifting_nmt.md), fixed before any run
PAPER_DELTA = 0.15  # the reproduction's "no noticeable loss" bound, reported beside it
N_HEADS = 48
# Table 2: from-scratch configuration -> the pruned point it is compared with (kinds/point).
TABLE2 = {"scratch-enc-5": "enc/lam-0.01", "scratch-84": "all/lam-0.005", "scratch-30": "all/lam-0.02"}


# ----------------------------------------------------------------------------- BLEU under resampling


class Bootstrap:
    """One draw of ``RESAMPLES`` resamples of the test sentences, shared by every comparison, and
    sacreBLEU's corpus BLEU (its sufficient statistics summed over each resample)."""

    def __init__(self, references: list[str], resamples: int = RESAMPLES, seed: int = SEED):
        from sacrebleu.metrics import BLEU

        self.metric, self.references = BLEU(), references
        n = len(references)
        idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
        self.weights = np.zeros((resamples, n))
        np.add.at(self.weights, (np.arange(resamples)[:, None], idx), 1.0)  # sentence counts per resample

    def stats(self, hypotheses: list[str]) -> np.ndarray:
        if len(hypotheses) != len(self.references):
            raise ValueError(f"{len(hypotheses)} translations for {len(self.references)} references")
        return np.array(self.metric._extract_corpus_statistics(hypotheses, [self.references]), dtype=float)

    def bleu(self, stats: np.ndarray) -> float:
        return self.metric._compute_score_from_stats(list(stats.sum(0))).score

    def resampled(self, stats: np.ndarray) -> np.ndarray:
        summed = self.weights @ stats
        return np.array([self.metric._compute_score_from_stats(list(row)).score for row in summed])

    def difference(self, a: list[np.ndarray], b: list[np.ndarray]) -> dict:
        """mean BLEU of systems ``a`` minus mean BLEU of systems ``b`` (e.g. the random seeds, each
        scored on the same resample), its 95% percentile interval, and one-sided p-values for
        "above 0" and "below 0": (1 + resamples on the other side) / (1 + R)."""
        point = float(np.mean([self.bleu(s) for s in a]) - np.mean([self.bleu(s) for s in b]))
        boot = np.mean([self.resampled(s) for s in a], axis=0) - np.mean([self.resampled(s) for s in b], axis=0)
        low, high = np.quantile(boot, [0.025, 0.975])
        n = len(boot)
        return {"difference": point, "low": float(low), "high": float(high),
                "p_above": float((1 + (boot <= 0).sum()) / (1 + n)),
                "p_below": float((1 + (boot >= 0).sum()) / (1 + n))}


def non_inferiority(low: float, high: float, delta: float = DELTA) -> str:
    """A difference (system minus reference) is non-inferior when its interval's lower end lies
    above -delta, inferior when its upper end lies below -delta, undecided otherwise: an interval
    that contains 0 but reaches below -delta is undecided, never "no loss"."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "undecided"
    return "non-inferior" if low > -delta else "inferior" if high < -delta else "undecided"


# ----------------------------------------------------------------------------- reading


def hypotheses_file(directory: Path, evaluation: dict) -> Path:
    """A configuration's kept translations: the copy under ``directory``, the directory its
    ``eval*.json`` was read from (an archived run: the same path below the configuration's
    directory), or else the path written at the run, checked against the SHA-256 written beside
    it, so that a report never reads translations other than those scored."""
    import hashlib

    written, name = Path(evaluation["hypotheses"]), evaluation["config"]["name"]
    parts = written.parts
    local = directory.joinpath(*parts[len(parts) - parts[::-1].index(name):]) if name in parts else written
    path = local if local.is_file() else written
    if not path.is_file():
        raise SystemExit(f"{directory}: its translations are neither at {local} nor at {written}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != evaluation["hypotheses_sha256"]:
        raise SystemExit(f"{path}: SHA-256 {digest}, not the {evaluation['hypotheses_sha256']} its eval.json scored")
    return path


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _settled(plateau: dict | None) -> bool:
    """The page's rule (docs/pruning.md): settled when a further gain of 0.5 BLEU over the second
    half is excluded (``flat``); ``rising``, ``undecided`` or no curve are not settled."""
    return bool(plateau and plateau.get("call") == "flat")


class Runs:
    def __init__(self, root: Path, results: Path, stage: int):
        self.root, self.results, self.stage = root, results, stage
        self.missing: list[str] = []
        self.directories: dict[str, Path] = {}  # configuration -> the directory its evaluation was read from

    def directory(self, name: str, stage: int) -> Path:
        """A configuration's directory at ``stage``: a run directory, or an archive where a stage-2
        continuation lives in ``<name>/stage-2`` (experiments/heavy_lifting_nmt.py, ``archive``)."""
        archived = self.root / name / "stage-2"
        return archived if stage == 2 and archived.is_dir() else self.root / name

    def _evaluation(self, name: str, stage: int) -> dict | None:
        directory = self.directory(name, stage)
        file = directory / ("eval.json" if stage == 1 else "eval-1728.json")
        if not file.is_file():
            self.missing.append(name)
            return None
        self.directories[name] = directory
        return json.loads(file.read_text())

    def control(self, name: str) -> dict | None:
        return self._evaluation(name, self.stage)

    def scratch(self, name: str) -> dict | None:
        return self._evaluation(name, 1)  # no stage 2

    def gated(self, point: str) -> dict | None:
        """A gated point (``enc/lam-0.01``): its translations, heads and development plateau; at
        stage 2 the continuation under ``<root>/gated-<point>/prune``."""
        kinds, name = point.split("/")
        if self.stage == 2 and kinds == "enc":
            directory = self.directory(f"gated-{name}", 2) / "prune"
            hypotheses, result = directory / "hypotheses.txt", directory / "result.json"
        else:
            hypotheses = self.results / "hypotheses" / f"{kinds}-{name}.txt"
            result = self.results / "prune" / kinds / name / "result.json"
        if not (hypotheses.is_file() and result.is_file()):
            self.missing.append(f"gated {point}")
            return None
        record = json.loads(result.read_text())
        return {"point": point, "hypotheses": _lines(hypotheses), "heads_kept": record["heads_kept"],
                "steps": record["step"], "dev_plateau": (record.get("dev") or {}).get("plateau"),
                "kept": self.kept(kinds, name, result.parent)}

    def kept(self, kinds: str, name: str, directory: Path) -> list[tuple[int, int]]:
        """The encoder heads a gated point kept (kept.json of the results, or the pruned model's record)."""
        for file in (directory / "kept.json", directory / "pruned" / "headlab_pruning.json"):
            if file.is_file():
                blocks = json.loads(file.read_text())["blocks"].get("enc_self", {})
                return [(layer, h) for layer in range(6)
                        for h in (blocks[str(layer)]["kept_heads"] if str(layer) in blocks else range(8))]
        return []


# ----------------------------------------------------------------------------- the report


def write_report(root: Path, labels: dict, data: Path, results: Path, out: Path, stage: int = 1) -> dict:
    from headlab.data import read_lines

    runs = Runs(root, results, stage)
    references = read_lines(str(data / "test_2016_flickr.de.gz"))
    controls = {name: runs.control(name) for name in
                [f"least-{k}" for k in KS] + [f"random-{k}-s{s}" for k in KS for s in SEEDS] + ["random-0"]}
    n = {e["n_sentences"] for e in controls.values() if e}
    if len(n) > 1:
        raise SystemExit(f"the controls were scored on different numbers of sentences: {sorted(n)}")
    test_setting = bool(n) and next(iter(n)) != len(references)
    if test_setting:  # a run of the driver's test setting (--eval-limit): the first n sentences only
        references = references[: next(iter(n))]
    boot = Bootstrap(references)
    report: dict = {"stage": stage, "test_setting": test_setting, "resamples": RESAMPLES, "delta_bleu": DELTA,
                    "n_sentences": len(references)}
    lines = [f"# Heavy-lifting controls on multi30k-en-de: results (stage {stage})", "",
             f"Rules: [experiments/heavy_lifting_nmt.md]({_rules_link(out)}). Written by "
             "`experiments/heavy_lifting_nmt.py report`; every number below is read from the run directories' "
             + ("`eval.json` and the reproduction's result files." if stage == 1 else
                "`eval-1728.json` (the controls and the encoder gated points continued to 1,728 updates, "
                "`<configuration>/stage-2/`), the from-scratch runs' `eval.json` and, for the all-kinds points, "
                "the reproduction's result files."), ""]
    if test_setting:
        lines += [f"**Test setting: {len(references)} test sentences only. Not a result.**", ""]

    def stats_of(evaluation: dict | None):
        if evaluation is None:
            return None
        return boot.stats(_lines(hypotheses_file(runs.directories[evaluation["config"]["name"]], evaluation)))

    def gated_stats(point: str):
        g = runs.gated(point)
        return g, (None if g is None else boot.stats(g["hypotheses"][: len(references)]))

    # ---- H1: the gated model against both controls at equal encoder heads
    lines += ["## H1: the gates against k random and the k least specialised encoder heads", "",
              "| k | gated point | gated BLEU | random (3 seeds) | least specialised | gated - random [95%] | "
              "gated - least [95%] | settled (gated / controls) |", "|---|---|---|---|---|---|---|---|"]
    h1: list[dict] = []
    for k in KS:
        g, gs = gated_stats(f"enc/{GATED[k]}")
        randoms = [controls[f"random-{k}-s{s}"] for s in SEEDS]
        least = controls[f"least-{k}"]
        if gs is None or any(r is None for r in randoms) or least is None:
            lines.append(f"| {k} | {GATED[k]} | missing runs | | | | | |")
            h1.append({"k": k, "missing": True})
            continue
        heads_ok = g["heads_kept"].get("enc_self") == k
        rs = [stats_of(r) for r in randoms]
        ls = stats_of(least)
        vs_random, vs_least = boot.difference([gs], rs), boot.difference([gs], [ls])
        settled = {"gated": _settled(g["dev_plateau"]),
                   "controls": all(_settled(e["dev_plateau"]) for e in (*randoms, least))}  # type: ignore[index]  # checked above
        h1.append({"k": k, "point": GATED[k], "gated_heads": g["heads_kept"].get("enc_self"), "equal_heads": heads_ok,
                   "gated_bleu": boot.bleu(gs), "random_bleu": [boot.bleu(s) for s in rs], "least_bleu": boot.bleu(ls),
                   "vs_random": vs_random, "vs_least": vs_least, "settled": settled})
        lines.append(f"| {k} | {GATED[k]} | {boot.bleu(gs):.2f} | "
                     f"{np.mean([boot.bleu(s) for s in rs]):.2f} ({', '.join(f'{boot.bleu(s):.2f}' for s in rs)}) | "
                     f"{boot.bleu(ls):.2f} | {_fmt(vs_random)} | {_fmt(vs_least)} | "
                     f"{'yes' if settled['gated'] else 'no'} / {'yes' if settled['controls'] else 'no'} |")
    report["h1"] = h1
    verdict, why = _h1_verdict(h1)
    report["h1_verdict"] = {"verdict": verdict, "why": why}
    lines += ["", f"**H1: {verdict}** ({why})", ""]

    # ---- non-inferiority of the controls, and no encoder self-attention at all
    lines += ["## Do the controls do as well as the gates? (non-inferiority, delta = "
              f"{DELTA:g} BLEU; at the reproduction's {PAPER_DELTA:g} in brackets)", "",
              "| k | random - gated [95%] | call | least - gated [95%] | call |", "|---|---|---|---|---|"]
    for row in h1:
        if row.get("missing"):
            continue
        r = {key: -v for key, v in row["vs_random"].items() if key in ("difference",)}
        r_low, r_high = -row["vs_random"]["high"], -row["vs_random"]["low"]
        l_low, l_high = -row["vs_least"]["high"], -row["vs_least"]["low"]
        row["random_non_inferior"] = non_inferiority(r_low, r_high)
        row["least_non_inferior"] = non_inferiority(l_low, l_high)
        row["random_non_inferior_paper"] = non_inferiority(r_low, r_high, PAPER_DELTA)
        row["least_non_inferior_paper"] = non_inferiority(l_low, l_high, PAPER_DELTA)
        lines.append(f"| {row['k']} | {r['difference']:+.2f} [{r_low:+.2f}, {r_high:+.2f}] | {row['random_non_inferior']} "
                     f"({row['random_non_inferior_paper']}) | {-row['vs_least']['difference']:+.2f} "
                     f"[{l_low:+.2f}, {l_high:+.2f}] | {row['least_non_inferior']} ({row['least_non_inferior_paper']}) |")
    g0, g0s = gated_stats("enc/lam-0")
    zero = controls["random-0"]
    if g0s is not None and zero is not None:
        d = boot.difference([stats_of(zero)], [g0s])
        report["no_encoder_attention"] = {**d, "call": non_inferiority(d["low"], d["high"]),
                                          "settled": _settled(zero["dev_plateau"]) and _settled(g0["dev_plateau"])}
        lines += ["", f"No encoder self-attention at all (0 heads, decoder frozen) against the lambda = 0 control "
                      f"(48 heads): {_fmt(d)}, {report['no_encoder_attention']['call']}."]
    lines.append("")

    # ---- H2 (descriptive, post hoc): which heads did the gates keep?
    specialised = {tuple(h) for h in labels["specialised"]}
    least8 = {tuple(h) for h in labels["least_specialised_8"]}
    lines += ["## H2 (descriptive: the gated runs existed before this plan)", "",
              "| k | kept by the gates | labelled among them | P(X >= x) | least specialised (8) among them |",
              "|---|---|---|---|---|"]
    h2 = []
    for k in KS:
        g = runs.gated(f"enc/{GATED[k]}")
        if g is None:
            continue
        kept = [tuple(h) for h in g["kept"]]
        x = len(specialised & set(kept))
        p = hypergeometric_tail(x, N_HEADS, len(specialised), len(kept))
        h2.append({"k": k, "kept": kept, "labelled": x, "p": p, "least8": len(least8 & set(kept))})
        lines.append(f"| {k} | {', '.join(f'L{a} H{b}' for a, b in kept)} | {x} of {len(specialised)} | {p:.3g} | "
                     f"{len(least8 & set(kept))} |")
    report["h2"] = h2
    lines.append("")

    # ---- H3: the fair Table 2
    lines += ["## H3: pruned against from scratch with the full model's recipe (Table 2)", "",
              "| pruned point | heads | pruned BLEU | from scratch (fair) | pruned - scratch [95%] | pruned settled | "
              "earlier from-scratch BLEU (handicapped) |", "|---|---|---|---|---|---|---|"]
    h3 = []
    for name, point in TABLE2.items():
        g, gs = gated_stats(point)
        s = runs.scratch(name)
        if gs is None or s is None:
            lines.append(f"| {point} | | missing runs | | | | |")
            h3.append({"name": name, "missing": True})
            continue
        d = boot.difference([gs], [stats_of(s)])
        # a stage-2 continuation may close heads: then it is not the architecture the from-scratch run trained
        scratch_encoder = sorted((layer, h) for kind, layer, h in s["kept"] if kind == "enc_self")
        heads_match = sorted(map(tuple, g["kept"])) == scratch_encoder
        earlier = results / "hypotheses" / f"{name}.txt"
        earlier_bleu = boot.bleu(boot.stats(_lines(earlier)[: len(references)])) if earlier.is_file() else None
        h3.append({"name": name, "point": point, "pruned_bleu": boot.bleu(gs), "scratch_bleu": s["bleu"],
                   "difference": d, "pruned_settled": _settled(g["dev_plateau"]), "earlier_scratch_bleu": earlier_bleu,
                   "heads_match": heads_match, "pruned_encoder_heads": len(g["kept"]),
                   "scratch_encoder_heads": len(scratch_encoder),
                   "averaged_epochs": s["row"].get("averaged_epochs"), "train_steps": s["row"].get("train_steps")})
        heads = f"{sum(g['heads_kept'].values())}" + ("" if heads_match else f" ({len(g['kept'])} encoder heads; "
                                                    f"from scratch: {len(scratch_encoder)})")
        lines.append(f"| {point} | {heads} | {boot.bleu(gs):.2f} | {s['bleu']:.2f} | {_fmt(d)} | "
                     f"{'yes' if _settled(g['dev_plateau']) else 'no'} | "
                     f"{'-' if earlier_bleu is None else f'{earlier_bleu:.2f}'} |")
    full = runs.scratch("scratch-full")
    calibration = None
    if full is not None and (results / "hypotheses" / "full.txt").is_file():
        bundled = boot.stats(_lines(results / "hypotheses" / "full.txt")[: len(references)])
        calibration = boot.difference([stats_of(full)], [bundled])
        calibration["call"] = non_inferiority(calibration["low"], calibration["high"])
        lines += ["", f"Calibration: the full architecture by the same from-scratch command against the bundled "
                      f"model: {_fmt(calibration)}, {calibration['call']} (delta {DELTA:g})."]
    report["h3"], report["calibration"] = h3, calibration
    verdict, why = _h3_verdict(h3, calibration)
    report["h3_verdict"] = {"verdict": verdict, "why": why}
    lines += ["", f"**H3: {verdict}** ({why})", ""]
    if runs.missing:
        lines += [f"Missing: {', '.join(sorted(set(runs.missing)))}.", ""]
    report["missing"] = sorted(set(runs.missing))

    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(report, indent=1, default=float) + "\n"),
                       ("results.md", "\n".join(lines) + "\n")):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)
    print("\n".join(lines))
    return report


def _rules_link(out: Path) -> str:
    """The plan's address relative to the report (``--out``: docs/results/heavy-lifting-nmt, its stage-2/)."""
    return Path(os.path.relpath(Path(__file__).resolve().with_name("heavy_lifting_nmt.md"), out.resolve())).as_posix()


def _fmt(d: dict) -> str:
    return f"{d['difference']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"


def _h1_verdict(rows: list[dict]) -> tuple[str, str]:
    """heavy_lifting_nmt.md, H1: 8 one-sided comparisons (4 k x 2 controls), Holm at 0.05. Inconclusive (checked
    first) names every ground it has: runs missing, a gated point not keeping k encoder heads, runs not settled; the
    equal-budget reading is given beside it whenever every run is there."""
    if any(r.get("missing") for r in rows):
        return "inconclusive", "runs missing at k = " + ", ".join(str(r["k"]) for r in rows if r.get("missing"))
    grounds = []
    unequal = [r["k"] for r in rows if not r["equal_heads"]]
    if unequal:
        grounds.append(f"the gated point does not keep k encoder heads at k = {unequal}")
    unsettled = [r["k"] for r in rows if not (r["settled"]["gated"] and r["settled"]["controls"])]
    if unsettled:
        grounds.append(f"not settled at k = {unsettled}")
    above = holm([p for r in rows for p in (r["vs_random"]["p_above"], r["vs_least"]["p_above"])])
    below = holm([p for r in rows for p in (r["vs_random"]["p_below"], r["vs_least"]["p_below"])])
    reading = (f"gates significantly better in {sum(above)} of 8 comparisons, a control significantly better in "
               f"{sum(below)} (Holm, 0.05)")
    if grounds:
        return "inconclusive", f"{'; '.join(grounds)}; at equal budget: {reading}"
    if any(below) or not any(above):
        return "does not hold", reading
    return ("holds" if all(above) else "partly"), reading


def _h3_verdict(rows: list[dict], calibration: dict | None) -> tuple[str, str]:
    """heavy_lifting_nmt.md, H3: pruned above from scratch at every matched point."""
    if any(r.get("missing") for r in rows) or calibration is None:
        return "inconclusive", "runs missing"
    if calibration["call"] != "non-inferior":
        return "inconclusive", (f"the from-scratch path does not reproduce the bundled model "
                                f"({_fmt(calibration)}; the recipe still handicaps it)")
    unmatched = [r["point"] for r in rows if not r.get("heads_match", True)]
    unsettled = [r["point"] for r in rows if not r["pruned_settled"]]
    above = [r["difference"]["low"] > 0 for r in rows]
    below = [r["difference"]["high"] < 0 for r in rows]
    within = [-DELTA < r["difference"]["low"] and r["difference"]["high"] < DELTA for r in rows]
    reading = f"above 0 at {sum(above)} of {len(rows)} points, below 0 at {sum(below)}, within +-{DELTA:g} at {sum(within)}"
    grounds = ([f"the pruned point no longer has the heads trained from scratch: {', '.join(unmatched)}"]
               if unmatched else []) + ([f"pruned point not settled: {', '.join(unsettled)}"] if unsettled else [])
    if grounds:
        return "inconclusive", f"{'; '.join(grounds)}; {reading}"
    if all(above):
        return "holds", reading
    if any(below) or all(within):
        return "does not hold", reading
    return "inconclusive", reading
