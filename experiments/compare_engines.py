"""The statistics engines compared value by value, and the pre-registered verdict on the kernel.

Issue 34: ``functions`` + ``aggregate`` (and confidence importance) run under each engine
(``--engines``: eager, chunked, fused, kernel) on the same random model (the Llama shapes of
``benchmarks/bench_chunked_attention.py``, the same weights in every dtype: built in the
lowest-precision dtype asked for, then cast up exactly), the same generated treebanks (one long
sentence per ``--lengths`` value, batch 1, and ``--short`` EWT-like sentences of 3 to 40 words in
padded batches of ``--short-batch``) and each dtype of ``--dtypes``. The reference is the eager
engine in ``--reference-dtype`` (float64 by default) on the same weights. Every value of every
file the results write is compared with the reference's, and every per-query decision the
statistics read (each row's largest weight on a word token and on a word: positional, syntactic,
rare-token heads) is recorded on both sides and compared; exemplar choices are compared per head.

Near ties (the rule of experiments/kernel_default.md): a decision that differs from the
reference's is a near tie when the reference itself gives the engine's choice a weight within
``TIE[dtype]`` (relative) of its own largest: ``p_ref[engine's key] >= (1 - tau) p_ref[reference's
key]`` (looked up among the reference's 8 largest eligible weights of the row; a key beyond them is
not a near tie). An exemplar the engine keeps and the reference does not is a near tie when the
engine's weight for it is at most ``(1 + tau)`` times the reference's smallest kept weight of
that head.

The verdict (:func:`verdict`, exit code): 0 the kernel may become the default on CUDA (every check
of the rule passes, the bfloat16, float32 and speed checks among them); 1 a check fails (which,
printed and in the JSON); 3 every check that ran passes but the kernel decision needs what this run
did not have (a CUDA GPU, bfloat16, the kernel engine, the timing); 2 bad options.

    # CPU, here: the CPU engines' agreement (the kernel in Triton's interpreter with TRITON_INTERPRET=1)
    PYTHONPATH=src python experiments/compare_engines.py --shape small --layers 2 --lengths 256 \\
        --dtypes float32 float64 --engines eager chunked fused --json /tmp/compare.json
    # a CUDA GPU (experiments/device.sh compare-engines): the verdict
    python experiments/compare_engines.py --device cuda --shape llama3-8b --layers 4 --lengths 4096 --short 48 \\
        --short-batch 16 --dtypes bfloat16 float32 --engines eager chunked fused kernel --time --json compare-engines.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_chunked_attention as bench  # noqa: E402  (its random Llama builder and CoNLL-U writer)

ENGINES = ("eager", "chunked", "fused", "kernel")
DTYPES = ("bfloat16", "float16", "float32", "float64")
PRECISION = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}

# -- the rule (experiments/kernel_default.md; written before any GPU run of this script) ----------
TIE = {"bfloat16": 2.0 ** -5, "float16": 2.0 ** -8, "float32": 1e-5, "float64": 1e-6}
"""Near-tie margin per dtype of the engine: relative weight gap in the reference. float64: the
reference's own resolution, not float64's: transformers' eager Llama attention takes its softmax in
float32 whatever the model's dtype, so the reference's weights are float32-rounded (2^-24 relative)."""
EXACT = {"float32": 1e-5, "float64": 1e-6}
"""Sums and means of an engine in these dtypes: largest |difference| over the file, relative to the
file's largest reference value, at most this (float64: the eager reference's float32 softmax again;
measured up to 1.3e-7 on the CPU, docs/benchmarks.md; float64 to 1e-8 against a float64 eager softmax is
what tests/test_fused_statistics.py checks on the tiny families)."""
NON_INFERIORITY = (1.5, 2.0 ** -10)
"""bfloat16: the kernel's relative error of each file at most 1.5x the fused engine's + 2^-10."""
DECISION_SLACK = (1.5, 1e-3)
"""bfloat16: the kernel's differing decisions at most 1.5x the fused engine's + 0.1% of those compared,
and its differences that are not near ties at most 1.5x the fused engine's (none where it has none)."""
TOP = 8
"""Eligible weights of each reference row kept for the near-tie look-up."""

DECISION_FILES = ("positional/", "syntactic/", "rare_tokens/", "aggregate/exemplars.json")
"""Files made of decisions (shares of argmax tests, offsets, chosen exemplars): their value
differences are reported, judged by the per-query decisions behind them. Every other file (the
aggregate's sums and means, confidence) is judged by its values."""


