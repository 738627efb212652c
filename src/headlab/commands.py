"""Foundation subcommands: ``headlab heads`` and physical pruning (``headlab prune apply``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from headlab import preflight
from headlab.device_options import add_device_options, device_options
from headlab.errors import counted

# torch and transformers are imported by the commands that run, not at registration
# (``headlab --help`` stays fast).


def _add_model_options(parser) -> None:
    parser.add_argument("model", help="local model directory or hub id (hub ids need the network or a cache)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code from the model repository to run (off by default)")


def register(subparsers) -> None:
    heads = subparsers.add_parser("heads", help="list the attention blocks of a model")
    _add_model_options(heads)
    heads.add_argument("--json", action="store_true", help="print JSON instead of a table")
    heads.set_defaults(func=run_heads)

    # `headlab prune` is a command group registered by headlab.pruning.cli; its `apply`
    # sub-command (also reached as `headlab prune MODEL --heads ...`) uses the two functions below.


def add_prune_arguments(prune) -> None:
    """Arguments of physical pruning (``headlab prune apply``)."""
    _add_model_options(prune)
    prune.add_argument("--heads", required=True,
                       help='heads to remove: "enc_self:0:1,2 dec_cross:5:*" or a JSON mask file')
    prune.add_argument("--out", required=True, help="directory for the pruned model")
    prune.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    add_device_options(prune, dtype_help="the dtype the pruned weights are computed and written in (none: float32, "
                                         "whatever the checkpoint stores; the summary line says which)")


def heads_table(blocks) -> str:
    from headlab.adapters import idle_blocks

    lines = [f"{'kind':<10}{'layer':>6}{'heads':>7}{'kv heads':>10}{'d_head':>8}  module"]
    totals: dict[str, int] = {}
    for b in blocks:
        shared = f" (shared: its call {b.application + 1} of {b.applications})" if b.shared else ""
        qk = f" (query/key heads of {b.d_qk})" if b.d_qk != b.d_head else ""  # d_head: the value heads' size
        # ConvBERT's convolution heads: read by the output projection after the heads, not heads headlab measures
        after = f" (then {b.columns_after} columns that are not its heads')" if b.columns_after else ""
        lines.append(f"{b.kind:<10}{b.layer:>6}{b.n_heads:>7}{b.n_kv_heads:>10}{b.d_head:>8}  {b.name}{qk}{after}"
                     f"{shared}")
        totals[b.kind] = totals.get(b.kind, 0) + b.n_heads
    lines.append("total: " + ", ".join(f"{kind} {n}" for kind, n in totals.items())
                 + f"; {counted(sum(totals.values()), 'head')}")
    idle = idle_blocks(blocks)
    if idle:  # listed, as the model holds them, but nothing headlab computes from text reaches them
        lines.append(f"not run by token ids: {idle} (a vision or audio tower, or a cross-attention given no encoder "
                     "states): the measures leave them out, pruning them is refused")
    return "\n".join(lines)


def run_heads(args) -> int:
    from headlab.adapters import attention_blocks
    from headlab.heads import reconstructed_blocks, reconstructed_note
    from headlab.loading import build_from_config, load_model
    from headlab.surgery import declared_numbering, original_heads

    path = Path(args.model)
    if path.is_dir() and (path / "headlab_pruning.json").is_file():
        model = load_model(args.model, trust_remote_code=args.trust_remote_code)  # pruned: the weights define the head counts
    else:
        model = build_from_config(args.model, args.trust_remote_code)  # structure only, no weights read
    blocks = attention_blocks(model)
    reconstructed = reconstructed_blocks(declared_numbering(model))
    if args.json:
        # idle: token ids never run the block (the table's "not run by token ids" line); head_numbers: the number
        # each head the block runs has in headlab's results (a pruned model's: the original model's, unless
        # numbering says they were reconstructed)
        rows = [{"kind": b.kind, "layer": b.layer, "n_heads": b.n_heads, "n_kv_heads": b.n_kv_heads,
                 "d_head": b.d_head, "d_qk": b.d_qk, "module": b.name, "idle": bool(b.idle),
                 "head_numbers": original_heads(b)[0],
                 "numbering": "reconstructed" if f"{b.kind}:{b.layer}" in reconstructed else "original"} for b in blocks]
        print(json.dumps(rows, indent=1))
    else:
        print(heads_table(blocks) + (f"\n{reconstructed_note(reconstructed)}" if reconstructed else ""))
    return 0


def _written_dtype(model, stored: set[str], asked: str | None) -> str:
    """The precision the pruned weights were written in and why: --dtype, or load_model's float32
    (a float16 checkpoint is widened and its file doubles unless --dtype float16 keeps it)."""
    written = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}))
    source = "/".join(sorted(stored))
    if stored and {written} == stored:
        return f"in {written}, as the checkpoint stores it"
    if asked:
        return f"in {written} (--dtype {asked}; the checkpoint stores {source})" if stored else f"in {written}"
    keep = f": --dtype {source} keeps it" if source in ("float16", "bfloat16") else ""
    return f"in {written} (the default without --dtype; the checkpoint stores {source}{keep})" if stored \
        else f"in {written} (the default without --dtype)"


def run_prune(args) -> int:
    from headlab.adapters import attention_blocks
    from headlab.checkpoint import stored_dtypes
    from headlab.headspec import parse_heads, repeated_heads, repeated_note, whole_layers
    from headlab.loading import build_from_config, check_supported, load_model, load_tokenizer
    from headlab.outdir import check_output, results_lock, write_results, written_note
    from headlab.portable import how_to_load
    from headlab.surgery import (
        PRUNING_FILE,
        check_checkable,
        check_shared_plan,
        count_parameters,
        in_original_numbering,
        prune_heads,
        save_pruned,
        to_current_numbering,
    )

    out = Path(args.out)
    preflight.output_dir(out)
    # Like functions' --out (headlab.outdir): one run at a time; a directory holding the user's files
    # (or a model written before headlab listed its files) is refused, with or without --overwrite.
    check_output(out, args.overwrite, command="prune")
    check_supported(args.model, args.trust_remote_code, prune=True)
    if not (Path(args.model) / PRUNING_FILE).is_file():  # a pruned model's heads are in its weights
        # The spec against the structure built from the config (no weights read): a head the model
        # lacks is refused before the checkpoint is read, which takes minutes for a large one.
        structure = attention_blocks(build_from_config(args.model, args.trust_remote_code))
        # a vision tower's heads, which the check of the prune cannot run: refused before the weights are read
        planned = parse_heads(args.heads, structure)
        check_checkable(structure, planned, str(args.model))
        check_shared_plan(structure, planned)  # weights shared by several depths: the same heads at each
    else:  # its form at least (--heads ,), the heads it names once the weights are read
        parse_heads(args.heads, None)
    repeated = repeated_heads(args.heads, None)  # '*' aside: a layer's heads are not known here for a pruned model
    if repeated:  # removed once each: "1,1" for "1,2" would remove one head where two were meant
        print(f"headlab prune: {repeated_note(repeated, '--heads')}", file=sys.stderr)
    # The weights are written in the dtype they are loaded in (float32 unless --dtype): said below.
    stored = stored_dtypes(args.model) if Path(args.model).is_dir() else set()
    model = load_model(args.model, trust_remote_code=args.trust_remote_code, **device_options(args))
    if (Path(args.model) / PRUNING_FILE).is_file():
        # Heads in the original numbering, as the pruned model's heads.csv, scores and
        # headlab_pruning.json name them: its current indices would silently name other heads.
        original = parse_heads(args.heads, in_original_numbering(model))
        whole = whole_layers(args.heads)
        spec = to_current_numbering(model, original, frozenset(original) if whole is None else whole)
    else:
        spec = parse_heads(args.heads, attention_blocks(model))
    source = Path(args.model)
    tokenizer = None
    if not source.is_dir() or any((source / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        # keep the pruned directory self-contained
        tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    before = count_parameters(model)
    prune_heads(model, spec)

    def write(directory: Path) -> None:
        save_pruned(model, directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    # Written whole into out/.headlab/incoming-*, then moved in and listed: --overwrite removes the
    # earlier model's files this one does not write, and a failure leaves the earlier model whole.
    with results_lock(out, args.overwrite, True, command="prune"):
        write_results(out, write, command="prune", model=str(args.model), overwrite=args.overwrite)
    args.interrupted = written_note(out)  # a Ctrl-C from here on: the model is there, whole
    removed = sum(len(h) for h in spec.values())
    after = count_parameters(model)
    print(f"removed {counted(removed, 'head')}; parameters {before:,} -> {after:,} ({after / before:.1%}); saved to {out} "
          + _written_dtype(model, stored, args.dtype))
    record = json.loads((out.absolute() / PRUNING_FILE).read_text(encoding="utf-8"))
    print(how_to_load(model, record.get("portable") or {}, str(out)))
    return 0
