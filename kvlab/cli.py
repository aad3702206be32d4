"""Command line: `python -m kvlab {measure,compare,predict,explain,sweep,waste,savers}`. Every error is one line,
`kvlab VERB: error: ...` (argparse's own too), exit status 2 for bad input, before any model is built; so is a point
predicted not to fit in its device's free memory (unless --force). Every verb runs decoders (encoder-decoders:
appendix A10). A sweep (a sweep file and/or --grid items → points → an engine) stops on Ctrl-C or SIGTERM with its
rows kept.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from . import catalogue  # noqa: F401  (the decoders beyond the lessons', registered on import: --help names them)
from .presets import DECODERS
from .releases import ReferenceInstallError
from .schema import CACHES, DEFAULTS, EXPLAIN_DEFAULTS, KINDS, LOOPS, STRATEGIES

# The point's options (--restart-new sets restart_new) and what each is; a number's metavar is N.
POINT_OPTIONS = {
    "preset": f"a decoder preset ({', '.join(DECODERS)}), a config.json path (or its folder), or a hub id",
    "kind": f"one of {', '.join(KINDS)}: kvlab's loop, or the real release's own generate() for that cache/loop, "
    "in a subprocess",
    "cache": f"one of {', '.join(CACHES)}",
    "loop": f"the release whose generate() loop to run: one of {', '.join(LOOPS)}",
    "strategy": f"one of {', '.join(STRATEGIES)}",
    "batch": "sequences decoded together",
    "prompt": "prompt length, tokens",
    "new": "tokens generated per sequence",
    "restart-new": "tokens a second generate() call adds, continuing from the first's cache; 0: no such call",
    "restart-from": "what the restart passes back: the cache object, or its tensors as tuples (4.42's default)",
    "num-beams": "beams per sequence (strategy beam)",
    "chunk-limit": "cache list: chunks kept before they are joined into one",
    "block-tokens": "cache prealloc: tokens its buffers grow by",
    "seed": "weights, prompt and sampling",
    "device": "cpu, cuda, meta (counts without data) or auto (CUDA if present)",
    "dtype": "float32, bfloat16 or float16",
}
NUMBERS = ("batch", "prompt", "new", "restart-new", "num-beams", "chunk-limit", "block-tokens", "seed")
# The rows of measure's table: (record field, what it is); a field the point has no value for is left out.
TABLE = [
    ("baseline_bytes", "weights (before decoding)"),
    ("peak_bytes", "peak"),
    ("overhead_bytes", "overhead = peak - weights"),
    ("kv_at_peak_bytes", "  KV cache, at the peak"),
    ("logits_at_peak_bytes", "  logits, at the peak"),
    ("other_at_peak_bytes", "  the rest, at the peak"),
    ("kernels_at_peak_bytes", "  inside kernels (the allocator alone saw it), at the peak"),
    ("predicted_overhead_bytes", "overhead predicted (kvlab.theory)"),
    ("kv_final_bytes", "final KV cache"),
    ("reserved_peak_bytes", "reserved by the CUDA allocator, peak"),
    ("storages_peak_bytes", "live storages, peak"),
]


class Parser(argparse.ArgumentParser):
    """argparse with kvlab's one-line errors (argparse's own print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog.removeprefix('python -m ')}: error: {message}\n")


def _point_arguments(parser: argparse.ArgumentParser, defaults: dict | None = None, stated: str | None = None):
    """The point's options (those `defaults` names, else all), each with its value in `defaults`, else left unset
    (None) unless given, so that normalize knows what was asked for; the help states what an unset one becomes
    (`stated`, else its default)."""
    for name in defaults or POINT_OPTIONS:
        shown = defaults[name] if defaults else DEFAULTS[name.replace("-", "_")]
        number = dict(type=int, metavar="N") if name in NUMBERS else {}
        parser.add_argument(
            f"--{name}",
            default=(defaults or {}).get(name),
            **number,
            help=f"{POINT_OPTIONS[name]} {stated or f'(default: {shown})'}",
        )