# -- the model and the data --------------------------------------------------------------------------
def bench_args(args, dtype: str):
    """The namespace bench_chunked_attention.model_and_tokenizer reads."""
    return argparse.Namespace(shape=args.shape, device=args.device, dtype=dtype, layers=args.layers, heads=None,
                              kv_heads=None, d_model=None, ffn=None, vocab=None)


class Models:
    """The model in each dtype with the same weights: built once in the lowest precision, each other
    dtype a copy cast up (exact), made when asked for and dropped after (on a GPU the float64 copy of
    Llama-3-8B's shape is 15 GB beside the eager reference's maps)."""

    def __init__(self, args, dtypes: list[str]):
        self.low = min(dtypes, key=PRECISION.__getitem__)
        longest = max(args.lengths + [42] + ([args.time_length] if args.time else []))
        self.base, self.tokenizer = bench.model_and_tokenizer(bench_args(args, self.low), longest)

    @contextlib.contextmanager
    def cast(self, dtype: str):
        import torch

        if dtype == self.low:
            yield self.base
            return
        model = copy.deepcopy(self.base).to(getattr(torch, dtype))
        try:
            yield model
        finally:
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def treebanks(args, directory: Path, vocab: int) -> list[dict]:
    """The long sentences (one per length, batch 1) and the short ones (padded batches)."""
    import random

    banks = []
    for length in args.lengths:
        path = directory / f"long-{length}.conllu"
        bench.write_conllu(path, length, 1, vocab, seed=length)
        banks.append({"name": f"long-{length}", "path": path, "batch_size": 1, "tokens": length})
    if args.short:
        rng = random.Random(7)
        parts, tokens = [], 0
        for i in range(args.short):
            n = rng.randint(3, 40)
            tokens += n
            one = directory / "one.conllu"
            bench.write_conllu(one, n, 1, vocab, seed=1000 + i)
            parts.append(one.read_text(encoding="utf-8").replace("# sent_id = s0", f"# sent_id = short{i}"))
        path = directory / "short.conllu"
        path.write_text("".join(parts), encoding="utf-8")
        banks.append({"name": "short", "path": path, "batch_size": args.short_batch, "tokens": tokens})
    return banks


# -- the decisions every statistic reads, recorded ------------------------------------------------
class Recorder:
    """Records what ``AttentionView.token_argmax`` / ``word_argmax`` return to the statistics, per
    block, batch and level, in every engine's views (eager, chunked, fused, kernel); for the
    reference also each row's validity and its :data:`TOP` largest eligible weights."""

    def __init__(self, reference: bool):
        self.reference = reference
        self.chunks: dict = {}  # (kind, layer, level) -> [ {start: (argmax, valid, topv, topi)} per batch ]

    def record(self, view, level: str, argmax) -> None:
        import torch

        flag = f"_compare_engines_{level}"
        if view.__dict__.get(flag):
            return
        view.__dict__[flag] = True
        start = view.start if level == "token" else view.word_start
        if argmax.shape[2] == 0:
            return
        batches = self.chunks.setdefault((view.block.kind, view.block.layer, level), [])
        if start == 0 or not batches:
            batches.append({})
        extra: tuple = (None, None, None)
        if self.reference:
            if level == "token":
                weights, keep, valid = view.probs, view.side.token_mask[:, :view.keys], view.token_query_valid
            else:
                weights = view.words
                keep, valid = view.side.word_mask[:, :weights.shape[3]], view.query_valid
            tops = []
            for rows in range(0, weights.shape[2], 512):  # slices: no second copy of a 4k x 4k map
                eligible = weights[:, :, rows:rows + 512].masked_fill(~keep[:, None, None, :], -1.0)
                tops.append(eligible.topk(min(TOP, eligible.shape[3]), dim=-1))
            topv, topi = torch.cat([v for v, _ in tops], 2), torch.cat([i for _, i in tops], 2)
            extra = (valid.cpu(), topv.double().cpu(), topi.cpu())
        batches[-1][start] = (argmax.to(torch.long).cpu(), *extra)

    def assembled(self) -> dict:
        """``{(kind, layer, level): [per batch: (argmax, valid, topv, topi) over all rows]}``."""
        import torch

        out: dict = {}
        for key, batches in self.chunks.items():
            out[key] = []
            for chunks in batches:
                parts = [chunks[start] for start in sorted(chunks)]
                out[key].append(tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts], 2)
                                      for i in range(4)))
        return out


