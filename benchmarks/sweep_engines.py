"""The local engine vs Ray with 2 workers, on the same 8-point CPU grid, side by side in one run.

    python benchmarks/sweep_engines.py [--repeats 3] [--workers 2] [--new 64,128,192,256]

Each repeat runs the grid with both engines in turn (the order alternates between repeats, so a busy
moment of a shared machine does not always hit the same one), each into its own fresh results folder,
and checks that both measured the same bytes for every point. Printed: wall seconds of each engine
(Ray's cluster start is timed apart: a cluster is started once, not per sweep) and the ratio
local / Ray. Points are CPU points (toy preset, one OpenMP thread each) so the grid fits a laptop.

The first Ray sweep after the cluster starts also pays for its worker processes' start (each imports
kvlab, hence torch and transformers, before its first point): `python -m kvlab sweep --engine ray`
without --address starts a cluster per sweep and pays it every time; a running cluster pays it once.

Why less than 2x with 2 workers on 2 cores: a point is a fresh Jupyter kernel, and its start (Python,
torch and transformers imports, the kernel's ZeroMQ handshake) is a large, CPU-bound share of a small
point; with two points at once the two kernels take both cores, and the Ray driver, raylet, GCS and
the two worker processes (each imports kvlab, hence torch, before its first task) and the papermill
clients that poll each kernel, all need CPU time too. Nothing is left over, so the two lanes do not
run at full speed each. On a machine with cores to spare (or a cluster) the ratio approaches the
number of workers for points long enough that their start does not dominate.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from kvlab.lab.engines import run_sweep
from kvlab.lab.grid import expand, validate
from kvlab.lab.ray_engine import init_ray


def grid(new: list[int]) -> list[dict]:
    fixed = dict(preset="toy", batch=1, prompt=32, device="cpu", dtype="float32")
    return validate(expand(fixed, {"cache": ["tuple", "dynamic"], "new": new}))


def timed_sweep(points, out: Path, engine: str) -> tuple[float, "object"]:
    start = time.perf_counter()
    table = run_sweep(points, out, engine=engine, progress=False)
    seconds = time.perf_counter() - start
    if len(table) != len(points) or not (table["status"] == "ok").all():
        raise SystemExit(f"{engine}: not every point ran: {table[['status', 'error']]}")
    return seconds, table.set_index("point_id")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray's CPUs: points at once (default 2)")
    parser.add_argument("--new", default="64,128,192,256", help="new tokens, each with the tuple and dynamic caches")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per kernel, in both engines
    import ray

    points = grid([int(n) for n in args.new.split(",")])
    print(
        f"{len(points)} points (toy preset, fp32, cpu, batch 1, prompt 32, new {args.new}, caches tuple and "
        f"dynamic); {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}"
    )
    start = time.perf_counter()
    init_ray(num_cpus=args.workers)  # as a sweep starts one: on 127.0.0.1 only
    print(
        f"Ray {ray.__version__} cluster with {args.workers} CPUs started in {time.perf_counter() - start:.1f} s "
        f"(not counted below)"
    )
    seconds = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="kvlab-engines-") as scratch:
        for repeat in range(args.repeats):
            order = ["local", "ray"] if repeat % 2 == 0 else ["ray", "local"]
            tables = {}
            for engine in order:
                took, tables[engine] = timed_sweep(points, Path(scratch) / f"{engine}-{repeat}", engine)
                seconds[engine].append(took)
                print(f"  repeat {repeat + 1}: {engine:5s} {took:6.1f} s")
            local, on_ray = tables["local"], tables["ray"].loc[tables["local"].index]
            if not (local["overhead_bytes"] == on_ray["overhead_bytes"]).all():
                raise SystemExit("the engines measured different bytes for the same points")
            print(
                f"  repeat {repeat + 1}: local / ray = {seconds['local'][-1] / seconds['ray'][-1]:.2f} x"
                + (
                    " (Ray's first sweep: its workers start and import kvlab, torch, transformers)"
                    if repeat == 0
                    else ""
                )
            )
    ray.shutdown()
    local, on_ray = sum(seconds["local"]), sum(seconds["ray"])
    print(f"\n| engine | wall s ({args.repeats} x {len(points)} points) | s per point |\n|---|---|---|")
    print(f"| local (one after the other) | {local:.1f} | {local / args.repeats / len(points):.1f} |")
    print(f"| ray, {args.workers} workers | {on_ray:.1f} | {on_ray / args.repeats / len(points):.1f} |")
    print(
        f"\nlocal / ray = {local / on_ray:.2f} x (the same bytes measured for every point by both); "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