def _point_params(args) -> dict:
    params = {key: value for key, value in vars(args).items() if key in DEFAULTS and value is not None}
    return dict(params, overrides=args.override) if args.override else params


def format_record(r: dict) -> str:
    """measure's short table: the point, then its bytes in MiB (GiB for a peak of 1 GiB or more)."""
    unit, size = ("GiB", 2**30) if r["peak_bytes"] >= 2**30 else ("MiB", 2**20)
    name = f"{r['preset']} ({r['overrides']})" if r["overrides"] else r["preset"]
    beams = f" x {r['num_beams']} beams" if r["strategy"] == "beam" else ""
    restart = f" + {r['restart_new']} after a restart" if r["restart_new"] else ""
    rows = [(label, r[key] / size) for key, label in TABLE if r.get(key) is not None]
    width = max(len(label) for label, _ in rows)
    facts = [f"overhead / final KV {r['overhead_over_kv']:.3f}"] if r["overhead_over_kv"] is not None else []
    if r.get("prediction_error") is not None:
        basis = " of the tensors counted" if r["meter"] == "cpu-allocator" else ""  # kernels' own scratch aside
        facts.append(f"theory off by {100 * r['prediction_error']:+.2f} %{basis}")
    if r.get("tokens_per_s"):
        facts.append(f"{r['tokens_per_s']:.1f} tokens/s ({r['seconds']:.2f} s, an unmetered run)")
    return "\n".join(
        [
            f"{name}: {r['cache']} cache, {r['loop']} loop ({r['kind']}, {r['runtime']}), {r['strategy']}{beams}; "
            f"batch {r['batch']}, prompt {r['prompt']}, {r['new']} new{restart}; {r['dtype']} on {r['device']}",
            "",
            f"{'':{width}}  {unit:>10}",
            *(f"{label:{width}}  {value:10.3f}" for label, value in rows),
            "",
            "; ".join(facts),
            f"meter {r['meter']} on {r['device_name']}; transformers {r['transformers_version']}, "
            f"torch {r['torch_version']}; --json prints the whole record",
        ]
    )


def cmd_measure(args) -> None:
    from .lab.point import run_point  # it checks every input before a model is built

    record = run_point(**_point_params(args))
    print(json.dumps(record) if args.json else format_record(record))


def cmd_predict(args) -> None:
    from .planner.plan import predict

    result = predict(
        **_point_params(args),
        memory=args.memory,
        max_batch=args.max_batch,
        max_new=args.max_new,
        dry_run=args.dry_run,
        threads=args.threads,
        arch=args.gpu_arch,
    )
    print(json.dumps(result, indent=2) if args.json else result)


def cmd_explain(args) -> None:
    options = {key: getattr(args, key) for key in (*EXPLAIN_DEFAULTS, "generate_of", "step")}
    check_explain(options, args.override or None)
    from .explain import explain_point

    print(explain_point(overrides=args.override or None, **options).format())


def check_explain(options: dict, overrides) -> None:
    """explain's point checked as any point is (sizes, a decoder, its cache) and, since it runs for real on this
    CPU, refused when predicted not to fit in its free memory: one line, before a model is built."""
    from .planner.params import normalize
    from .planner.plan import TooBig, check_fits

    point = {key: options[key] for key in ("preset", "batch", "prompt", "new", "dtype", "seed")}
    if options["generate_of"] == "kvlab":  # another generate() brings its own cache
        point.update(cache=options["cache"], loop=options["loop"])
    if options["step"] is not None and options["step"] < 0:
        raise ValueError(f"--step must be 0 (the prompt's forward) or more, got {options['step']}")
    try:
        check_fits(normalize(**point, overrides=overrides, device="cpu"))
    except TooBig as error:
        why = str(error).partition("; pass --force")[0]  # explain has no --force: it would run out of memory
        raise ValueError(f"{why}; explain runs on the CPU: give smaller sizes") from None


