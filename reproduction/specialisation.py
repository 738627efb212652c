"""When do encoder heads specialise? Confidence and positional share over training checkpoints.

For every checkpoint directory of a model's training run (``epoch-001`` ... in the config's
``checkpoints`` directory) and for the final model itself, on a fixed sample of the first N
validation sentences:

* **confidence** of every encoder head (:func:`headlab.importance.compute_confidence`,
  Voita et al. 2019, Sec. 4). Only encoder self-attention is scored, which does not depend on
  the decoder, so the decoder is teacher-forced on the reference (no translation needed);
* **best positional share** of every encoder head: the share of its maxima at its most
  frequent relative offset (:mod:`headlab.functions.positional`, Sec. 5.1), over subword tokens
  and over whitespace words. The sentences go through :func:`headlab.functions.analyze_heads`
  as a flat dummy parse (positional heads need no tree; the file is written to the work dir).

Each checkpoint's numbers are written to ``<work>/specialisation/<checkpoint>.json`` as soon as
they are known, with the fingerprint of the weights they were made from (a rerun skips those
whose weights are unchanged); ``specialisation.json`` gathers them.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from headlab import HeadlabError
from headlab.heads import atomic_write_text
from headlab.resume import SkipStage, weights_fingerprint
from reproduction.config import ModelEntry, ReproduceConfig

__all__ = ["run_specialisation", "checkpoint_dirs", "summarise_checkpoint"]


def checkpoint_dirs(config: ReproduceConfig, model: ModelEntry) -> list[tuple[str, Path]]:
    """``[(name, directory)]``: the training checkpoints in order, then ``final`` (the model)."""
    found: list[tuple[str, Path]] = []
    if model.checkpoints:
        dirs = [d for d in config.path(model.checkpoints).glob(model.checkpoint_pattern) if (d / "config.json").is_file()]
        found = [(d.name, d) for d in sorted(dirs, key=lambda d: (_epoch(d.name) or 0, d.name))]
    final = config.path(model.path)
    if (final / "config.json").is_file():
        found.append(("final", final))
    return found


def _epoch(name: str) -> int | None:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else None


def _flat_conllu(lines: list[str], path: Path) -> Path:
    """A CoNLL-U file of whitespace words, each attached to the first word (positional needs no tree)."""
    out = []
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        out.append(f"# sent_id = line-{n}")
        for i, word in enumerate(words, 1):
            out.append(f"{i}\t{word}\t_\tX\t_\t_\t{int(i > 1)}\t{'dep' if i > 1 else 'root'}\t_\t_")
        out.append("")
    atomic_write_text(path, "\n".join(out) + "\n")
    return path


def summarise_checkpoint(confidence: np.ndarray, token_share: np.ndarray, word_share: np.ndarray,
                         threshold: float) -> dict:
    """Per-checkpoint summary of ``[n_layers, n_heads]`` encoder arrays."""
    def stats(a):
        return {"max": float(np.nanmax(a)), "mean": float(np.nanmean(a))}
    return {
        "confidence": stats(confidence),
        "token_share": stats(token_share),
        "word_share": stats(word_share),
        "n_positional_token": int((np.nan_to_num(token_share) >= threshold).sum()),
        "n_positional_word": int((np.nan_to_num(word_share) >= threshold).sum()),
        "n_confident": int((np.nan_to_num(confidence) > 0.8).sum()),
    }


def _measure(directory: Path, tokenizer_dir: Path, sources: list[str], references: list[str], conllu: Path,
             threshold: float, batch_size: int) -> dict:
    from headlab.api import functions
    from headlab.importance import compute_confidence, describe_model, encode_texts
    from headlab.loading import load_model, load_tokenizer

    model = load_model(str(directory))
    tokenizer = load_tokenizer(str(tokenizer_dir))
    info = describe_model(model, tokenizer)
    data = encode_texts(tokenizer, info, sources, references)
    # Encoder self-attention does not see the decoder: teacher-force the reference.
    data = replace(data, translations=data.references)
    confidence = compute_confidence(model, data, info, batch_size=batch_size, kinds=("enc_self",))["enc_self"]
    analysis = functions(model, tokenizer, conllu, batch_size=batch_size, relations=(),
                         positional_threshold=threshold)
    token_share = analysis.positional_tokens.share["enc_self"]
    token_offset = analysis.positional_tokens.offset["enc_self"]
    word_share = analysis.positional.share["enc_self"]
    word_offset = analysis.positional.offset["enc_self"]
    clean = lambda a: [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in a]  # noqa: E731
    return {
        "summary": summarise_checkpoint(confidence, token_share, word_share, threshold),
        "confidence": clean(confidence),
        "token_share": clean(token_share),
        "token_offset": clean(token_offset),
        "word_share": clean(word_share),
        "word_offset": clean(word_offset),
        "n_sentences": len(data),
        "n_tokens": analysis.report.n_tokens,
        "n_words": analysis.report.n_words,
    }


def run_specialisation(config: ReproduceConfig, model: ModelEntry, *, force: bool = False,
                       log: Callable[[str], None] = print) -> list[str]:
    """Measure every checkpoint (resumable); write ``specialisation.json``. Returns what it did, as text."""
    import time

    from headlab.data.parallel import read_lines

    options = config.specialisation
    n = int(options.get("n_sentences", 500))
    threshold = float(options.get("positional_threshold", 0.9))
    batch_size = int(options.get("batch_size", 32))
    checkpoints = checkpoint_dirs(config, model)
    if model.checkpoints and not any(name != "final" for name, _ in checkpoints):
        # Checkpoints are not committed: on a machine without them keep the committed results.
        raise SkipStage(f"no checkpoint matches {model.checkpoints}/{model.checkpoint_pattern} on this machine; "
                       f"the committed specialisation.json (if any) is kept")
    if not checkpoints:
        raise SkipStage(f"no model at {model.path}")
    work = config.work(model, "specialisation")
    src = config.data_file(config.specialisation_split, model.src)
    tgt = config.data_file(config.specialisation_split, model.tgt)
    pairs = [(s, t) for s, t in zip(read_lines(src), read_lines(tgt)) if s.strip() and t.strip()][:n]
    if not pairs:
        raise HeadlabError(f"{src}: no sentence pairs for the specialisation sample")
    sources, references = [s.strip() for s, _ in pairs], [t.strip() for _, t in pairs]
    conllu = _flat_conllu(sources, work / "sample.conllu")
    tokenizer_dir = config.path(model.tokenizer) if model.tokenizer else config.path(model.path)
    import torch

    torch.set_num_threads(config.threads)
    points = []
    for name, directory in checkpoints:
        path = work / f"{name}.json"
        weights = weights_fingerprint(directory)
        record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not force else {}
        # A measurement is reused only on the weights it was made from: "final" is the model
        # directory, which a re-export replaces under the same name.
        if not record or record.get("model_sha256") != weights:
            started = time.perf_counter()
            tok = config.path(model.path) if name == "final" and (config.path(model.path) / "tokenizer.json").is_file() \
                else tokenizer_dir
            record = {"checkpoint": name, "epoch": _epoch(name), "path": str(directory), "model_sha256": weights,
                      **_measure(directory, tok, sources, references, conllu, threshold, batch_size)}
            record["seconds"] = round(time.perf_counter() - started, 1)
            atomic_write_text(path, json.dumps(record, indent=1) + "\n")
            s = record["summary"]
            log(f"  {model.name} {name}: max positional share {s['token_share']['max']:.3f} (tokens), "
                f"max confidence {s['confidence']['max']:.3f} ({record['seconds']:.0f} s)")
        points.append(record)
    history = _train_history(config, model)
    out = {
        "model": model.name,
        "data": str(src),
        "n_sentences": len(sources),
        "positional_threshold": threshold,
        "decoder_side": "reference (teacher-forced; encoder self-attention does not depend on it)",
        "checkpoints": [{**p, "bleu": history.get(p["epoch"]) if p.get("epoch") is not None else None} for p in points],
    }
    atomic_write_text(work / "specialisation.json", json.dumps(out, indent=1) + "\n")
    return [f"(Python) specialisation of {len(points)} checkpoints on {len(sources)} sentences of {src}"]


def _train_history(config: ReproduceConfig, model: ModelEntry) -> dict[int, float]:
    """Validation BLEU per epoch from the training run's history, when there is one."""
    if not model.checkpoints:
        return {}
    for candidate in (config.path(model.checkpoints).parent / "history.json",
                      config.path(model.path) / "train_history.json"):
        if candidate.is_file():
            try:
                records = json.loads(candidate.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                continue
            if isinstance(records, dict):
                records = records.get("epochs", records.get("history", []))
            out = {}
            for r in records if isinstance(records, list) else []:
                bleu = r.get("valid_bleu", r.get("bleu")) if isinstance(r, dict) else None
                if bleu is not None and r.get("epoch") is not None:
                    out[int(r["epoch"])] = float(bleu)
            if out:
                return out
    return {}
