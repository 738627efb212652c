"""Sweep transformers' model types: the default statistics engine equals the eager reference (session 38).

``headlab functions`` / ``aggregate`` / ``analyze`` compute their statistics with the fused engine by default
(issue 34), from headlab's own attention function (``headlab.attention.attention_forward``, which reimplements the
scaling, masks, soft-capping, position biases, sinks and selected keys a family hands the attention interface), not
from the model's eager attention. experiments/family_sweep.py checks capture (the model's eager maps) on every type,
and tests/test_fused_statistics.py the fused engine on the test matrix only; this sweep checks, on every type the family
sweep builds (its tiny builder, float64 where the model runs in it), that ``analyze_heads(engine="fused")`` writes
what ``engine="eager"`` writes: a word-level tokenizer (every word one token: the fused word passes run) over the
sample treebank (block-sparse BigBird's and BigBird-Pegasus's: sentences of its words long enough for block-sparse
attention, support.big_bird.long_treebank), counts, offsets and decisions identical, floats within 1e-8 (relative
1e-6). Where they are not, the rule in :func:`_check` decides: the fused engine must equal headlab's chunked path
exactly and eager's floats to 1e-4 relative (most models' eager softmax runs in float32 whatever their dtype: its near
ties round otherwise).

Outcomes: ``equal``; ``DIFFER`` (a silent wrong result of the default engine: the first file and value that differ);
``refused`` (the fused engine, the eager reference (session 46: ProphetNet's padded batches were ``skipped``) or the
blocks refused it, with the reason); ``CRASH``; ``skipped`` (not built, or no analysable block: family_sweep's outcome).
``--attn-implementation`` (session 46): the models built with that implementation, family_sweep's rule
(:func:`family_sweep.implementation_for`).

    cd <checkout> && PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python experiments/fused_sweep.py [--multimodal | --causal-first] [--only TYPE ...] [--timeout 60] \\
        [--set NAME=VALUE ...] [--attn-implementation {sdpa,eager,flex_attention}]
"""

from __future__ import annotations

import logging
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import family_sweep as sweep  # noqa: E402 - beside this script

from headlab import HeadlabError, attention_blocks  # noqa: E402
from headlab.adapters.big_bird import block_sparse_probe  # noqa: E402
from headlab.data.frequencies import TokenFrequencies  # noqa: E402
from headlab.functions import AnalysisConfig, analyze_heads  # noqa: E402


def _analyse(model, tokenizer, path: Path, engine: str):
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine,
                            query_chunk=None if engine == "eager" else 3, sensitivity=True)
    target = path if getattr(model.config, "is_encoder_decoder", False) else None
    return analyze_heads(model, tokenizer, path, target_conllu=target, config=config,
                         frequencies=TokenFrequencies(counts, "hand-set"))


def _differences(a, b, path: str, rtol: float, atol: float, decisions: bool = True):
    """The places where ``a`` and ``b`` (parsed result files) differ: floats beyond ``atol + rtol |b|``, and (with
    ``decisions``) anything else that is not equal (counts, offsets, which sentence or query an exemplar is)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            yield f"{path}: keys {sorted(set(a) ^ set(b))[:3]}"
            return
        for key in a:
            yield from _differences(a[key], b[key], f"{path}/{key}", rtol, atol, decisions)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: {len(a)} entries, the other {len(b)}"
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _differences(x, y, f"{path}/{i}", rtol, atol, decisions)
    elif isinstance(a, float) and isinstance(b, float):
        if not ((np.isnan(a) and np.isnan(b)) or abs(a - b) <= atol + rtol * abs(b)):
            yield f"{path}: {a!r}, the other {b!r}"
    elif decisions and a != b and not path.endswith("/signature/dtype"):
        yield f"{path}: {a!r}, the other {b!r}"


def check(model_type: str, config_class) -> tuple[str, str]:
    cls = sweep.model_class(config_class)
    if cls is None:
        return "", ""
    if model_type in sweep.SKIPPED:
        return "skipped", sweep.SKIPPED[model_type][:120]
    try:
        return _check(config_class, cls, torch.float64)
    except _EagerFailed:  # the reference does not run in float64 (FSMT's, XGLM's masks overflow float32): float32
        try:
            return _check(config_class, cls, torch.float32)
        except _EagerFailed as error:
            return "skipped", f"eager engine: {error}"


class _EagerFailed(Exception):
    """The eager engine, the reference, does not run on this model: not this check's finding."""


def _built_with(config_class, cls, dtype: torch.dtype):
    """(the model built with ``--attn-implementation``, "") or (None, why not: family_sweep.implementation_for's
    reasons); a forward that fails in float64 retries in float32 (:class:`_EagerFailed`)."""
    eager, why = sweep.build(config_class, cls, "eager", dtype)
    if eager is None:
        return None, f"build: {why[:120]}"
    implementation, why = sweep.implementation_for(config_class, cls, eager, dtype, sweep.inputs_for(eager))
    if implementation is None:
        if dtype == torch.float64 and "forward fails" in why and not why.startswith(sweep.REFUSED_FIRST):
            raise _EagerFailed(why)
        return None, why[:200]
    return sweep.build(config_class, cls, implementation, dtype)


