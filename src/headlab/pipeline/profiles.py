"""What each model's heads do, in one table per model: the summary behind docs/functions.md.

:func:`collect_profile` reads the result files that ``headlab analyze`` (or ``headlab
functions`` + ``headlab aggregate``) wrote for one model and keeps the few numbers a reader
compares across models: the most positional head (Voita et al. 2019, Sec. 5.1) and the best
previous-token head, the best head per relation and direction against its offset baseline
(Sec. 5.2, Table 1), the head that points to the rarest token most (Sec. 5.3), and Vig &
Belinkov's layer profiles (mean attention distance, dependency alignment and entropy per layer,
each the mean over the layer's heads). :func:`render_profiles` turns a list of profiles into
markdown; both read only JSON, so the document can be re-rendered and checked without a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from headlab.errors import HeadlabError

__all__ = ["collect_profile", "positional_summary", "render_profiles", "replace_block", "read_block", "PROFILE_VERSION"]

PROFILE_VERSION = 1
LAYER_STATISTICS = ("mean_distance", "dependency_alignment", "mean_entropy")


def _read(path: Path) -> dict:
    if not path.is_file():
        raise HeadlabError(f"{path}: missing; run headlab analyze (functions and aggregate stages) first")
    return json.loads(path.read_text(encoding="utf-8"))


def _best(scores: dict, kind: str) -> tuple[float, int, int]:
    table = np.asarray(scores[kind], dtype=float)
    if np.all(np.isnan(table)):
        return float("nan"), -1, -1
    layer, head = np.unravel_index(np.nanargmax(table), table.shape)
    return float(table[layer, head]), int(layer), int(head)


def positional_summary(functions: Path, kind: str) -> dict:
    """The most positional head of ``kind`` at word and subword level and the best previous-word
    head, from a ``functions/`` result directory."""
    share, offset = _read(functions / "positional" / "share.json"), _read(functions / "positional" / "offset.json")
    token_share = _read(functions / "positional" / "token_share.json")
    token_offset = _read(functions / "positional" / "token_offset.json")
    offsets = _read(functions / "positional" / "offsets.json")
    threshold = offsets["threshold"]
    word, layer, head = _best(share["scores"], kind)
    token, t_layer, t_head = _best(token_share["scores"], kind)
    # The share of each head's maxima at offset -1 (a previous-word head, Vig & Belinkov's "attends
    # to the previous token"), from the counts of every offset.
    column = offsets["offsets"].index(-1)
    previous = []
    for layer_index in range(len(share["scores"][kind])):
        counts = np.asarray(offsets["counts"][f"{kind}:{layer_index}"], dtype=float)  # [heads, offsets]
        totals = counts.sum(axis=1)
        previous.append(np.where(totals > 0, counts[:, column] / np.maximum(totals, 1), np.nan))
    prev, p_layer, p_head = _best({kind: previous}, kind)
    n_word = int(np.sum(np.asarray(share["scores"][kind], dtype=float) >= threshold))
    n_token = int(np.sum(np.asarray(token_share["scores"][kind], dtype=float) >= threshold))
    return {
        "threshold": threshold,
        "word": {"share": word, "offset": int(offset["scores"][kind][layer][head]), "head": [layer, head],
                 "n_positional": n_word},
        "token": {"share": token, "offset": int(token_offset["scores"][kind][t_layer][t_head]),
                  "head": [t_layer, t_head], "n_positional": n_token},
        "previous_word": {"share": prev, "head": [p_layer, p_head]},
    }


def _layer_profiles(aggregate: Path, kind: str) -> dict:
    profiles = {}
    for name in LAYER_STATISTICS:
        table = np.asarray(_read(aggregate / f"{name}.json")["scores"][kind], dtype=float)
        profiles[name] = [float(np.nanmean(row)) for row in table]
    return profiles


def collect_profile(analysis_dir: str | Path, name: str, description: str = "") -> dict:
    """The profile of the model analysed into ``analysis_dir`` (an ``analyze --out`` directory,
    or any directory holding ``functions/`` and ``aggregate/``)."""
    root = Path(analysis_dir)
    functions, aggregate = root / "functions", root / "aggregate"
    summary = _read(functions / "summary.json")
    kinds = summary["report"]["analysed"]
    table1 = _read(functions / "syntactic" / "table1.json")
    rare = _read(functions / "rare_tokens" / "summary.json")
    profile = {"version": PROFILE_VERSION, "name": name, "description": description,
               "data": summary["report"].get("treebanks", {}), "n_sentences": summary["report"]["n_sentences"],
               "kinds": {}}
    for kind in kinds:
        top = next((row for row in rare.get("top_heads", []) if row["kind"] == kind), None)
        profile["kinds"][kind] = {
            "positional": positional_summary(functions, kind),
            "syntactic": [
                {key: row.get(key) for key in ("relation", "label", "n_arcs", "arcs", "best_head", "best_accuracy",
                                                "baseline", "baseline_offset", "n_syntactic", "status")}
                for row in table1["table"] if row["kind"] == kind
            ],
            "syntactic_margin": table1["margin"],
            "rare_token": None if top is None else {"head": [top["layer"], top["head"]], "rarest": top["rarest"],
                                                    "two_rarest": top["two_rarest"]},
            "layers": _layer_profiles(aggregate, kind),
        }
    return profile


def _pct(value) -> str:
    return "n/a" if value is None or value != value else f"{100 * value:.1f}%"


def _head(kind: str, head) -> str:
    return "-" if head is None or head[0] < 0 else f"{kind} L{head[0]} H{head[1]}"


def _overview(profiles: list[dict]) -> list[str]:
    lines = ["| model | kind | most positional head (word level) | subword level | best previous-word head "
             "| syntactic heads (of relation-directions scored) | rarest-token head |",
             "|---|---|---|---|---|---|---|"]
    for profile in profiles:
        for kind, body in profile["kinds"].items():
            pos = body["positional"]
            word, token, prev = pos["word"], pos["token"], pos["previous_word"]
            scored = [row for row in body["syntactic"] if row.get("status", "ok") == "ok"]
            n_syntactic = sum(1 for row in scored if (row["n_syntactic"] or 0) > 0)
            rare = body["rare_token"]
            rare_text = "-" if rare is None else f"{_head(kind, rare['head'])}: {_pct(rare['rarest'])}"
            lines.append(
                f"| {profile['name']} | {kind} | {_head(kind, word['head'])}: {_pct(word['share'])} at {word['offset']:+d} "
                f"| {_head(kind, token['head'])}: {_pct(token['share'])} at {token['offset']:+d} "
                f"| {_head(kind, prev['head'])}: {_pct(prev['share'])} "
                f"| {n_syntactic} of {len(scored)} | {rare_text} |"
            )
    return lines


def _syntactic(profile: dict) -> list[str]:
    lines = ["| kind | relation | direction | arcs | best head | accuracy | baseline (offset) | margin |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    for kind, body in profile["kinds"].items():
        for row in body["syntactic"]:
            status, arcs = row.get("status", "ok"), row.get("arcs") or row["n_arcs"]  # "reachable / all" if causal
            if status != "ok":
                lines.append(f"| {kind} | {row['relation']} | {row['label']} | {arcs} | {status} | | | |")
                continue
            margin = row["best_accuracy"] - row["baseline"]
            lines.append(
                f"| {kind} | {row['relation']} | {row['label']} | {arcs} | {_head(kind, row['best_head'])} "
                f"| {_pct(row['best_accuracy'])} | {_pct(row['baseline'])} ({row['baseline_offset']:+d}) "
                f"| {100 * margin:+.1f} |"
            )
    return lines


def _layers(profile: dict) -> list[str]:
    lines = ["| kind | layer | mean attention distance (words) | dependency alignment | entropy (nats) |",
             "|---|---:|---:|---:|---:|"]
    for kind, body in profile["kinds"].items():
        layers = body["layers"]
        for layer, (distance, alignment, entropy) in enumerate(zip(*(layers[name] for name in LAYER_STATISTICS))):
            lines.append(f"| {kind} | {layer} | {distance:.2f} | {alignment:.3f} | {entropy:.3f} |")
    return lines


def render_profiles(profiles: list[dict]) -> str:
    """Markdown: one overview table over all models, then each model's Table 1 and layer profile."""
    lines = _overview(profiles)
    for profile in profiles:
        lines += ["", f"#### {profile['name']}", ""]
        if profile["description"]:
            lines += [profile["description"], ""]
        lines += _syntactic(profile) + [""] + _layers(profile)
    return "\n".join(lines) + "\n"


def replace_block(document: str, name: str, body: str) -> str:
    """``document`` with the text between ``<!-- BEGIN generated:NAME -->`` and its END marker
    replaced by ``body`` (the convention of docs/reproduction.md)."""
    begin, end = f"<!-- BEGIN generated:{name} -->\n", f"<!-- END generated:{name} -->"
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise HeadlabError(f"no block {name!r} in the document (add '{begin.strip()}' and '{end}')")
    return document[: start + len(begin)] + body + document[stop:]


def read_block(document: str, name: str) -> str:
    begin, end = f"<!-- BEGIN generated:{name} -->\n", f"<!-- END generated:{name} -->"
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise HeadlabError(f"no block {name!r} in the document")
    return document[start + len(begin): stop]