@contextlib.contextmanager
def recording(recorder: Recorder | None):
    from headlab.data.alignment import AttentionView

    if recorder is None:
        yield
        return
    saved = {name: getattr(AttentionView, name) for name in ("token_argmax", "word_argmax")}

    def wrap(name: str, level: str):
        original = saved[name].fget

        def getter(view):
            value = original(view)
            recorder.record(view, level, value)
            return value
        return property(getter, doc=saved[name].__doc__)

    for name, level in (("token_argmax", "token"), ("word_argmax", "word")):
        setattr(AttentionView, name, wrap(name, level))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(AttentionView, name, value)


def compare_decisions(engine: dict, reference: dict, tau: float) -> dict:
    """Per level: decisions compared (rows valid in the reference and recorded on both sides),
    differing, of those near ties (the module docstring's rule), and the largest relative gap
    ``1 - p_ref[engine's key] / p_ref[reference's key]`` of a differing decision whose key is among the
    reference's :data:`TOP` (how close the near ties came to ``tau``)."""
    import torch

    out: dict = {}
    for key, ref_batches in reference.items():
        level = key[2]
        total = out.setdefault(level, {"compared": 0, "differing": 0, "near_ties": 0, "missing_batches": 0,
                                       "largest_gap": 0.0})
        got_batches = engine.get(key, [])
        for i, (ref_arg, valid, topv, topi) in enumerate(ref_batches):
            if i >= len(got_batches):
                total["missing_batches"] += 1
                continue
            arg = got_batches[i][0]
            rows = min(arg.shape[2], ref_arg.shape[2])
            arg, ref_arg, valid, topv, topi = (t[:, :, :rows] for t in (arg, ref_arg, valid, topv, topi))
            differ = valid & (arg != ref_arg)
            hit = topi == arg[..., None]
            engine_weight = torch.where(hit, topv, torch.full_like(topv, -math.inf)).amax(-1)
            reference_weight = topv[..., 0]  # the row's largest eligible weight: the reference's choice's
            tie = differ & hit.any(-1) & (engine_weight >= (1 - tau) * reference_weight)
            total["compared"] += int(valid.sum())
            total["differing"] += int(differ.sum())
            total["near_ties"] += int(tie.sum())
            gaps = 1 - engine_weight / reference_weight.clamp(min=1e-300)
            found = differ & hit.any(-1)
            if bool(found.any()):
                total["largest_gap"] = max(total["largest_gap"], float(gaps[found].max()))
    return out


# -- the files ------------------------------------------------------------------------------------
def written(results, directory: Path) -> dict:
    """Every JSON file the results write, parsed: ``{relative path: JSON}``."""
    for result in results:
        result.write(directory)
    return {str(p.relative_to(directory)): json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(directory.rglob("*.json"))}


def _leaves(value, path=""):
    if isinstance(value, dict):
        for key in value:
            yield from _leaves(value[key], f"{path}/{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}/{i}")
    else:
        yield path, value


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def compare_values(got: dict, expected: dict) -> dict:
    """One file's values: how many, how many differ, largest |difference| of the numbers, the same
    relative to the file's largest |reference value|, and the leaves that are not comparable
    numbers yet differ (structure, strings, a null against a number, anything in the signature: the
    data's counts, the options)."""
    a, b = dict(_leaves(got)), dict(_leaves(expected))
    scale = max((abs(v) for path, v in b.items()
                 if _is_number(v) and math.isfinite(v) and not path.startswith("/signature/")), default=0.0)
    differing, n_mismatched, largest = 0, 0, 0.0
    mismatched: list = []
    for path in sorted(set(a) | set(b)):
        x, y = a.get(path, "<missing>"), b.get(path, "<missing>")
        if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
            continue
        differing += 1
        if _is_number(x) and _is_number(y) and not path.startswith("/signature/"):
            largest = max(largest, abs(x - y))
        else:
            n_mismatched += 1
            if len(mismatched) < 5:
                mismatched.append([path, x, y])
    return {"values": len(b), "differing": differing, "max_abs": largest,
            "max_rel": largest / scale if scale > 0 else largest, "n_mismatched": n_mismatched,
            "mismatched": mismatched}