def cmd_compare(args) -> None:
    from .compare import NothingMeasured, run_compare

    try:
        table = run_compare(
            **{key: getattr(args, key) for key in ("device", "preset", "out", "new", "batch", "prompt", "dtype")}
        )
    except NothingMeasured as error:
        print(f"kvlab compare: {error}", file=sys.stderr)
        sys.exit(1)
    if table.attrs["not_ok"]:
        print(
            f"kvlab compare: {table.attrs['not_ok']} point(s) not ok (above); the table shows the rest",
            file=sys.stderr,
        )
        sys.exit(1)


def cmd_sweep(args) -> None:
    # A batch scheduler stops a job with SIGTERM (Slurm's scancel, its time limit): treat it as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _sweep(args)
    except OSError as error:  # the file system: full, read-only, a file where a folder is wanted
        where = f" ({error.filename})" if error.filename else ""
        print(
            f"kvlab sweep: error: {error.strerror or error}{where}; the rows saved so far are kept: "
            f"fix that and rerun the same command to resume",
            file=sys.stderr,
        )
        sys.exit(2)
    except KeyboardInterrupt:  # the rows written so far stay valid: a rerun resumes
        print("kvlab sweep: interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sweep(args) -> None:
    from .lab.engines import ENGINES, run_sweep
    from .lab.grid import expand, load_sweep, merge_grid_items, point_id, point_label, read_sweep, validate
    from .lab.store import rebuild

    if args.engine not in ENGINES:
        raise ValueError(f"unknown engine {args.engine!r}; choose one of {', '.join(ENGINES)}")
    engine_options = dict(address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    if args.engine == "local" and any(value is not None for value in engine_options.values()):
        raise ValueError("--address, --num-cpus and --num-gpus are for --engine ray")
    fixed, grid = merge_grid_items(*(load_sweep(args.file) if args.file else ({}, {})), args.grid)
    timeout = args.point_timeout
    if timeout is None and args.file:
        timeout = read_sweep(args.file).get("point_timeout_s")
    if timeout is not None and timeout < 1:
        raise ValueError(f"--point-timeout must be a positive number of seconds, got {timeout}")
    out = Path(args.out or Path("results") / (Path(args.file).stem if args.file else "sweep"))
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the results")
    if args.rebuild:
        if not out.is_dir():
            raise ValueError(f"no results folder {out} to rebuild; give it with --out")
        rows = rebuild(out / "results.csv")
        print(f"{out / 'results.csv'}: {len(rows)} rows, from {out / 'records'}", file=sys.stderr)
        return
    if not args.file and not args.grid:
        raise ValueError("give a sweep file and/or --grid key=v1,v2,...")
    if args.force:
        grid.pop("force", None)
        fixed["force"] = True
    points = validate(expand(fixed, grid), devices_here=args.engine == "local")
    if args.dry_run:
        for params in points:
            print(point_id(params), point_label(params))
        print(
            f"{len(points)} point{'s' * (len(points) != 1)}; results would go to {out / 'results.csv'}"
            + (f"; each cell of a point may run {timeout} s" if timeout else "")
        )
        return
    table = run_sweep(
        points,
        out,
        notebook=args.notebook,
        kernel_name=args.kernel,
        command=" ".join(["python -m kvlab", *args.argv]),
        engine=args.engine,
        point_timeout=timeout,
        **engine_options,
    )
    _exit_on_failures(table, {point_id(params) for params in points}, out)


def _exit_on_failures(table, ids: set[str], out: Path) -> None:
    """Exit 1, with a count, when any of the sweep's points is not ok in the folder: a script can trust 0."""
    not_ok = table[table["point_id"].isin(ids) & (table["status"] != "ok")]
    if len(not_ok):
        counts = ", ".join(f"{n} {status}" for status, n in not_ok["status"].value_counts().items())
        print(
            f"kvlab sweep: {len(not_ok)} of {len(ids)} points not ok ({counts}); see {out / 'summary.md'}, "
            f"and rerun the same command to retry them",
            file=sys.stderr,
        )
        sys.exit(1)


def cmd_waste(args) -> None:
    from .lab.waste_table import write_waste

    write_waste(args.names, args.out, command=" ".join(["python -m kvlab", *args.argv]))


def cmd_savers(args) -> None:
    command = " ".join(["python -m kvlab", *args.argv])
    if "text" not in args.names:
        from .lab.savers_table import write_savers

        return write_savers(args.names, args.out, command=command)
    if args.names != ["text"]:
        raise ValueError("text writes its own table; run it alone, not with savers")
    _write_saver_answers(args.out, command)


def _write_saver_answers(out: str, command: str) -> None:
    """The running example's answer with each lossy saver (savers_table.saver_answers): OUT/savers_text.csv."""
    import datetime

    import pandas as pd

    from .lab.savers_table import LOSSY, SAVER_QUESTION, SAVER_TOKENS, backend_versions, saver_answers
    from .lab.store import append_run, prepare_folder
    from .weights import PRESET

    versions = backend_versions(LOSSY)
    started = datetime.datetime.now(datetime.timezone.utc)
    prepare_folder(Path(out), folders=())
    table = pd.DataFrame(saver_answers()).astype({"first_difference": "Int64"})  # None: the default's every token
    table.to_csv(Path(out) / "savers_text.csv", index=False)
    print(table[["saver", "same_tokens", "first_difference"]].to_string(index=False))
    what = "kvlab.lab.savers_table.saver_answers: the running example's greedy answer (fp32) with each lossy saver"
    append_run(out, command, started, "cpu", results_file="savers_text.csv", what=what, preset=PRESET,
               question=SAVER_QUESTION, new=SAVER_TOKENS, backends=versions)  # fmt: skip


def _savers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure today's memory savers (kvlab.savers): for each, the KV bytes and the peak bytes it saves against "
        "the same model without it, what holds the difference at its peak, and both predicted; its row in "
        "OUT/savers.csv (replacing its stored one), each run logged in OUT/provenance.json."
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="name",
        help="savers of kvlab.savers.SAVERS (default: all; an unknown name is refused with the list), or text "
        "alone: the running example's answer with each lossy saver (OUT/savers_text.csv)",
    )
    parser.add_argument(
        "--out",
        default=str(Path("data") / "today"),
        help="folder of the table, relative to the current directory (default: data/today)",
    )


def _waste_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure where the peak of transformers' own generate() goes (kvlab.waste): each point's "
        "rows in OUT/waste.csv (replacing its stored ones), or `growth`: the cache against "
        "generated tokens in OUT/cache_growth.csv; each run logged in OUT/provenance.json."
    )
    # The points are named when checked, not here: kvlab.waste imports the whole lesson, too much for every --help.
    parser.add_argument(
        "names",
        nargs="*",
        metavar="name",
        help="points of kvlab.waste.POINTS (default: all; an unknown name is refused with the list), or growth alone",
    )
    parser.add_argument(
        "--out",
        default=str(Path("data") / "today"),
        help="folder of the tables, relative to the current directory (default: data/today)",
    )


