"""Gated fine-tuning: L = L_xent + lambda L_C, then physical removal of the closed heads.

Voita et al. 2019, Sec. 6: start from a converged model, attach one Hard Concrete gate per
head, and fine-tune on L_xent + lambda L_C (Eq. (12) of Louizos et al. 2018 for L_C). Two modes:

- ``gates="auto"`` (the default): ``enc_self`` on a model with an encoder, ``dec_self`` on a
  decoder-only model; the record names the kinds it chose;
- ``gates="enc_self"``: gates on encoder self-attention only, decoder (and the embeddings it
  shares) frozen, so that encoder functions cannot migrate to the decoder (Sec. 6.2);
- ``gates="all"``: gates on every attention kind the model has, all parameters trained (Sec. 6.3).

With ``keep=N`` the fixed lambda is replaced by the Lagrangian of :mod:`headlab.pruning.budget`
and exactly N heads are kept at export.

The loop is :func:`headlab.training.loop.train` (Accelerate; runs under ``accelerate launch``
unchanged), used through its hooks: ``extra_loss`` adds the penalty, ``trainable`` freezes the
decoder, ``optimizer_factory`` gives the gates their own learning rate, ``callback`` writes the
diagnostics trajectory, ``compute_loss`` swaps in an LM loss for encoder-only and decoder-only
models.

Layout of ``out_dir``::

    prune_config.json   the options
    train/              the trainer's run (last/ is the resume point and the last good checkpoint)
    trajectory.jsonl    one JSON object per diagnostics step (appended, fsync'ed)
    dev_curve.jsonl     with a development set: its BLEU every --dev-every updates (headlab.pruning.dev)
    dev/                the development translations of each of those evaluations
    gates.json          final P(open) per head (a HeadScores file)
    pruned/             the physically smaller model (save_pruned) + tokenizer + README.md card
    hypotheses.txt      the evaluation set translated by the pruned model, one line per sentence (the
                        translations result.json's BLEU scores; paired bootstrap needs no weights then)
    result.json         heads kept per kind, BLEU, chrF, loss, parameters, the development curve,
                        the weights' fingerprint (model_sha256); written last
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, cast

import torch

from headlab.adapters import attention_blocks, flex_attention_dropout, flex_without_backward, idle_blocks
from headlab.capture import eval_mode
from headlab.compiled import model_entry
from headlab.errors import HeadlabError, counted
from headlab.gates import attach_gates, block_name, detach_gates
from headlab.heads import KINDS, atomic_write_text, write_json
from headlab.model_description import output_layer, position_limit
from headlab.options import comma_list
from headlab.pruning.budget import LagrangianBudget
from headlab.pruning.config import PruneConfig
from headlab.pruning.dev import DEV_CURVE_FILE, DEV_DIR, DevCurve, tie_note
from headlab.pruning.hard_concrete import HardConcreteGates
from headlab.resume import append_record, pairs_fingerprint, read_step_records
from headlab.shard import leave_process_group_at_exit, new_accelerator
from headlab.surgery import check_prunable, count_parameters, prune_heads, save_pruned
from headlab.training.config import TrainConfig
from headlab.training.corpus import EncodedCorpus, encode_corpus
from headlab.training.loop import check_resume_point, has_model, train
from headlab.training.losses import causal_lm_loss, evaluate_loss, label_smoothed_loss, masked_lm_loss, next_token_labels

__all__ = [
    "PruneConfig",
    "PruneResult",
    "prune_train",
    "resolve_kinds",
    "export_pruned",
    "evaluate_model",
    "evaluate_point",
    "read_trajectory",
    "encode_monolingual_corpus",
]

TRAJECTORY_FILE = "trajectory.jsonl"
RESULT_FILE = "result.json"
CONFIG_FILE = "prune_config.json"
HYPOTHESES_FILE = "hypotheses.txt"


@dataclass
class PruneResult:
    stopped: str
    message: str
    out_dir: str
    step: int
    heads_total: dict[str, int] = field(default_factory=dict)
    heads_kept: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    pruned_dir: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- checks


def named_kinds(gates: str) -> tuple[str, ...]:
    """The kinds a comma list of ``--gates`` names (``()`` for auto and all), checked without a
    model: the command refuses an empty list or an unknown kind before loading one."""
    if gates in ("all", "auto"):
        return ()
    kinds = comma_list(gates, "--gates")
    for kind in kinds:
        if kind not in KINDS:
            raise HeadlabError(f"--gates {gates}: unknown kind {kind!r}; expected auto, all or {', '.join(KINDS)}")
    return kinds


def resolve_kinds(model, gates: str) -> tuple[str, ...]:
    """The gated kinds for ``--gates``; an error if the model lacks one of them."""
    blocks = attention_blocks(model)
    # Kinds that only idle blocks have (Llava's enc_self, a decoder's unfed dec_cross): text never runs them, so their
    # gates would learn nothing but the penalty, and the export could not check their pruning (surgery.check_checkable).
    have = tuple(kind for kind in KINDS if any(b.kind == kind and not b.idle for b in blocks))
    if gates == "all":
        return have
    if gates == "auto":  # the paper's encoder self-attention where there is one; a decoder-only model's own
        return ("enc_self",) if "enc_self" in have else ("dec_self",) if "dec_self" in have else have
    kinds = named_kinds(gates)
    for kind in kinds:
        idle = idle_blocks(blocks) if any(b.kind == kind for b in blocks) and kind not in have else None
        if idle is not None:
            raise HeadlabError(f"--gates {gates}: the model's {kind} attention is {idle}, which token ids do not run "
                               "(a vision or audio tower, or a cross-attention given no encoder states): gate the kinds "
                               f"text runs ({', '.join(have)})")
        if kind not in have:
            raise HeadlabError(f"--gates {gates}: the model has no {kind} attention (it has {', '.join(have)})")
    return kinds


def with_gates_resolved(config: PruneConfig, model) -> PruneConfig:
    """``config`` with ``gates="auto"`` replaced by the kinds it means for ``model``."""
    if config.gates != "auto":
        return config
    return replace(config, gates=",".join(resolve_kinds(model, "auto")))


def _check_config(config: PruneConfig) -> None:
    if not (isinstance(config.lam, (int, float)) and math.isfinite(config.lam)) or config.lam < 0:
        raise HeadlabError(f"lambda must be a finite number >= 0, got {config.lam}")
    if config.keep is not None and config.keep < 1:  # its range, also for a config made in Python
        raise HeadlabError(f"--keep must be >= 1, got {config.keep}")
    if config.gate_lr <= 0 or config.multiplier_lr <= 0:
        raise HeadlabError("--gate-lr and --multiplier-lr must be > 0")
    if config.loss not in ("auto", "seq2seq", "causal_lm", "masked_lm"):
        raise HeadlabError(f"unknown loss {config.loss!r} (auto, seq2seq, causal_lm, masked_lm)")
    if config.dev_every < 0:
        raise HeadlabError(f"--dev-every must be >= 0, got {config.dev_every}")


def _decoder_parameters(model) -> set[int]:
    """Identities of the decoder's parameters, the output embeddings and anything tied to them."""
    ids: set[int] = set()
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is not None and decoder is not model:
        ids |= {id(p) for p in decoder.parameters()}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        ids |= {id(p) for p in out.parameters()}
    return ids


