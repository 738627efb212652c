"""What LRP has no rule for between layers: several residual streams mixed by weights computed from them.

Hyper-connections (Zhu et al. 2024, "Hyper-Connections", arXiv:2409.19606) keep ``n`` residual streams; each layer
reads a mix of them and writes its output back into each, with weights a small network computes from the streams
themselves. transformers 5.24's (read off the modeling files): HY-V4's ``HYV4HyperConnection`` (``pre``, ``post`` =
``sigmoid(F.linear(streams, fn) * rsqrt(mean(streams^2)) * scale + base)``, forced to float32) and ``HYV4HyperHead``
(the last mix), DeepSeek-V4's and GLM-5-Next's alike, Qwen4-Exp's ``Qwen4ExpTextGatedResidual`` (mix and injection
weights from a low-rank projection of the normed streams). Qwen4-Exp's PLE layers (``Qwen4ExpTextPLELayer``) add to
the streams hashed n-gram embeddings gated by a product with the streams and passed through a dilated convolution.

The forwards compute those weights inside the module and apply them at once, so gradient x input differentiates
through the weights too and relevance is not conserved. HY-V4's (and HY-V4-VL's) and Qwen4-Exp's, and Qwen4-Exp's
n-gram injections, have a rule since session 37 (:mod:`headlab.importance.mixer_rules.hyper_connection`), and are not
refused here, nor GLM-5-Next's (since session 38) and DeepSeek-V4's (since session 40); for any other class (refused
by that rule, naming the class) or n-gram injection headlab has no hook that holds its weights
constant (as it holds the attention weights and gates). LRP is refused before any work, naming them;
every other measure reads the attention blocks, which the streams do not touch (a head's output reaches them through
the output projection only). The indexers of these families (DSA, QSA) need no rule: they return a key selection
(indices under ``no_grad``, a boolean mask) folded into the attention mask, which no gradient crosses.
"""

from __future__ import annotations

from torch import nn


def _is_ngram_injection(module: nn.Module) -> bool:
    """Qwen4-Exp's PLE layer: a hashed n-gram embedding (``ple_embedding``) added to the residual streams."""
    return isinstance(getattr(module, "ple_embedding", None), nn.Module)


def _is_hyper_connection(module: nn.Module) -> bool:
    """A hyper-connection (or the final mix of its streams): its stream count as ``hc_mult`` (HY-V4, DeepSeek-V4,
    GLM-5-Next) or ``hc_count`` (Qwen4-Exp), weights of its own beside it."""
    count = next((getattr(module, name) for name in ("hc_mult", "hc_count") if hasattr(module, name)), None)
    return isinstance(count, int) and count > 1 and any(True for _ in module.parameters(recurse=True)) \
        and not _is_ngram_injection(module)


def residual_stream_problem(model: nn.Module) -> str | None:
    """Why LRP cannot explain ``model``'s residual streams (None: nothing of the kind), naming the modules."""
    found: dict[str, dict[str, list[str]]] = {"hyper": {}, "ngram": {}}
    from headlab.importance import mixer_rules

    for path, module in model.named_modules():
        kind = "ngram" if _is_ngram_injection(module) else "hyper" if _is_hyper_connection(module) else None
        if kind and mixer_rules.rule_for(module) is not None:  # HY-V4's, Qwen4-Exp's: mixer_rules/hyper_connection.py
            continue
        if kind:
            found[kind].setdefault(type(module).__name__, []).append(path)

    def listed(classes: dict[str, list[str]]) -> str:
        return "; ".join(f"{name} at {paths[0]}" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")
                         for name, paths in classes.items())

    parts = []
    if found["hyper"]:
        parts.append(f"hyper-connections ({listed(found['hyper'])}): several residual streams mixed into each layer's "
                     "input and its output injected back with weights computed from the streams themselves, inside "
                     "the module, which headlab has no rule to hold constant")
    if found["ngram"]:
        parts.append(f"hashed n-gram embeddings added to the residual streams ({listed(found['ngram'])}), gated by "
                     "the streams and convolved, for which headlab has no rule")
    if not parts:
        return None
    return (f"LRP: no rule for this model's {'; nor for its '.join(parts)}; so relevance would not be conserved: the "
            "other measures work on its attention blocks")
