"""Builds a small analysis directory for the report tests (no test functions here).

A tiny random Marian model (positions up to 256, so that a 200-token sentence fits), a
word-level tokenizer, attention examples written by headlab.report, and hand-made
HeadScores, agreement, labels, Table 1, sweep, figure and manifest files in the layout that
``headlab analyze`` writes. Seeded, so every build is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from headlab.heads import HeadScores, atomic_write_text
from headlab.importance.agreement import compute_agreement
from headlab.report import write_attention_examples
from support.models import CONFIGS
from support.treebank import word_tokenizer

SCRIPT_SENTENCE = "the cat <script>window.__pwned=1</script> sat"
IMG_SENTENCE = 'a dog <img src=x onerror="window.__pwned=2"> ran & " quoted'
SOURCES = [
    "the cat sat on the mat",
    SCRIPT_SENTENCE,
    IMG_SENTENCE,
    "a small dog ran in the park",
]
TARGETS = ["le chat est assis", "le chat <b>bold</b> est", "un chien", "un petit chien court"]
EXEMPLARS = {  # aggregate/exemplars.json: block -> per head, strongest first (Exemplar.to_json)
    f"{kind}:{layer}": [[{"weight": 0.9 - 0.1 * n - 0.01 * head, "sentence": n, "sent_id": f"s{n}", "where": "",
                          "query": 1, "key": 2, "query_word": "cat", "key_word": "<sat>",
                          "text": "the cat <sat> on the mat" if n else "a cat <sat> on"}
                         for n in range(4)] for head in range(4)]
    for kind in ("enc_self", "dec_self", "dec_cross") for layer in range(2)}
EXEMPLARS["enc_self:0"][1][0].update(sentence=7, query=1, key=3, query_word="dog", key_word="a", text="a dog & a cat")
LONG_TOKENS = 199  # words; the tokenizer adds </s>: 200 tokens


def long_sentence() -> str:
    words = "the cat sat on a mat while dog ran in park".split()
    return " ".join(words[i % len(words)] for i in range(LONG_TOKENS))


def tiny_marian(seed: int = 0):
    cls, config = CONFIGS["marian"]()
    config.max_position_embeddings = 256
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(config).eval()


def tokenizer():
    words = " ".join(SOURCES + TARGETS + [long_sentence()]).split()
    return word_tokenizer(words)


def _scores(rng, method, n_layers=2, n_heads=4, signed=False):
    scores = {}
    for kind in ("enc_self", "dec_self", "dec_cross"):
        values = rng.normal(size=(n_layers, n_heads)) if signed else rng.random((n_layers, n_heads))
        scores[kind] = values
    scores["enc_self"][1, 3] = np.nan  # a pruned head
    return HeadScores(scores, method, "tiny-marian", {"data": "fixture"})


def build_analysis_dir(directory: Path, *, long: bool = True, stages_missing: bool = False,
                       attention: bool = True) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = []
        if attention:
            sources = SOURCES + ([long_sentence()] if long else [])
            targets = TARGETS + (["le chat"] if long else [])
            outputs = write_attention_examples(tiny_marian(), tokenizer(), sources, targets,
                                               directory / "attention", max_sentences=20)
    finally:
        torch.set_num_threads(previous)
    stages = [{"name": "attention", "status": "done" if attention else "skipped",
               "reason": None if attention else "no --source given", "seconds": 0.4, "outputs": outputs}]
    if stages_missing:
        stages += [
            {"name": "importance", "status": "failed", "reason": "model has no LM head <needs one>", "seconds": 0.1,
             "outputs": []},
            {"name": "functions", "status": "skipped", "reason": "no --conllu given", "seconds": None, "outputs": []},
            {"name": "aggregate", "status": "skipped", "reason": "no --conllu given", "seconds": None, "outputs": []},
            {"name": "prune", "status": "skipped", "reason": "--prune not given", "seconds": None, "outputs": []},
        ]
    else:
        measures = {}
        for method in ("confidence", "lrp", "gradient", "ablation"):
            measures[method] = _scores(rng, method, signed=(method == "ablation"))
            measures[method].save(directory / "importance" / f"{method}.json")
        compute_agreement({m: s for m, s in measures.items() if m != "ablation"}, measures["ablation"]).save(
            directory / "importance")
        for name in ("mean_distance", "mean_entropy", "variability", "dependency_alignment"):
            _scores(rng, name).save(directory / "aggregate" / f"{name}.json")
        for tag in ("NOUN", "VERB"):
            _scores(rng, tag).save(directory / "aggregate" / "pos" / f"{tag}.json")
        atomic_write_text(directory / "aggregate" / "exemplars.json", json.dumps(EXEMPLARS, ensure_ascii=False))
        _scores(rng, "positional_share").save(directory / "functions" / "positional" / "share.json")
        _scores(rng, "syntactic_margin", signed=True).save(directory / "functions" / "syntactic" / "margin.json")
        offsets = {k: np.array([[-1, 1, 1, 2], [-1, -1, 1, np.nan]])
                   for k in ("enc_self", "dec_self", "dec_cross")}
        HeadScores(offsets, "positional_offset", "tiny-marian", {"data": "fixture"}).save(
            directory / "functions" / "positional" / "offset.json")
        # as `headlab analyze` writes it: every analysed head, most with no function (an empty list)
        labels = {f"{k}:{layer}:{head}": [] for k in ("enc_self", "dec_self", "dec_cross")
                  for layer in range(2) for head in range(4)}
        labels.update({"enc_self:0:1": ["positional -1"], "enc_self:1:2": ["nsubj v→s", "positional +1"],
                       "dec_cross:1:2": ["rare"]})
        atomic_write_text(directory / "functions" / "labels.json", json.dumps(labels, ensure_ascii=False))
        table1 = {"relations": ["nsubj", "obj"], "margin": 0.1, "table": [
            {"kind": "enc_self", "relation": "nsubj", "direction": "dep->gov", "label": "v → s", "n_arcs": 40,
             "baseline_offset": 1, "baseline": 0.45, "best_head": [1, 2], "best_accuracy": 0.71, "n_syntactic": 1},
            {"kind": "enc_self", "relation": "obj", "direction": "gov->dep", "label": "v → o", "n_arcs": 0,
             "baseline_offset": None, "baseline": None, "best_head": None, "best_accuracy": None, "n_syntactic": 0},
        ], "syntactic_heads": []}
        atomic_write_text(directory / "functions" / "syntactic" / "table1.json", json.dumps(table1, ensure_ascii=False))
        sweep = [{"point": "full", "lam": None, "keep": None, "enc_self": 8, "dec_self": 8, "dec_cross": 8, "heads": 24,
                  "bleu": 12.5, "chrf": 40.1, "loss": 2.1, "status": "reference"},
                 {"point": "lam-0.05", "lam": 0.05, "keep": None, "enc_self": 5, "dec_self": 6, "dec_cross": 7,
                  "heads": 18, "bleu": 12.1, "chrf": 39.8, "loss": 2.2, "status": "converged"}]
        atomic_write_text(directory / "prune" / "sweep.json", json.dumps(sweep))
        _figure(directory / "figures" / "figure1.png")
        # one row per stage with the files it wrote, as analyze records them: the report reads no
        # file of a stage that manifest.json does not list as done (headlab.report.vouched)
        def written(pattern: str) -> list[str]:
            return sorted(p.relative_to(directory).as_posix() for p in directory.glob(pattern) if p.is_file())

        stages += [{"name": n, "status": "done", "reason": None, "seconds": 1.0, "outputs": written(pattern)}
                   for n, pattern in (*((m, f"importance/{m}.json") for m in measures),
                                      ("agreement", "importance/agreement.*"), ("functions", "functions/**/*"),
                                      ("aggregate", "aggregate/**/*"), ("prune", "prune/**/*"),
                                      ("figures", "figures/**/*"))]
    manifest = {
        "headlab_version": "0.1.0", "model": "tiny-marian <fixture>", "source": "src.txt", "target": "ref.txt",
        "conllu": None, "created": "2025-01-01T00:00:00Z", "stages": stages,
        "figures": [] if stages_missing else [{"name": "figure1", "title": "Figure 1 <test>",
                                               "caption": "LRP & confidence", "png": "figures/figure1.png",
                                               "svg": None}],
    }
    atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
    return directory


def _figure(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(3, 2), dpi=60)
    ax.plot([0, 1, 2], [1, 0, 2])
    ax.set_title("fixture figure")
    fig.savefig(path)
    plt.close(fig)


def build_large_dir(directory: Path, n_layers: int, n_heads: int, *, sentences: int = 3, n_tokens: int = 20,
                    seed: int = 0) -> Path:
    """A synthetic analysis directory of a decoder-only model of ``n_layers`` x ``n_heads`` with
    every file the report reads (importance, functions, labels, aggregate with all UPOS tags,
    exemplars, agreement, a sweep, attention examples): for the report's size and speed at scale."""
    from headlab.aggregate import POS_TAGS
    from headlab.report.examples import write_example, write_index

    directory = Path(directory)
    rng = np.random.default_rng(seed)

    def scores(method, values=None):
        array = rng.random((n_layers, n_heads)) if values is None else values
        return HeadScores({"dec_self": array}, method, "synthetic", {"data": "synthetic"})

    measures = {m: scores(m) for m in ("confidence", "lrp", "gradient", "ablation")}
    for m, s in measures.items():
        s.save(directory / "importance" / f"{m}.json")
    compute_agreement({m: s for m, s in measures.items() if m != "ablation"}, measures["ablation"]).save(
        directory / "importance")
    scores("positional_share").save(directory / "functions" / "positional" / "share.json")
    scores("positional_offset", rng.choice([-2, -1, 1, 2], size=(n_layers, n_heads)).astype(float)).save(
        directory / "functions" / "positional" / "offset.json")
    scores("syntactic_margin", rng.normal(size=(n_layers, n_heads))).save(
        directory / "functions" / "syntactic" / "margin.json")
    scores("rare_tokens").save(directory / "functions" / "rare_tokens" / "rarest.json")
    labels = {f"dec_self:{layer}:{head}": [] for layer in range(n_layers) for head in range(n_heads)}
    labels["dec_self:1:3"] = ["positional -1"]
    labels[f"dec_self:{n_layers - 1}:0"] = ["nsubj v→s"]
    atomic_write_text(directory / "functions" / "labels.json", json.dumps(labels, ensure_ascii=False))
    for name in ("mean_distance", "mean_entropy", "variability", "dependency_alignment"):
        scores(name).save(directory / "aggregate" / f"{name}.json")
    for tag in POS_TAGS:
        scores(tag).save(directory / "aggregate" / "pos" / f"{tag}.json")
    words = [f"w{i}" for i in range(n_tokens)]
    exemplars = {f"dec_self:{layer}": [[{"weight": float(rng.random()), "sentence": int(n), "sent_id": f"s{n}",
                                         "where": "", "query": 3, "key": 1, "query_word": "w3", "key_word": "w1",
                                         "text": " ".join(words[: 10 + n % 10])} for n in rng.integers(0, 400, 5)]
                                       for _ in range(n_heads)] for layer in range(n_layers)}
    atomic_write_text(directory / "aggregate" / "exemplars.json", json.dumps(exemplars))
    sweep = [{"point": "full", "heads": n_layers * n_heads, "loss": 2.0, "status": "reference"}] + [
        {"point": f"keep-{k}", "keep": k, "heads": k, "loss": 2.0 + 1.0 / k, "status": "converged"}
        for k in (n_layers * n_heads // 2, n_layers * n_heads // 4, n_layers * n_heads // 8)]
    atomic_write_text(directory / "prune" / "sweep.json", json.dumps(sweep))
    entries = []
    tokens = ["<s>"] + [("\u0120" if i % 2 else "") + f"tok{i}" for i in range(n_tokens - 1)]
    for n in range(sentences):
        logits = rng.normal(scale=3.0, size=(n_layers, n_heads, n_tokens, n_tokens))
        logits = np.where(np.tril(np.ones((n_tokens, n_tokens), dtype=bool)), logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attention = {("dec_self", layer): probs[layer] for layer in range(n_layers)}
        entry = write_example(directory / "attention", n, {"source": tokens}, attention, seq2seq=False)
        entry.update({"line": n + 1, "source": " ".join(words), "target": None, "target_from": None})
        entries.append(entry)
    write_index(directory / "attention", entries, "synthetic")
    manifest = {"headlab_version": "0.1.0", "model": f"synthetic {n_layers}x{n_heads}", "source": "synthetic",
                "created": "2025-01-01T00:00:00Z", "stages": [], "figures": []}
    atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
    return directory
