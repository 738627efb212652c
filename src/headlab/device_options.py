"""``--device``, ``--dtype`` and ``--device-map``: the options of every command that loads a
model for analysis, mapped onto :func:`headlab.loading.load_model`. Importing this module costs
no torch (the commands register their options at start-up)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def add_device_options(parser, dtype_help: str = "the weights' dtype (none: float32, whatever the checkpoint stores)"
                       ) -> None:
    parser.add_argument("--device", help="where the model runs: cpu, cuda or cuda:N (none: the CPU)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help=dtype_help)
    parser.add_argument("--device-map", choices=("auto",),
                        help="auto: spread a model that does not fit one device over the GPUs and the CPU "
                             "(accelerate); excludes --device")


def set_threads(threads: int | None) -> None:
    """torch's CPU threads, when ``--threads`` is given (at least 1)."""
    if threads is not None:
        from headlab.preflight import at_least

        at_least(threads, 1, "--threads")
        import torch

        torch.set_num_threads(threads)


def device_options(args) -> dict:
    """The keyword arguments of :func:`~headlab.loading.load_model`, checked before any work:
    a CUDA device that is not there, or --device with --device-map, is an error naming the option."""
    from headlab.errors import HeadlabError
    from headlab.loading import check_device

    options = {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype", None),
               "device_map": getattr(args, "device_map", None)}
    if options["device"] is not None and options["device_map"] is not None:
        raise HeadlabError("give --device or --device-map, not both")
    check_device(options["device"])
    return options