def _sweep_arguments(parser: argparse.ArgumentParser) -> None:
    from .lab.engines import ENGINES
    from .lab.grid import SWEEPS_DIR
    from .lab.runner import POINT_NOTEBOOK

    parser.description = (
        "Run a grid of experiment points with papermill: one fresh kernel per point, resumable, failures are rows."
    )
    parser.add_argument(
        "file",
        nargs="?",
        metavar="sweep",
        help="sweep YAML (fixed: + grid:), a path or one of: "
        f"{', '.join(sorted(p.stem for p in SWEEPS_DIR.glob('*.yaml')))}",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help=f"grid values, repeatable; a single value fixes the key. Keys: {', '.join(DEFAULTS)}",
    )
    parser.add_argument("--out", help="results folder (default: results/<sweep name>)")
    parser.add_argument("--notebook", default=None, help=f"point notebook (default: {POINT_NOTEBOOK.name})")
    parser.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the points, run nothing")
    parser.add_argument("--force", action="store_true", help="run points predicted not to fit in free memory too")
    parser.add_argument(
        "--point-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="seconds a cell of a point's notebook may run; past it the point is a failed row "
        "(default: the sweep file's point_timeout_s, else no limit)",
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="remake OUT/results.csv from the rows in OUT/records/ and stop (every sweep does this first)",
    )
    ray = parser.add_argument_group("engine", "where the points run (the results folder is the same for both)")
    ray.add_argument(
        "--engine",
        default="local",
        metavar="{" + ",".join(ENGINES) + "}",
        help="local: one point after the other here (default); ray: a Ray task per point",
    )
    ray.add_argument(
        "--address",
        default=None,
        help="Ray cluster: auto (the one this node belongs to) or ray://HOST:PORT; default: start one here",
    )
    ray.add_argument("--num-cpus", type=float, default=None, help="CPUs per point's Ray task (default 1)")
    ray.add_argument(
        "--num-gpus", type=float, default=None, help="GPUs per point's Ray task (default: 1 for CUDA points, else 0)"
    )


