"""Command line: `python -m kvlab {measure,compare,predict,sweep,stream}`.

Bad input exits with status 2 and one line naming the valid choices, before any model is built; so does a
point whose predicted peak exceeds the free memory of its device (unless --force).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..caches import CACHES
from ..loops import LOOPS, STRATEGIES
from .point import DEFAULTS, DESIGNS, KINDS
from ..models import PRESETS


def _point_arguments(parser: argparse.ArgumentParser, defaults: dict = DEFAULTS) -> None:
    parser.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)}, a config.json path (or its "
                        f"folder), or a hub id (default: {defaults['preset']})")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (e.g. num_hidden_layers=2)")
    parser.add_argument("--kind", default=None, help=f"one of {', '.join(KINDS)}: kvlab's loop, or the real release's "
                        "own generate() for that cache/loop (in a subprocess)")
    parser.add_argument("--cache", default=None, help=f"one of {', '.join(CACHES)}")
    parser.add_argument("--loop", default=None, help=f"the release whose generate() loop to run: one of {', '.join(LOOPS)}")
    parser.add_argument("--strategy", default=None, help=f"one of {', '.join(STRATEGIES)}")
    for name in ("batch", "prompt", "new", "restart-new", "num-beams", "chunk-limit", "block-tokens", "seed"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu, cuda, meta or auto (CUDA if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")


def _point_params(args) -> dict:
    keys = ("kind", "runtime", "preset", "cache", "loop", "strategy", "batch", "prompt", "new", "restart_new", "num_beams",
            "chunk_limit", "block_tokens", "seed", "device", "dtype", "timing", "force")
    params = {key: getattr(args, key, None) for key in keys if getattr(args, key, None) is not None}
    if args.override:
        params["overrides"] = args.override
    return params


def cmd_measure(args) -> None:
    from .point import normalize, run_point
    params = _point_params(args)
    normalize(**params)  # fail on bad input before the model is built
    record = run_point(**params)
    if args.json:
        print(json.dumps(record))
    else:
        for key, value in record.items():
            print(f"{key:26s} {value}")


def cmd_predict(args) -> None:
    from .point import normalize
    from .predict import format_prediction, parse_bytes, predict
    memory = parse_bytes(args.memory) if args.memory else None
    p = normalize(**_point_params(args))
    # Every design, those of one cache or loop, or exactly the (cache, loop) asked for.
    designs = [(cache, loop) for cache, loop in DESIGNS if args.cache in (None, cache) and args.loop in (None, loop)]
    if not designs or (args.cache and args.loop):
        designs = [(p["cache"], p["loop"])]
    result = predict(p, designs, memory)
    print(json.dumps(result, indent=2) if args.json else format_prediction(result))


def cmd_compare(args) -> None:
    from .compare import run_compare
    run_compare(device=args.device, preset=args.preset, out=args.out, new=args.new, batch=args.batch,
                prompt=args.prompt, dtype=args.dtype)


def cmd_sweep(args) -> None:
    from .sweep_cli import main as sweep_main
    sweep_main(args.rest)


def cmd_stream(args) -> None:
    from ..encdec.stream import main as stream_main
    stream_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvlab", description="Where the memory of generate() goes.")
    sub = parser.add_subparsers(dest="command", required=True)

    measure = sub.add_parser("measure", help="measure one point and print its record")
    _point_arguments(measure)
    measure.add_argument("--json", action="store_true", help="print the record as one JSON line")
    measure.add_argument("--runtime", default=None, help="eager (kvlab's loop, default), jit-trace (a torch.jit.trace "
                         "graph passing tuples: cache tuple), convert (tuples <-> DynamicCache every step: cache "
                         "dynamic) or export (torch.export with a static cache: cache static); see kvlab.graphs")
    measure.add_argument("--no-timing", dest="timing", action="store_false", default=None,
                         help="skip the second, unmetered run that measures tokens/s")
    measure.add_argument("--force", action="store_true", default=None,
                         help="run even if the predicted peak exceeds the free memory of the device")
    measure.set_defaults(func=cmd_measure)

    predict = sub.add_parser("predict", help="the predicted peak (weights + overhead) of every design, before running")
    _point_arguments(predict)
    predict.add_argument("--memory", default=None, metavar="SIZE",
                         help="say whether each design fits in this much memory (e.g. 24GiB, 80GB, 512MiB, bytes)")
    predict.add_argument("--json", action="store_true", help="print the prediction, term by term, as JSON")
    predict.set_defaults(func=cmd_predict)

    compare = sub.add_parser("compare", help="the tuple cache of <= 4.41 vs every later design, on the default device")
    compare.add_argument("--device", default="auto")
    compare.add_argument("--preset", default=None, help="default: llama2-7b-twin on CPU, tinyllama-1.1b on CUDA (see kvlab/lab/sweeps/)")
    compare.add_argument("--batch", type=int, default=None)
    compare.add_argument("--prompt", type=int, default=None)
    compare.add_argument("--new", type=int, default=None)
    compare.add_argument("--dtype", default=None)
    compare.add_argument("--out", default=None, help="results folder (default: results/compare-<time>)")
    compare.set_defaults(func=cmd_compare)

    sweep = sub.add_parser("sweep", help="run a grid of points with papermill, one fresh kernel each, here or on Ray "
                           "(--engine local|ray --address ...)", add_help=False)
    sweep.add_argument("rest", nargs=argparse.REMAINDER)
    sweep.set_defaults(func=cmd_sweep)

    stream = sub.add_parser("stream", help="serve a stream of encoder-decoder requests with each cache design",
                            add_help=False)
    stream.add_argument("rest", nargs=argparse.REMAINDER)
    stream.set_defaults(func=cmd_stream)
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    handed_over = {"sweep": cmd_sweep, "stream": cmd_stream}
    if argv[:1] and argv[0] in handed_over:  # argparse's REMAINDER cannot start with an option: hand over directly
        args = argparse.Namespace(command=argv[0], rest=argv[1:], func=handed_over[argv[0]])
    else:
        args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as error:
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
