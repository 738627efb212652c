"""`headlab analyze MODEL --source FILE [--target FILE] [--conllu FILE] --out DIR`: parse, run, print."""

from __future__ import annotations

import argparse

from headlab.analyze.pipeline import STAGES, AnalyzeConfig
from headlab.device_options import add_device_options


def _ints(text: str) -> tuple[int, ...]:
    from headlab.errors import HeadlabError

    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as error:
        raise HeadlabError(f"cannot read a list of integers from {text!r}") from error


def register(subparsers) -> None:
    h = AnalyzeConfig.help
    p = subparsers.add_parser(
        "analyze", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="everything in one resumable run: importance, head functions, aggregate statistics, "
             "(pruning), figures and an HTML report")
    p.add_argument("model", help=h("model"))
    p.add_argument("--source", required=True, help=h("source") + " (plain or .gz)")
    p.add_argument("--target", help=h("target"))
    p.add_argument("--conllu", help=h("conllu") + " (its own sentences are analysed)")
    p.add_argument("--conllu-is-source", action="store_true", help=h("conllu_is_source"))
    p.add_argument("--train-text", action="append", default=[], help=h("train_text") + "; repeatable")
    p.add_argument("--out", required=True, help=h("out"))
    p.add_argument("--prune", action="store_true", help=h("prune"))
    p.add_argument("--ablation", action="store_true", help=h("ablation"))
    p.add_argument("--force", action="store_true",
                   help=h("force") + "; also lets analyze write into a directory holding files it did not write")
    p.add_argument("--skip", nargs="+", default=[], metavar="STAGE",
                   help=f"stages not to run (space- or comma-separated): {', '.join(STAGES)}, "
                        "or importance (its five stages)")
    p.add_argument("--limit", type=int, help=h("limit"))
    p.add_argument("--conllu-limit", type=int, help=h("conllu_limit"))
    p.add_argument("--threads", type=int, help=h("threads"))
    p.add_argument("--batch-size", type=int, default=32, help=h("batch_size"))
    p.add_argument("--max-length", type=int, help=h("max_length"))
    p.add_argument("--lrp-targets", type=int, metavar="K", help=h("lrp_targets"))
    p.add_argument("--lrp-seed", type=int, default=0, help=h("lrp_seed"))
    p.add_argument("--query-chunk", type=int, metavar="N", help=h("query_chunk"))
    p.add_argument("--prune-source", help=h("prune_source"))
    p.add_argument("--prune-target", help=h("prune_target"))
    p.add_argument("--prune-limit", type=int, help=h("prune_limit"))
    p.add_argument("--prune-keeps", help=h("prune_keeps") + "; comma list")
    p.add_argument("--prune-gates", default="enc_self", help=h("prune_gates"))
    p.add_argument("--prune-steps", type=int, default=20, help=h("prune_steps"))
    p.add_argument("--prune-max-tokens", type=int, default=1024, help=h("prune_max_tokens"))
    p.add_argument("--prune-eval-beam", type=int, default=1, help=h("prune_eval_beam"))
    p.add_argument("--prune-gate-lr", type=float, default=0.1, help=h("prune_gate_lr"))
    p.add_argument("--prune-init-log-alpha", type=float, default=1.0, help=h("prune_init_log_alpha"))
    p.add_argument("--attention-sentences", type=int, default=20, help=h("attention_sentences"))
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--trust-remote-code", action="store_true", help=h("trust_remote_code"))
    add_device_options(p)
    p.set_defaults(func=run_analyze_command,
                   interrupted="the finished stages are kept in {out}; the same command resumes from them")


def config_from_args(args) -> AnalyzeConfig:
    return AnalyzeConfig(
        model=args.model, source=args.source, out=args.out, target=args.target, conllu=args.conllu,
        conllu_is_source=args.conllu_is_source, train_text=tuple(args.train_text), prune=args.prune,
        ablation=args.ablation, force=args.force,
        skip=tuple(name.strip() for item in args.skip for name in item.split(",") if name.strip()),
        limit=args.limit, conllu_limit=args.conllu_limit,
        threads=args.threads,
        batch_size=args.batch_size, max_length=args.max_length, query_chunk=args.query_chunk,
        lrp_targets=args.lrp_targets, lrp_seed=args.lrp_seed, prune_source=args.prune_source,
        prune_target=args.prune_target, prune_limit=args.prune_limit,
        prune_keeps=_ints(args.prune_keeps) if args.prune_keeps else (), prune_gates=args.prune_gates,
        prune_steps=args.prune_steps, prune_max_tokens=args.prune_max_tokens, prune_eval_beam=args.prune_eval_beam,
        prune_gate_lr=args.prune_gate_lr, prune_init_log_alpha=args.prune_init_log_alpha,
        attention_sentences=args.attention_sentences, progress=not args.no_progress,
        trust_remote_code=args.trust_remote_code, device=args.device, dtype=args.dtype, device_map=args.device_map,
    )


def print_summary(run) -> None:
    width = max(len(r.name) for r in run.records)
    for record in run.records:
        seconds = f"{record.seconds:7.1f} s" if record.seconds is not None else " " * 9
        reason = f"  {record.reason}" if record.reason else ""
        print(f"{record.name:<{width}}  {record.status:<7}  {seconds}{reason}")
    print(f"manifest: {run.manifest}")
    if run.report is not None:
        print(f"report: {run.report}")


def run_analyze_command(args) -> int:
    from headlab.analyze.pipeline import run_analysis

    run = run_analysis(config_from_args(args))
    print_summary(run)
    return 1 if run.failed else 0