def compare_exemplars(got: dict, expected: dict, tau: float) -> dict:
    """Exemplar choices per head: kept by the engine and not the reference, and of those near ties."""
    out = {"compared": 0, "differing": 0, "near_ties": 0}
    for head, lists in expected.items():
        for i, ref_items in enumerate(lists):
            items = got.get(head, [[]] * len(lists))[i] if i < len(got.get(head, [])) else []
            key = lambda item: (item["sentence"], item["query"], item["key"])  # noqa: E731
            chosen = {key(item) for item in ref_items}
            cutoff = min((item["weight"] for item in ref_items), default=0.0)
            out["compared"] += len(ref_items)
            for item in items:
                if key(item) not in chosen:
                    out["differing"] += 1
                    out["near_ties"] += int(item["weight"] <= (1 + tau) * cutoff)
    return out


def is_decision_file(name: str) -> bool:
    return any(name.startswith(prefix) for prefix in DECISION_FILES)


# -- the runs -------------------------------------------------------------------------------------
def analyse(model, tokenizer, bank: dict, engine: str, frequencies, query_chunk: int | None):
    from headlab.functions import AnalysisConfig, analyze_heads

    config = AnalysisConfig(functions=True, aggregate=True, batch_size=bank["batch_size"], top_frequent=50,
                            engine=engine, query_chunk=None if engine == "eager" else query_chunk)
    return analyze_heads(model, tokenizer, bank["path"], frequencies=frequencies, config=config)