def _measure_arguments(measure: argparse.ArgumentParser) -> None:
    measure.add_argument("--json", action="store_true", help="print the whole record (bytes) as one JSON line")
    measure.add_argument(
        "--runtime",
        default=None,
        help="eager (kvlab's loop), jit-trace (a torch.jit.trace graph "
        "passing tuples: cache tuple), convert (tuples <-> DynamicCache every step: cache dynamic) or "
        "export (torch.export with a static cache: cache static); see kvlab.graphs "
        f"(default: {DEFAULTS['runtime']})",
    )
    measure.add_argument(
        "--no-timing",
        dest="timing",
        action="store_false",
        default=None,
        help="skip the second, unmetered run that measures tokens/s",
    )
    measure.add_argument(
        "--force",
        action="store_true",
        default=None,
        help="run even if the predicted peak exceeds the free memory of the device",
    )


def _predict_arguments(predict: argparse.ArgumentParser) -> None:
    # The device planned for, whatever this machine has (kvlab.planner.params.target_device).
    predict._option_string_actions[
        "--device"
    ].help = "the device to plan for, whatever this machine has: cuda (cuda:N), cpu or meta (default: cuda)"
    predict.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="with --device cpu: the CPU's torch threads (its flash attention's scratch is per thread) "
        "(default: this machine's)",
    )
    predict.add_argument(
        "--gpu-arch",
        default=None,
        help="with --device cuda: hopper (compute capability 9.0: H100, H200; cuBLAS's workspace is 32 MiB and SDPA "
        "runs cuDNN's kernel) or other (8 MiB; flash) (default: hopper)",
    )
    predict.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help="say whether each design fits in this much memory (e.g. 24GiB, 80GB, 512MiB, bytes)",
    )
    predict.add_argument("--max-batch", action="store_true", help="with --memory: the largest batch each design fits")
    predict.add_argument(
        "--max-new",
        action="store_true",
        help="with --memory: the most new tokens each design fits (up to the model's context)",
    )
    predict.add_argument(
        "--dry-run",
        action="store_true",
        help="count a dry run of kvlab's loop on the meta device instead of kvlab.theory's walk (a few layers' run "
        "extrapolated to all, kvlab.planner.fast; predict(exact=True) runs every layer); model types the theory "
        "does not walk get it anyway",
    )
    predict.add_argument("--json", action="store_true", help="print the prediction, term by term, as JSON (bytes)")