def _total_steps(data: EncodedCorpus, config: TrainConfig, accelerator) -> int:
    """Updates the run will make: epochs x this rank's batches, capped by max_steps."""
    from headlab.data.batching import token_budget_batches

    per_epoch = len(token_budget_batches(data, config.max_tokens, seed=config.seed, epoch=0,
                                 rank=accelerator.process_index, world_size=accelerator.num_processes))
    total = per_epoch * config.max_epochs
    return min(total, config.max_steps) if config.max_steps is not None else total


def _is_seq2seq(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def encode_monolingual_corpus(tokenizer, lines, max_positions: int = 512) -> EncodedCorpus:
    """Monolingual text for ``prune train``'s causal and masked LM losses, cut to ``max_positions``
    tokens (the tokenizer's truncation): the trainer batches by ``targets``, the loss reads
    ``input_ids`` (the ``sources``); both hold the same ids. Not ``headlab.lm.data``'s
    ``encode_lm_corpus``, which keeps ``</s>`` and one token more for next-token targets."""
    ids = tokenizer([line for line in lines if line.strip()], truncation=True, max_length=max_positions)["input_ids"]
    return EncodedCorpus(ids, [list(x) for x in ids])


_UNSMOOTHED = TrainConfig(label_smoothing=0.0)


def _next_token_loss(model, batch: dict, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """:func:`~headlab.training.losses.causal_lm_loss` on a batch of text (its ``labels`` are the
    inputs, not shifted), not label-smoothed, as the masked-LM loss is not: ``--label-smoothing``
    is the translation loss's."""
    labels = next_token_labels(batch["input_ids"], batch["attention_mask"])
    return causal_lm_loss(model, {**batch, "labels": labels}, _UNSMOOTHED)


def _loss_for(model, tokenizer, config: PruneConfig) -> tuple[str, Callable]:
    # A bare model (GLM-5-Next's text model: transformers 5.24 has no causal LM class for it) returns hidden states,
    # no logits: "auto" took it for a masked LM, and causal_lm failed on .logits after the run had started.
    if output_layer(model) is None:
        raise HeadlabError(
            f"prune train needs a loss, hence a language-model head, and {type(model).__name__} has none (a bare "
            "model: it returns hidden states, no logits); load the checkpoint with its head (a ...ForCausalLM, "
            "...ForMaskedLM or ...ForConditionalGeneration class) where transformers has one")
    kind = config.loss
    if kind == "auto":
        if _is_seq2seq(model):
            kind = "seq2seq"
        elif getattr(model.config, "is_decoder", False) or "CausalLM" in type(model).__name__ \
                or "LMHead" in type(model).__name__:
            kind = "causal_lm"
        else:
            kind = "masked_lm"
    if kind == "seq2seq":
        if not _is_seq2seq(model):
            raise HeadlabError(f"{type(model).__name__} is not an encoder-decoder model; use --loss causal_lm or masked_lm")
        return kind, label_smoothed_loss
    if kind == "causal_lm":
        return kind, _next_token_loss
    if tokenizer.mask_token_id is None:
        raise HeadlabError("masked_lm loss needs a tokenizer with a mask token")
    specials = tuple(i for i in (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.bos_token_id,
                                 tokenizer.eos_token_id) if i is not None)
    return kind, masked_lm_loss(tokenizer.mask_token_id, special_ids=specials)


# ----------------------------------------------------------------------------- diagnostics


def read_trajectory(path: str | os.PathLike) -> list[dict]:
    """The diagnostics records, one per step (a resumed run's repeats replaced by the newer one)."""
    path = Path(path)
    if path.is_dir():
        path = path / TRAJECTORY_FILE
    return read_step_records(path)


def _p_open_rows(gates: HardConcreteGates, model) -> dict[str, list[list[float | None]]]:
    """P(open) per kind as ``[layer][head]`` by real layer and original head index, null where no
    gate is (a head or layer an earlier pruning removed): the numbering of gates.json. On an
    unpruned model, the same lists as by position."""
    table = gates.p_open_scores(model=model)
    return {kind: [[None if math.isnan(v) else round(float(v), 5) for v in row] for row in array.tolist()]
            for kind, array in table.scores.items()}


class _Diagnostics:
    """Holds what extra_loss computed and the log_alpha gradients, and writes trajectory lines."""

    def __init__(self, gates: HardConcreteGates, config: PruneConfig, path: Path, log, total_steps: int | None):
        self.gates, self.config, self.path, self.log = gates, config, path, log
        self.total_steps = total_steps
        self.penalty = float("nan")
        self.term = float("nan")
        self.coefficient = config.lam  # d(penalty term)/d(L_C)
        self.target: float | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.hinted = False
        for name, parameter in gates.log_alpha.items():
            parameter.register_hook(self._store(name))

    def _store(self, name):
        def hook(grad):
            self.grads[name] = grad.detach().float().cpu()
        return hook

    def extra_loss(self, model, batch, step: int) -> torch.Tensor:
        penalty = self.gates.l0_penalty()  # E[L0], Louizos et al. 2018, Eq. (12)
        budget = getattr(self.gates, "budget", None)
        if budget is not None:
            term = budget.penalty(penalty, step)
            self.target = budget.target(step)
            gap = penalty.item() - self.target
            self.coefficient = budget.lambda_1.item() + 2 * budget.lambda_2.item() * gap
        else:
            term = self.config.lam * penalty  # lambda L_C, Voita et al. 2019, Sec. 6.1
        self.penalty, self.term = penalty.item(), term.item()
        return term

    def record(self, model, step: int, info: dict, final: bool = False) -> dict:
        gates = self.gates
        p_open = gates.p_open()
        flat = torch.cat([p_open[key] for key in gates.keys()])
        open_kind = gates.open_per_kind()
        # Gradients on log_alpha: the penalty part in closed form, the loss part as the rest.
        penalty_grad: Any  # the pieces, then their mean
        loss_grad: Any
        penalty_grad, loss_grad = [], []
        for key in gates.keys():
            name = block_name(key)
            a = gates.log_alpha[name].detach().float().cpu()
            sig = torch.sigmoid(a - gates._shift_zero)
            analytic = self.coefficient * sig * (1 - sig)  # d(coef * sigmoid(a - shift))/da
            penalty_grad.append(analytic)
            total = self.grads.get(name)
            loss_grad.append(total - analytic if total is not None else torch.zeros_like(a))
        penalty_grad = torch.cat(penalty_grad).abs().mean().item()
        loss_grad = torch.cat(loss_grad).abs().mean().item()
        closed = gates.n_gates() - sum(open_kind.values())
        loss = info.get("loss", float("nan"))
        record = {
            "step": step,
            "loss": loss,
            "lambda": self.config.lam if self.target is None else None,
            "l0_penalty": self.penalty,
            "penalty_term": self.term,
            "penalty_to_loss": self.term / loss if loss else None,
            "expected_l0": float(flat.sum()),
            "heads_closed": closed,
            "heads_open": open_kind,
            "n_gates": gates.n_gates(),
            "polarized": float(((flat < 0.05) | (flat > 0.95)).float().mean()),
            "grad_loss_log_alpha": loss_grad,
            "grad_penalty_log_alpha": penalty_grad,
            "lr": info.get("lr"),
            "final": final,
            "p_open": _p_open_rows(gates, model),
        }
        budget = getattr(gates, "budget", None)
        if budget is not None:
            record.update(target=self.target, lambda_1=budget.lambda_1.item(), lambda_2=budget.lambda_2.item())
        hint = self.hint(record)
        if hint:
            record["hint"] = hint
        return record

    def hint(self, record: dict) -> str | None:
        """Why the gates may not be closing, from the numbers (docs/pruning.md, 'Gates never close')."""
        if record["heads_closed"] > 0 or self.target is not None:
            return None
        if not record.get("final"):
            if self.total_steps and record["step"] < 0.3 * self.total_steps:
                return None
            if not self.total_steps and record["step"] < 5 * max(self.config.log_every, 1):
                return None
        ratio = record["grad_penalty_log_alpha"] / max(record["grad_loss_log_alpha"], 1e-12)
        if self.config.lam == 0:
            return "lambda is 0: no gate will close"
        if ratio < 1.0:
            return (f"no gate has closed: on log_alpha the penalty's gradient is {ratio:.2g}x the loss's "
                    f"(lambda*L_C is {record['penalty_to_loss'] or 0:.2g}x the loss); raise --lam")
        return ("no gate has closed although the penalty dominates the gradient: log_alpha moves too slowly; "
                "raise --gate-lr, lower --init-log-alpha or train longer")

    def callback(self, model, step: int, info: dict) -> None:
        if not info.get("is_main_process", True):
            return
        record = self.record(model, step, info)
        append_record(self.path, record)
        text = (f"step {step}: loss {record['loss']:.3f}, E[L0] {record['expected_l0']:.1f}/{record['n_gates']}, "
                f"closed {record['heads_closed']}, polarized {record['polarized']:.0%}")
        if record.get("target") is not None:
            text += f", target {record['target']:.1f}, lambda_1 {record['lambda_1']:.3g}"
        self.log(text)
        if record.get("hint") and not self.hinted:
            self.hinted = True
            self.log("hint: " + record["hint"])


# ----------------------------------------------------------------------------- evaluation


def evaluate_model(model, tokenizer, data, *, beam: int = 4, batch_size: int = 64, loss_kind: str = "seq2seq",
                   compute_loss: Callable | None = None, hypotheses_file: str | os.PathLike | None = None) -> dict:
    """BLEU and chrF (sacreBLEU) and loss of a translation model on ``data``; loss only for LMs.
    ``hypotheses_file``: where to write the translations scored, one per line (atomically)."""
    if data is None:
        return {}
    metrics: dict[str, Any] = {}
    if loss_kind == "seq2seq":
        from headlab.nmt.bleu import compute_scores
        from headlab.nmt.translate import translate

        hypotheses = translate(model, tokenizer, data.sources, beam=beam, batch_size=batch_size)
        scores = compute_scores(hypotheses, data.targets)
        if hypotheses_file is not None:
            atomic_write_text(hypotheses_file, "".join(h.replace("\n", " ") + "\n" for h in hypotheses))
        metrics.update(bleu=scores.bleu, chrf=scores.chrf, bleu_signature=scores.bleu_signature, beam=beam)
    metrics["loss"] = evaluate_loss(model, tokenizer, data, compute_loss=None if loss_kind == "seq2seq" else compute_loss)
    return metrics


def evaluate_point(model, tokenizer, data, config: PruneConfig, *, loss_kind: str = "seq2seq",
                   compute_loss: Callable | None = None, hypotheses_file: str | os.PathLike | None = None) -> dict:
    """:func:`evaluate_model` with ``config``'s beam and batch size, and the latency of its first
    ``config.latency_sentences`` sentences when it asks for them (a translation model only)."""
    metrics = evaluate_model(model, tokenizer, data, beam=config.eval_beam, batch_size=config.eval_batch_size,
                             loss_kind=loss_kind, compute_loss=compute_loss, hypotheses_file=hypotheses_file)
    if config.latency_sentences and data is not None and loss_kind == "seq2seq":
        metrics["latency"] = measure_latency(model, tokenizer, list(data.sources[: config.latency_sentences]),
                                             beam=config.eval_beam)
    return metrics


def measure_latency(model, tokenizer, sentences, *, beam: int = 4, batch_size: int = 32, repeats: int = 3) -> dict:
    """Seconds for the encoder alone and for end-to-end translation of ``sentences`` (best of
    ``repeats``), on the model's device, in the current thread settings; the model in eval mode
    (no dropout) while timed, in its own mode again afterwards."""
    from headlab.nmt.translate import translate

    batches = [sentences[i : i + batch_size] for i in range(0, len(sentences), batch_size)]
    device = next(model.parameters()).device
    encoder = model.get_encoder()

    def run_encoder():
        with torch.inference_mode():
            for batch in batches:
                enc = tokenizer(batch, return_tensors="pt", padding=True).to(device)
                encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])

    def best(fn):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with eval_mode(model):
        return {
            "encoder_s": best(run_encoder),
            "translate_s": best(lambda: translate(model, tokenizer, sentences, beam=beam, batch_size=batch_size)),
            "sentences": len(sentences),
            "beam": beam,
        }


