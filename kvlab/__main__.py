"""Command line: `python -m kvlab {measure,compare,predict,sweep}`.

Bad input exits with status 2 and one line naming the valid choices, before any model is built.
"""

from __future__ import annotations

import argparse
import json
import sys

from .caches import CACHES
from .decode import LOOPS, STRATEGIES
from .experiment import DEFAULTS
from .models import PRESETS


def _point_arguments(parser: argparse.ArgumentParser, defaults: dict = DEFAULTS) -> None:
    parser.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)}, or a hub id (default: {defaults['preset']})")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (e.g. num_hidden_layers=2)")
    parser.add_argument("--cache", default=None, help=f"one of {', '.join(CACHES)}")
    parser.add_argument("--loop", default=None, help=f"the release whose generate() loop to run: one of {', '.join(LOOPS)}")
    parser.add_argument("--strategy", default=None, help=f"one of {', '.join(STRATEGIES)}")
    for name in ("batch", "prompt", "new", "restart-new", "num-beams", "chunk-limit", "block-tokens", "seed"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu, cuda, meta or auto (CUDA if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")


def _point_params(args) -> dict:
    keys = ("preset", "cache", "loop", "strategy", "batch", "prompt", "new", "restart_new", "num_beams",
            "chunk_limit", "block_tokens", "seed", "device", "dtype")
    params = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    if args.override:
        params["overrides"] = args.override
    return params


def cmd_measure(args) -> None:
    from .experiment import normalize, run_point
    params = _point_params(args)
    normalize(**params)  # fail on bad input before the model is built
    record = run_point(**params)
    if args.json:
        print(json.dumps(record))
    else:
        for key, value in record.items():
            print(f"{key:26s} {value}")


def cmd_predict(args) -> None:
    from . import theory
    from .experiment import normalize
    from .models import build_config
    p = normalize(**_point_params(args))
    config = build_config(p["preset"], p["overrides"])
    print(json.dumps(theory.explain(config, **{k: p[k] for k in theory.POINT_KEYS}), indent=2))


def cmd_compare(args) -> None:
    from .compare import run_compare
    run_compare(device=args.device, preset=args.preset, out=args.out, new=args.new, batch=args.batch,
                prompt=args.prompt, dtype=args.dtype)


def cmd_sweep(args) -> None:
    from .sweep import main as sweep_main
    sweep_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvlab", description="Where the memory of generate() goes.")
    sub = parser.add_subparsers(dest="command", required=True)

    measure = sub.add_parser("measure", help="measure one point and print its record")
    _point_arguments(measure)
    measure.add_argument("--json", action="store_true", help="print the record as one JSON line")
    measure.set_defaults(func=cmd_measure)

    predict = sub.add_parser("predict", help="the analytic peak of a point, term by term")
    _point_arguments(predict)
    predict.set_defaults(func=cmd_predict)

    compare = sub.add_parser("compare", help="the tuple cache of <= 4.41 vs every later design, on the default device")
    compare.add_argument("--device", default="auto")
    compare.add_argument("--preset", default=None, help="default: toy on CPU, tinyllama-1.1b on CUDA (see kvlab/sweeps/)")
    compare.add_argument("--batch", type=int, default=None)
    compare.add_argument("--prompt", type=int, default=None)
    compare.add_argument("--new", type=int, default=None)
    compare.add_argument("--dtype", default=None)
    compare.add_argument("--out", default=None, help="results folder (default: results/compare-<time>)")
    compare.set_defaults(func=cmd_compare)

    sweep = sub.add_parser("sweep", help="run a grid of points with papermill, one fresh kernel each", add_help=False)
    sweep.add_argument("rest", nargs=argparse.REMAINDER)
    sweep.set_defaults(func=cmd_sweep)
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # argparse's REMAINDER cannot start with an option: hand over directly
        args = argparse.Namespace(command="sweep", rest=argv[1:], func=cmd_sweep)
    else:
        args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as error:
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