def _explain_arguments(explain: argparse.ArgumentParser) -> None:
    explain.add_argument(
        "--generate-of",
        default="kvlab",
        help="whose generate() runs: kvlab (its loop, with --cache "
        "and --loop), installed (this transformers' own), 4.40.1 or 4.42.4 (that release's own, in "
        "its folder) (default: kvlab)",
    )
    explain.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="the peak within forward N (0: the prompt's) instead of the whole run's (default: the whole run)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m kvlab", description="Where the memory of generate() goes.")
    sub = parser.add_subparsers(dest="command", required=True)

    measure = sub.add_parser(
        "measure",
        help="measure one point and print its record",
        description="Measure one point: the peak of generate()'s memory above the weights, and "
        "what is live at the peak. Prints a table in MiB or GiB; --json prints the record (bytes).",
    )
    predict = sub.add_parser(
        "predict",
        help="the predicted peak (weights + overhead) of every design, before running",
        description="The predicted peak of every design (or the one asked for) from the config "
        "alone, in GiB; nothing is allocated.",
    )
    explain = sub.add_parser(
        "explain",
        help="who holds the bytes: the live tensors at a greedy run's peak, by what names them",
        description="Run one greedy point twice on the CPU under the live-storage "
        "counter; at its peak, list the live tensor storages grouped by the name that holds them "
        "(a frame's local, an attribute path, the op's own inputs and output), with bytes.",
    )
    for verb, defaults in ((measure, None), (predict, None), (explain, EXPLAIN_DEFAULTS)):
        _point_arguments(verb, defaults)
        verb.add_argument(
            "--override",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="config override, repeatable (e.g. num_hidden_layers=2)",
        )
    _measure_arguments(measure)
    _predict_arguments(predict)
    _explain_arguments(explain)

    compare = sub.add_parser("compare", help="the tuple cache of <= 4.41 vs every later design, on the default device")
    compare.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA if present) (default: auto)")
    compare.add_argument(
        "--preset",
        default=None,
        help="a decoder preset, config.json or hub id (default: "
        "llama2-7b-twin on CPU, tinyllama-1.1b on CUDA: kvlab/lab/sweeps/cpu-default.yaml, cuda-default.yaml)",
    )
    _point_arguments(compare, dict.fromkeys(("batch", "prompt", "new", "dtype")), "(default: the sweep file's)")
    compare.add_argument("--out", default=None, help="results folder (default: results/compare-<time>)")

    _sweep_arguments(
        sub.add_parser(
            "sweep",
            help="run a grid of points with papermill, one fresh kernel each, here "
            "or on Ray (--engine local|ray --address ...)",
        )
    )
    _waste_arguments(
        sub.add_parser(
            "waste", help="the waste in transformers' own generate(): measure points into data/today (or --out)"
        )
    )
    _savers_arguments(
        sub.add_parser("savers", help="today's memory savers: KV saved beside peak saved, into data/today (or --out)")
    )
    commands = dict(
        savers=cmd_savers,
        measure=cmd_measure,
        predict=cmd_predict,
        explain=cmd_explain,
        compare=cmd_compare,
        sweep=cmd_sweep,
        waste=cmd_waste,
    )
    for name, verb in sub.choices.items():
        verb.set_defaults(func=commands[name])
    return parser


# The modules each extra of pyproject.toml brings (the smallest extra that has each).
EXTRAS = {
    "lab": ("papermill", "nbformat", "ipykernel", "jupyter_client", "pandas", "psutil", "nbclient"),
    "notebooks": ("matplotlib", "seaborn", "ipywidgets"),
    "ray": ("ray",),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        args.func(args)
    except (ValueError, ReferenceInstallError) as error:  # bad input (2), or the machine's fault, not the input's (1)
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2 if isinstance(error, ValueError) else 1)
    except ModuleNotFoundError as error:  # the lesson needs torch and transformers alone; the machinery, an extra
        extra = next((name for name, modules in EXTRAS.items() if error.name in modules), None)
        if extra is None:
            raise
        print(
            f"kvlab {args.command}: error: it needs {error.name}, which comes with kvlab's {extra} extra: "
            f"pip install 'kvlab[{extra}]'",
            file=sys.stderr,
        )
        sys.exit(1)