def _check(config_class, cls, dtype: torch.dtype) -> tuple[str, str]:
    from test_chunked_statistics import _written
    from test_fused_statistics import word_tokenizer

    if sweep.ATTN_IMPLEMENTATION is not None:  # --attn-implementation: that one, or skipped (family_sweep's rule)
        model, why = _built_with(config_class, cls, dtype)
        if model is None:
            return ("refused" if why.startswith(sweep.REFUSED_FIRST) else "skipped"), why
    else:
        model, why = sweep.build(config_class, cls, "sdpa", dtype) if cls._supports_sdpa else (None, "")
    if model is None:  # a sub-model without SDPA (Gemma 4's audio tower): eager, as family_sweep falls back
        model, why = sweep.build(config_class, cls, "eager", dtype)
    if model is None:
        return "skipped", f"build: {why[:120]}"
    model = sweep.as_analysed(model)  # MiniCPM-V's language model, as load_model gives it
    for module in model.modules():  # the experts' grouped matmuls take no float64: their eager loop does
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    tokenizer = word_tokenizer()
    try:
        live = [b for b in attention_blocks(model) if not b.idle]
    except HeadlabError as error:
        if dtype == torch.float64:  # converted whole, Inkling2's forward fails (a float32 product): float32
            raise _EagerFailed(str(error)) from error
        return "skipped", f"blocks refused: {str(error).splitlines()[0][:120]}"
    if not live:
        return "skipped", "no block runs on token ids"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = directory / "tb.conllu"
        from support.treebank import SAMPLE_CONLLU

        path.write_text(SAMPLE_CONLLU, encoding="utf-8")
        if (sparse := block_sparse_probe(model)) is not None:  # block-sparse BigBird refuses the sample's short
            # sentences (transformers would swap its attention for full attention): sentences of its probe's length
            from support.big_bird import long_treebank

            long_treebank(path, words=sparse[0] - 2)
        try:
            eager = _analyse(model, tokenizer, path, "eager")
        except HeadlabError as error:  # refused before any work (ProphetNet's padded batch, Doge under flex); in
            # float64 first tried in float32 (ModernVBERT's float64 mask is NaN in eager's float32 softmax)
            if dtype == torch.float64:
                raise _EagerFailed(f"HeadlabError: {str(error).splitlines()[0][:120]}") from error
            return "refused", f"eager engine: {str(error).splitlines()[0][:200]}"
        except Exception as error:  # noqa: BLE001 - the reference itself does not run: not this check's finding
            raise _EagerFailed(f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}") \
                from error
        try:
            fused = _analyse(model, tokenizer, path, "fused")
        except HeadlabError as error:
            return "refused", str(error).splitlines()[0][:200]
        except Exception as error:  # noqa: BLE001
            frame = traceback.extract_tb(error.__traceback__)[-1]
            return "CRASH", f"{type(error).__name__}: {str(error).splitlines()[0][:150] if str(error) else ''} " \
                            f"({Path(frame.filename).name}:{frame.lineno})"
        expected = _written(eager.results.values(), directory / "eager")
        got = _written(fused.results.values(), directory / "fused")
        if next(_differences(got, expected, "", 1e-6, 1e-8), None) is None:
            chunked = sorted(fused.report.chunked_statistics)
            return "equal", f"{len(got)} files" + (f"; chunked path: {', '.join(chunked)}" if chunked else "")
        # the rule for what differs from eager (written before the run): headlab's two paths from its own attention
        # function, fused and chunked, must agree exactly (floats to 1e-8, every decision), and every float must agree
        # with eager to 1e-4 relative (an eager softmax in float32 rounds at 6e-8, a wrong map shows at 1e-2);
        # decisions that differ from eager's then are near ties eager's float32 rounding breaks otherwise, counted
        reference = _written(_analyse(model, tokenizer, path, "chunked").results.values(), directory / "chunked")
    own = next(_differences(got, reference, "", 0.0, 1e-8), None)
    if own is not None:
        return "DIFFER", f"{str(dtype).removeprefix('torch.')}: fused against chunked: {own[:230]}"
    floats = next(_differences(got, expected, "", 1e-4, 1e-8, decisions=False), None)
    if floats is not None:
        return "DIFFER", f"{str(dtype).removeprefix('torch.')}: against eager: {floats[:230]}"
    ties = sum(1 for _ in _differences(got, expected, "", 1e-4, 1e-8))
    return "equal", f"{len(got)} files; fused = chunked, floats within 1e-4 of eager, {ties} decision(s) of eager's " \
                    "near ties broken otherwise by its float32 rounding"


def main() -> None:
    parser = sweep.arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=int, default=60, help="seconds per type")
    parser.add_argument("--multimodal", action="store_true", help="the image-text-to-text wrappers (family_sweep's)")
    parser.add_argument("--causal-first", action="store_true",
                        help="the causal-LM class of a type that has several (family_sweep's)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a config attribute every build sets, as variant_sweep's variants do (a string value: "
                             "--set encoder_attention_type=transient-global builds LongT5's transient-global encoder)")
    sweep.implementation_argument(parser)
    args = parser.parse_args()
    sweep.MULTIMODAL, sweep.CAUSAL_FIRST = args.multimodal, args.causal_first
    sweep.ATTN_IMPLEMENTATION = args.attn_implementation
    for setting in args.set:
        name, _, value = setting.partition("=")
        sweep.VARIANT[name] = value
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sweep.run_types(check, only=args.only, timeout=args.timeout)


if __name__ == "__main__":
    main()