# ----------------------------------------------------------------------------- export


def export_pruned(model, spec, out_dir: str | os.PathLike, tokenizer=None) -> dict:
    """Detach any gates, remove ``spec``'s heads physically and save with save_pruned."""
    from transformers.utils import logging as hf_logging

    detach_gates(model)
    before = count_parameters(model)
    prune_heads(model, spec)
    out_dir = Path(out_dir)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save_pruned(model, out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return {"parameters_before": before, "parameters_after": count_parameters(model)}


def heads_per_kind(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for block in attention_blocks(model):
        counts[block.kind] = counts.get(block.kind, 0) + block.n_heads
    return counts


def model_card(result: dict, config: PruneConfig, load_line: str = "Load with `headlab.load_pruned(path)`.") -> str:
    kept, total = result["heads_kept"], result["heads_total"]
    lines = ["# Pruned with headlab (Hard Concrete gates, Voita et al. 2019, Sec. 6)", ""]
    if config.command:
        lines += ["Command:", "", "```", config.command, "```", ""]
    lines += ["| kind | heads kept | of |", "|---|---|---|"]
    lines += [f"| {kind} | {kept.get(kind, 0)} | {n} |" for kind, n in total.items()]
    metrics = result.get("metrics", {})
    lines += ["", f"Mode: gates on {config.gates}" + (f", budget {counted(config.keep, 'head')}" if config.keep is not None
                                                         else f", lambda {config.lam}")]
    if "bleu" in metrics:
        lines.append(f"BLEU {metrics['bleu']:.2f}, chrF {metrics['chrf']:.2f} (beam {metrics.get('beam')}; "
                     f"{metrics.get('bleu_signature', '')})")
    if "loss" in metrics:
        lines.append(f"Loss (cross-entropy per token): {metrics['loss']:.4f}")
    if "parameters_after" in metrics:
        lines.append(f"Parameters: {metrics['parameters_after']:,} (unpruned {metrics['parameters_before']:,})")
    lines += ["", load_line]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the run


@model_entry  # torch.compile's wrapper: its model, run eagerly (headlab.compiled)
def prune_train(model, tokenizer, train_data, eval_data=None, config: PruneConfig | None = None, *,
                dev_data=None, accelerator=None, log: Callable[[str], None] | None = None) -> PruneResult:
    """Gated fine-tuning of ``model`` into ``config.train.out_dir``'s parent layout (see module doc).

    ``train_data``: a ParallelCorpus for translation, an EncodedCorpus for LMs
    (:func:`encode_monolingual_corpus`). ``eval_data``: a ParallelCorpus scored at the end (BLEU, chrF,
    loss) with the pruned model, or None. ``dev_data``: a ParallelCorpus translated every
    ``config.dev_every`` updates (:mod:`headlab.pruning.dev`; a translation model only), or None.
    Returns a :class:`PruneResult`; on divergence
    (``stopped == "diverged"``) nothing is exported and ``train/last`` is the last good checkpoint.
    The stages: the gates and the checks before any work, the output directory, the gated run of
    the trainer (its hooks: :class:`_GateHooks`), then export and evaluation (:func:`_export`).
    """

    config = config or PruneConfig()
    _check_config(config)
    accelerator = accelerator or new_accelerator()
    if accelerator.num_processes > 1:
        leave_process_group_at_exit()  # a caller's Accelerator too
    log = log or accelerator.print
    if (problem := flex_without_backward(model, accelerator.device)) is not None:
        raise HeadlabError(f"gated training differentiates the model's own forward: {problem}")
    if (problem := flex_attention_dropout(model)) is not None:
        raise HeadlabError(f"gated training runs the model in training mode: {problem}")
    out_dir = Path(config.train.out_dir)
    run_dir = out_dir / "train"
    train_config = TrainConfig(**{**config.train.to_dict(), "out_dir": str(run_dir)})

    config = with_gates_resolved(config, model)  # recorded as the kinds chosen: the record says what was gated
    config = _with_data_fingerprints(config, train_data, dev_data)  # a --resume on other data is refused
    kinds, gates = _gates(model, config)
    if (out_dir / RESULT_FILE).exists() and not (train_config.overwrite or train_config.resume):
        raise HeadlabError(f"{out_dir} already holds a finished pruning run; pass --overwrite to replace it")
    loss_kind, compute_loss = _loss_for(model, tokenizer, config)
    if (dev_data is None) != (config.dev_every == 0):
        raise HeadlabError("a development curve needs both development data (--dev-src/--dev-tgt) and --dev-every N > 0")
    if dev_data is not None and loss_kind != "seq2seq":
        raise HeadlabError("the development curve is greedy BLEU: it needs a translation model (--loss seq2seq)")
    if not isinstance(train_data, EncodedCorpus):  # encode once here to know the number of steps
        train_data = encode_corpus(tokenizer, train_data, position_limit(model))
        if train_data.n_truncated:
            log(f"{train_data.n_truncated} training sequences cut to the model's positions")
    total_steps = _total_steps(train_data, train_config, accelerator)
    if config.keep is not None:
        warmup = int(config.budget_warmup * total_steps) if total_steps else 0
        gates.budget = LagrangianBudget(gates.n_gates(), config.keep, warmup)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder-only tokenizers often have none
    freeze = config.freeze_decoder
    if freeze is None:
        freeze = kinds == ("enc_self",) and _is_seq2seq(model)
    frozen = _decoder_parameters(model) if freeze else set()
    _prepare_output(out_dir, run_dir, train_config, config, accelerator)

    heads_total = heads_per_kind(model)
    attach_gates(model, gates)
    diagnostics = _Diagnostics(gates, config, out_dir / TRAJECTORY_FILE, log, total_steps)
    dev = _dev_curve(model, tokenizer, dev_data, out_dir, config, gates, accelerator, log)
    hooks = _GateHooks(config, gates, frozen, diagnostics, dev)
    try:
        result = train(model, tokenizer, train_data, None, train_config, compute_loss=compute_loss,
                       extra_loss=diagnostics.extra_loss, trainable=hooks.trainable, callback=hooks.callback,
                       callback_every=hooks.callback_every(), optimizer_factory=hooks.optimizer,
                       accelerator=accelerator, log=log)
    except BaseException:
        detach_gates(model)
        raise
    if result.stopped == "diverged":
        detach_gates(model)
        return PruneResult("diverged", result.message + "; nothing exported", str(out_dir), result.step, heads_total)

    # ---- final gates, export, evaluation (main process)
    model.eval()
    final = diagnostics.record(model, result.step, {"loss": float("nan")}, final=True)
    spec = gates.closed_heads()  # the test-time gates at 0 (with a budget: all but the top `keep`)
    outcome = PruneResult(result.stopped, result.message, str(out_dir), result.step, heads_total)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _export(model, tokenizer, eval_data, config, gates, spec, final, outcome, dev, loss_kind, compute_loss, log)
    else:
        detach_gates(model)  # other ranks: the main process wrote the pruned model
    accelerator.wait_for_everyone()
    return outcome


def _gates(model, config: PruneConfig) -> tuple[tuple[str, ...], HardConcreteGates]:
    """The gated kinds and their gates; a model headlab cannot prune exactly, or a bad budget, is
    refused before any work."""
    kinds = resolve_kinds(model, config.gates)
    check_prunable(model, kinds)  # the export prunes: a family headlab cannot prune exactly is refused now
    # With a budget the test-time gates are the `keep` heads the export keeps (dev curve = export).
    gates = HardConcreteGates.for_model(model, kinds, beta=config.beta, gamma=config.gamma, zeta=config.zeta,
                                        init_log_alpha=config.init_log_alpha, keep=config.keep)
    if config.keep is not None:
        LagrangianBudget(gates.n_gates(), config.keep)  # refuse a bad budget before any work
    return kinds, gates


def _prepare_output(out_dir: Path, run_dir: Path, train_config: TrainConfig, config: PruneConfig, accelerator) -> None:
    """Refuse an occupied or damaged run directory; on a fresh start remove the old run's files;
    write the options (``prune_config.json``)."""
    resuming = train_config.resume and (run_dir / "last").is_dir()
    if not resuming and has_model(run_dir) and not train_config.overwrite:
        raise HeadlabError(f"{out_dir} already holds a pruning run; pass --overwrite to replace it "
                           "or --resume to continue it")
    if resuming:
        # a damaged train/last, or other batches mid-epoch, refused before this run's config is rewritten
        check_resume_point(run_dir, train_config)
        _check_same_run(out_dir, config)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not resuming:  # a fresh start: the old run's files would mislead
            for name in (TRAJECTORY_FILE, RESULT_FILE, "gates.json", DEV_CURVE_FILE):
                if (out_dir / name).exists():
                    (out_dir / name).unlink()
            if (out_dir / DEV_DIR).is_dir():
                shutil.rmtree(out_dir / DEV_DIR)
        atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")


def _with_data_fingerprints(config: PruneConfig, train_data, dev_data) -> PruneConfig:
    """``config`` with the SHA-256 of its training and development pairs, unless a caller (a sweep) set them."""
    return replace(config, train_data_sha256=config.train_data_sha256 or pairs_fingerprint(train_data) or "",
                   dev_data_sha256=config.dev_data_sha256 or pairs_fingerprint(dev_data) or "")


# The options of prune_config.json that change what the gated run learns, with what names them to a user. A
# resume with another value would go on from the first part's weights and gates under the new one and record
# the new one only: two trainings mixed under one record. (train.*: the trainer's own resume records changes.)
_RUN_DEFINING = {
    "gates": "--gates", "lam": "--lam", "keep": "--keep", "freeze_decoder": "--freeze-decoder", "beta": "--beta",
    "gamma": "gamma", "zeta": "zeta", "init_log_alpha": "--init-log-alpha", "gate_lr": "--gate-lr",
    "multiplier_lr": "--multiplier-lr", "budget_warmup": "--budget-warmup", "loss": "--loss",
}
_RUN_DATA = {
    "model_fingerprint": "the model's weights (SHA-256)",
    "train_data_sha256": "the training pairs (SHA-256 of --train-src/--train-tgt or --train-text after --limit)",
    "dev_data_sha256": "the development pairs (SHA-256 of --dev-src/--dev-tgt after --dev-sentences)",
}


def _check_same_run(out_dir: Path, config: PruneConfig) -> None:
    """Refuse, before anything is written, a resume whose options or data differ from those the run
    in ``out_dir`` started with (its prune_config.json); a value that file does not record is not compared."""
    path = out_dir / CONFIG_FILE
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadlabError(f"--resume: {path} is not readable ({error}); start again with --overwrite") from None
    if not isinstance(recorded, dict):
        raise HeadlabError(f"--resume: {path} is not a pruning run's options; start again with --overwrite")
    now = json.loads(json.dumps(config.to_dict()))  # as the file holds it
    changed = []
    for key, flag in _RUN_DEFINING.items():
        if key == "lam" and recorded.get("keep") is not None and now["keep"] is not None:
            continue  # a budget ignores lambda
        if key in recorded and recorded[key] != now[key]:
            changed.append(f"{flag} {recorded[key]} (now {now[key]})")
    for key, what in _RUN_DATA.items():
        if recorded.get(key) and now[key] and recorded[key] != now[key]:
            changed.append(f"{what} {recorded[key][:12]} (now {now[key][:12]})")
    if changed:
        raise HeadlabError(
            f"--resume: the run in {out_dir} was started with other options or data: {'; '.join(changed)}. A resumed "
            "run goes on from its checkpoint, so it would mix two trainings under one record; resume with the same "
            "options and data, or start again with --overwrite")


def _dev_curve(model, tokenizer, dev_data, out_dir: Path, config: PruneConfig, gates: HardConcreteGates, accelerator,
               log: Callable[[str], None]) -> DevCurve | None:
    """The development curve (with development data), its starting point evaluated."""
    if dev_data is None:
        return None
    dev = DevCurve(dev_data, out_dir, config.dev_every, tokenizer=tokenizer, open_heads=gates.open_per_kind,
                   batch_size=config.eval_batch_size, log=log, budget_tie=gates.budget_tie)
    if accelerator.is_main_process and not dev.done(0):
        dev.evaluate(model, 0)  # the starting point (on resume, train() loads the later weights)
    return dev


class _GateHooks:
    """The trainer's hooks of a gated run: which parameters train, the gates' and the budget's
    own learning rates, and the diagnostics and development-curve callbacks."""

    def __init__(self, config: PruneConfig, gates: HardConcreteGates, frozen: set[int], diagnostics: _Diagnostics,
                 dev: DevCurve | None) -> None:
        self.config, self.frozen, self.diagnostics, self.dev = config, frozen, diagnostics, dev
        self.gate_ids = {id(p) for p in gates.log_alpha.parameters()}
        self.budget_ids = ({id(p) for p in cast(torch.nn.Module, gates.budget).parameters()} if config.keep is not None
                           else set())

    def callback_every(self) -> int:
        periods = [n for n in (self.config.log_every, self.config.dev_every) if n > 0]
        return math.gcd(*periods) if periods else 0

    def callback(self, model, step: int, info: dict) -> None:
        if self.config.log_every > 0 and step % self.config.log_every == 0:
            self.diagnostics.callback(model, step, info)
        if self.dev is not None:
            self.dev.callback(model, step, info)

    def trainable(self, name: str, parameter) -> bool:
        # Parameters the model itself freezes stay frozen (train() also freezes those it never saves,
        # e.g. Marian's sinusoidal positions, which from_pretrained leaves trainable).
        return parameter.requires_grad and id(parameter) not in self.frozen

    def optimizer(self, params, cfg: TrainConfig):
        gate_ids, budget_ids = self.gate_ids, self.budget_ids
        groups = [
            {"params": [p for p in params if id(p) not in gate_ids | budget_ids], "lr_scale": 1.0},
            {"params": [p for p in params if id(p) in gate_ids], "lr_scale": self.config.gate_lr / cfg.lr},
            {"params": [p for p in params if id(p) in budget_ids], "lr_scale": self.config.multiplier_lr / cfg.lr},
        ]
        groups = [g for g in groups if g["params"]]
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cast(tuple[float, float], tuple(cfg.adam_betas)),
                                eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def _export(model, tokenizer, eval_data, config: PruneConfig, gates: HardConcreteGates, spec, final: dict,
            outcome: PruneResult, dev: DevCurve | None, loss_kind: str, compute_loss: Callable,
            log: Callable[[str], None]) -> None:
    """The main process's end of a run: the last development point, ``gates.json``, the pruned
    model with its card, its evaluation, and ``result.json`` (written last)."""
    out_dir = Path(outcome.out_dir)
    if dev is not None and not dev.done(outcome.step):
        dev.evaluate(model, outcome.step)  # test-time gates: the model about to be exported
    gates.p_open_scores(getattr(model.config, "name_or_path", ""), model).save(out_dir / "gates.json")
    pruned_dir = out_dir / "pruned"
    sizes = export_pruned(model, spec, pruned_dir, tokenizer)
    outcome.pruned_dir = str(pruned_dir)
    outcome.heads_kept = {kind: n for kind, n in heads_per_kind(model).items()}
    metrics = {"expected_l0": final["expected_l0"], "polarized": final["polarized"],
               "deterministic_open": sum(final["heads_open"].values()), **sizes}
    metrics.update(evaluate_point(model, tokenizer, eval_data, config, loss_kind=loss_kind,
                                  compute_loss=compute_loss, hypotheses_file=out_dir / HYPOTHESES_FILE))
    outcome.metrics = metrics
    record = outcome.to_dict()
    # a budget point has no fixed lambda (its multipliers are learnt): null, as in the trajectory
    record.update(lam=config.lam if config.keep is None else None, keep=config.keep, gates=config.gates, command=config.command,
                  model_sha256=config.model_fingerprint or None)
    tie = gates.budget_tie()
    if tie is not None:  # the exported heads were chosen by position among tied gates: said, never silent
        record["tied_at_cut"] = tie
        log(f"warning: {tie_note(tie)}: the exported heads at the cut are arbitrary among them; train longer")
    if dev is not None:
        record["dev"] = dev.summary()
        flat = record["dev"]["plateau"]
        if flat is not None:
            log(f"dev BLEU from step {flat['from_step']} to {flat['to_step']}: {flat['delta']:+.2f} "
                f"[{flat['low']:+.2f}, {flat['high']:+.2f}] ({flat['call']})")
    from headlab.portable import how_to_load
    from headlab.surgery import PRUNING_FILE

    portable = json.loads((pruned_dir / PRUNING_FILE).read_text(encoding="utf-8")).get("portable") or {}
    atomic_write_text(pruned_dir / "README.md", model_card(record, config, how_to_load(model, portable)))
    write_json(out_dir / RESULT_FILE, record, indent=2)
    if final.get("hint"):
        log("hint: " + final["hint"])
    heads_total = outcome.heads_total
    log(f"kept {sum(outcome.heads_kept.values())} of {counted(sum(heads_total.values()), 'head')} "
        f"({', '.join(f'{k} {v}/{heads_total[k]}' for k, v in outcome.heads_kept.items())}); saved to {pruned_dir}")