def confidence(model, tokenizer, banks: list[dict], engine: str):
    """Confidence (Voita et al. 2019) over the treebanks' sentences, batch 1 for the long ones."""
    import numpy as np

    from headlab.data.treebank import read_conllu
    from headlab.importance import ImportanceData, compute_confidence, describe_model

    info = describe_model(model)
    engine = "fused" if engine == "chunked" else engine  # confidence: one streaming path for both
    scores = {}
    for bank in banks:
        ids = [tokenizer(" ".join(s.words))["input_ids"] for s in read_conllu(bank["path"]) if s is not None]
        got = compute_confidence(model, ImportanceData.from_ids(ids), info, batch_size=bank["batch_size"],
                                 engine=engine)
        scores[bank["name"]] = {kind: np.asarray(got[kind]).tolist() for kind in got.kinds}
        if got.signature.get("kernel_fallback"):
            scores[bank["name"]]["kernel_fallback"] = got.signature["kernel_fallback"]
    return scores


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args) -> dict:
    import numpy as np
    import torch

    from headlab.data.frequencies import TokenFrequencies

    torch.set_num_threads(args.threads)
    dtypes = list(dict.fromkeys(args.dtypes))
    built = Models(args, dtypes + [args.reference_dtype])
    tokenizer = built.tokenizer
    vocab = bench.model_fields(bench_args(args, dtypes[0]))["vocab_size"]
    frequencies = TokenFrequencies(np.random.default_rng(0).integers(1, 1000, vocab), "random")
    summary: dict = {"setup": {key: value for key, value in vars(args).items() if key != "json"},
                     "model": bench.model_fields(bench_args(args, dtypes[0])), "treebanks": [], "runs": [],
                     "rule": rule_text()}
    if args.device.startswith("cuda"):
        summary["setup"]["gpu"] = torch.cuda.get_device_name()
    summary["setup"].update(torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        banks = treebanks(args, work, vocab)
        summary["treebanks"] = [{k: str(v) if isinstance(v, Path) else v for k, v in b.items()} for b in banks]
        timing = None
        if args.time:  # the speed condition's sentence (docs/benchmarks.md: the kernel is faster from 16k tokens)
            bench.write_conllu(work / "time.conllu", args.time_length, 1, vocab, seed=args.time_length + 1)
            timing = {"name": f"time-{args.time_length}", "path": work / "time.conllu", "batch_size": 1,
                      "tokens": args.time_length}
        ref_files, ref_decisions = {}, {}
        log(f"reference: eager, {args.reference_dtype}")
        started = time.perf_counter()
        with built.cast(args.reference_dtype) as model:
            for bank in banks:
                recorder = Recorder(reference=True)
                with recording(recorder):
                    analysis = analyse(model, tokenizer, bank, "eager", frequencies, args.query_chunk)
                ref_files[bank["name"]] = written(analysis.results.values(), work / "ref" / bank["name"])
                ref_decisions[bank["name"]] = recorder.assembled()
                del analysis
            ref_confidence = confidence(model, tokenizer, banks, "eager") if args.confidence else {}
        summary["reference_seconds"] = time.perf_counter() - started
        for dtype in dtypes:
            with built.cast(dtype) as model:
                for engine in args.engines:
                    if engine == "eager" and dtype == args.reference_dtype:
                        continue  # the reference itself
                    log(f"{engine}, {dtype}")
                    summary["runs"].append(one_engine(args, model, tokenizer, banks, engine, dtype, frequencies,
                                                      work, ref_files, ref_decisions, ref_confidence))
                    if timing is not None and engine in ("fused", "kernel") and dtype == "bfloat16":
                        summary["runs"][-1]["seconds"] = timed(args, model, tokenizer, timing, engine, frequencies)
                        summary["runs"][-1]["timed_tokens"] = args.time_length
    summary["checks"], summary["verdict"] = verdict(summary["runs"], on_cuda=args.device.startswith("cuda"))
    return summary


def one_engine(args, model, tokenizer, banks, engine, dtype, frequencies, work, ref_files, ref_decisions,
               ref_confidence) -> dict:
    tau = TIE[dtype]
    row: dict = {"engine": engine, "dtype": dtype, "tie_margin": tau, "files": {}, "decisions": {},
                 "exemplars": {"compared": 0, "differing": 0, "near_ties": 0}, "kernel_fallback": {}}
    for bank in banks:
        recorder = Recorder(reference=False)
        with recording(recorder):
            analysis = analyse(model, tokenizer, bank, engine, frequencies, args.query_chunk)
        if getattr(analysis.report, "kernel_fallback", None):
            row["kernel_fallback"][bank["name"]] = analysis.report.kernel_fallback
        files = written(analysis.results.values(), work / f"{engine}-{dtype}" / bank["name"])
        expected = ref_files[bank["name"]]
        for name in sorted(set(files) | set(expected)):
            if name not in files or name not in expected:
                row["files"][f"{bank['name']}/{name}"] = {"missing": "engine" if name not in files else "reference"}
                continue
            row["files"][f"{bank['name']}/{name}"] = compare_values(files[name], expected[name])
            if name == "aggregate/exemplars.json":
                for key, value in compare_exemplars(files[name], expected[name], tau).items():
                    row["exemplars"][key] += value
        for level, counts in compare_decisions(recorder.assembled(), ref_decisions[bank["name"]], tau).items():
            total = row["decisions"].setdefault(level, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                total[key] = max(total[key], value) if key == "largest_gap" else total[key] + value
    if ref_confidence:
        got = confidence(model, tokenizer, banks, engine)
        for bank in banks:
            fallback = got[bank["name"]].pop("kernel_fallback", None)
            if fallback:
                row["kernel_fallback"][f"confidence/{bank['name']}"] = fallback
            row["files"][f"{bank['name']}/importance/confidence"] = compare_values(got[bank["name"]],
                                                                                  ref_confidence[bank["name"]])
    return row


def timed(args, model, tokenizer, bank, engine, frequencies) -> float:
    """Seconds of the analysis of ``bank`` (one sentence of ``--time-length`` words), without the
    recorder, the best of two runs after the compared runs (compiled kernels, cuBLAS warm)."""
    best = math.inf
    for _ in range(2):
        synchronize(args.device)
        started = time.perf_counter()
        analyse(model, tokenizer, bank, engine, frequencies, args.query_chunk)
        synchronize(args.device)
        best = min(best, time.perf_counter() - started)
    return best


# -- the verdict ----------------------------------------------------------------------------------
def rule_text() -> list[str]:
    return [
        f"float64 / float32 engines: every file of sums and means within {EXACT['float64']:g} / "
        f"{EXACT['float32']:g} of the reference (largest |difference| over the file's largest |value|), "
        "structure, counts and strings equal",
        f"float64 / float32 engines: every differing decision a near tie (tau {TIE['float64']:g} / "
        f"{TIE['float32']:g}), exemplars too",
        f"bfloat16 kernel: each file's relative error <= {NON_INFERIORITY[0]:g} x fused's + {NON_INFERIORITY[1]:g}; "
        f"differing decisions <= {DECISION_SLACK[0]:g} x fused's + {DECISION_SLACK[1]:g} x compared, and those "
        f"not near ties (tau {TIE['bfloat16']:g}) <= {DECISION_SLACK[0]:g} x fused's",
        "kernel: no fallback to the fused engine anywhere; on CUDA, in bfloat16 and float32",
        "speed: the kernel's analysis of one --time-length sentence (16,384 words), best of two, no slower than "
        "the fused engine's (bfloat16, CUDA)",
    ]


def _structure_ok(info: dict, name: str) -> str | None:
    if "missing" in info:
        return f"{name}: missing in the {info['missing']}"
    if info["n_mismatched"] and not is_decision_file(name.split("/", 1)[1]):
        return f"{name}: {info['n_mismatched']} values differ beyond numbers, e.g. {info['mismatched'][:1]}"
    return None


def verdict(runs: list[dict], on_cuda: bool) -> tuple[list[dict], dict]:
    """The rule of experiments/kernel_default.md on the runs' comparisons: every check (name, passed,
    detail) and the verdict ``{"kernel_default": "yes" | "no" | "undecided", "exit": 0 | 1 | 3}``."""
    checks: list[dict] = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"check": name, "passed": bool(passed), "detail": detail})

    by = {(r["engine"], r["dtype"]): r for r in runs}
    for r in runs:
        label = f"{r['engine']} {r['dtype']}"
        problems = [p for name, info in r["files"].items() if (p := _structure_ok(info, name))]
        check(f"{label}: files and structure", not problems, "; ".join(problems[:3]) or "all files, same structure")
        if r["dtype"] in EXACT:
            bound = EXACT[r["dtype"]]
            worst = max(((info["max_rel"], name) for name, info in r["files"].items()
                         if "missing" not in info and not is_decision_file(name.split("/", 1)[1])), default=(0.0, "-"))
            check(f"{label}: sums and means within {bound:g}", worst[0] <= bound, f"largest {worst[0]:.3g} ({worst[1]})")
            decisions = list(r["decisions"].values()) + [r["exemplars"]]
            off = sum(d["differing"] - d["near_ties"] for d in decisions)
            unrecorded = sum(d.get("missing_batches", 0) for d in decisions)
            check(f"{label}: decisions differ only at near ties", off == 0 and not unrecorded,
                  f"{sum(d['differing'] for d in decisions)} differ of {sum(d['compared'] for d in decisions)}, "
                  f"{off} not near ties (tau {r['tie_margin']:g})"
                  + (f"; {unrecorded} batches of the reference's decisions not recorded" if unrecorded else ""))
        if r["engine"] == "kernel":
            check(f"{label}: no fallback", not r["kernel_fallback"], json.dumps(r["kernel_fallback"])[:300] or "none")
    kernel16, fused16 = by.get(("kernel", "bfloat16")), by.get(("fused", "bfloat16"))
    if kernel16 and fused16:
        a, m = NON_INFERIORITY
        bad = [f"{name}: kernel {info['max_rel']:.3g} > {a:g} x {fused16['files'][name]['max_rel']:.3g} + {m:g}"
               for name, info in kernel16["files"].items()
               if "missing" not in info and "missing" not in fused16["files"].get(name, {"missing": 1})
               and not is_decision_file(name.split("/", 1)[1])
               and info["max_rel"] > a * fused16["files"][name]["max_rel"] + m]
        check("bfloat16: kernel's sums and means non-inferior to fused's", not bad, "; ".join(bad[:3]) or "every file")
        s, frac = DECISION_SLACK
        for level in sorted(set(kernel16["decisions"]) | {"exemplars"}):
            k = kernel16["exemplars"] if level == "exemplars" else kernel16["decisions"].get(level)
            f = fused16["exemplars"] if level == "exemplars" else fused16["decisions"].get(level)
            if not k or not f:
                check(f"bfloat16 {level} decisions: recorded on both engines", False, "missing")
                continue
            k_off, f_off = k["differing"] - k["near_ties"], f["differing"] - f["near_ties"]
            passed = (k["differing"] <= s * f["differing"] + frac * k["compared"] and k_off <= s * f_off
                      and not k.get("missing_batches"))
            check(f"bfloat16 {level} decisions: kernel non-inferior to fused", passed,
                  f"kernel {k['differing']} differ ({k_off} not near ties), fused {f['differing']} ({f_off}), "
                  f"of {k['compared']}")
        if "seconds" in kernel16 and "seconds" in fused16:
            check("speed: kernel no slower than fused (bfloat16)", kernel16["seconds"] <= fused16["seconds"],
                  f"kernel {kernel16['seconds']:.3f} s, fused {fused16['seconds']:.3f} s "
                  f"({kernel16.get('timed_tokens', '?')} tokens)")
    missing = []
    if not on_cuda:
        missing.append("a CUDA GPU")
    for dtype in ("bfloat16", "float32"):
        for engine in ("kernel", "fused"):
            if (engine, dtype) not in by:
                missing.append(f"{engine} in {dtype}")
    if kernel16 and fused16 and not ("seconds" in kernel16 and "seconds" in fused16):
        missing.append("the timing (--time)")
    if not all(c["passed"] for c in checks):
        return checks, {"kernel_default": "no", "exit": 1}
    if missing:
        return checks, {"kernel_default": "undecided", "exit": 3, "needs": missing}
    return checks, {"kernel_default": "yes", "exit": 0}


# -- output ---------------------------------------------------------------------------------------
def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_table(summary: dict) -> None:
    print("\n| engine | dtype | statistic | values | differing | max abs diff | max rel diff |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in summary["runs"]:
        groups: dict = {}
        for name, info in r["files"].items():
            if "missing" in info:
                continue
            parts = name.split("/")
            group = parts[1] if parts[1] != "aggregate" or len(parts) < 3 else "aggregate/" + parts[2].split(".")[0]
            g = groups.setdefault(group, {"values": 0, "differing": 0, "max_abs": 0.0, "max_rel": 0.0})
            for key in ("values", "differing"):
                g[key] += info[key]
            for key in ("max_abs", "max_rel"):
                g[key] = max(g[key], info[key])
        for group, g in sorted(groups.items()):
            print(f"| {r['engine']} | {r['dtype']} | {group} | {g['values']} | {g['differing']} | {g['max_abs']:.3g} "
                  f"| {g['max_rel']:.3g} |")
    print("\n| engine | dtype | decisions | compared | differing | near ties (tau) | largest gap | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in summary["runs"]:
        for level, d in [*sorted(r["decisions"].items()), ("exemplars", r["exemplars"])]:
            seconds = f"{r['seconds']:.3f}" if "seconds" in r and level == "exemplars" else ""
            gap = f"{d['largest_gap']:.3g}" if "largest_gap" in d else ""
            print(f"| {r['engine']} | {r['dtype']} | {level} | {d['compared']} | {d['differing']} "
                  f"| {d['near_ties']} ({r['tie_margin']:g}) | {gap} | {seconds} |")
    print()
    for c in summary["checks"]:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['check']}: {c['detail']}")
    v = summary["verdict"]
    print(f"\nverdict: the kernel as the default on CUDA: {v['kernel_default']}"
          + (f" (needs {', '.join(v['needs'])})" if v.get("needs") else "") + f"; exit {v['exit']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:N)")
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="small")
    parser.add_argument("--layers", type=int, help="keep this many of the shape's layers")
    parser.add_argument("--lengths", type=int, nargs="*", default=[256], help="one long sentence per length")
    parser.add_argument("--short", type=int, default=24, help="EWT-like sentences of 3 to 40 words (0: none)")
    parser.add_argument("--short-batch", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32"])
    parser.add_argument("--reference-dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=["eager", "chunked", "fused"])
    parser.add_argument("--query-chunk", type=int, help="rows per chunk (default: the analysis's own)")
    parser.add_argument("--no-confidence", dest="confidence", action="store_false",
                        help="leave confidence importance out")
    parser.add_argument("--time", action="store_true",
                        help="bfloat16: time the fused and kernel analyses of one --time-length sentence, unrecorded")
    parser.add_argument("--time-length", type=int, default=16384, help="words of the timed sentence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the comparison here (atomically)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: cpu or cuda[:N]")
    if not args.lengths and not args.short:
        parser.error("no data: give --lengths or --short")
    if PRECISION[args.reference_dtype] < max(PRECISION[d] for d in args.dtypes):
        parser.error(f"--reference-dtype {args.reference_dtype} is less precise than a compared dtype")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers: at least 1")
    if "kernel" in args.engines and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--engines kernel: a CUDA GPU (--device cuda), or Triton's interpreter on the CPU "
                     "(TRITON_INTERPRET=1 before the run)")
    summary = run(args)
    if args.json:
        target = Path(args.json)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, target)
    print_table(summary)
    return summary["verdict"]["exit"]


if __name__ == "__main__":
    sys.exit(main())
