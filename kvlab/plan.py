"""A budgeted run of measurement jobs in parallel lanes, read from a plan file: the GPU run as data, not bash.

    python -m kvlab plan h200 --out OUT                    # on the GPU node (gpu/h200_run.sh installs, then this)
    python -m kvlab plan h200 --out /tmp/dry --dry-run     # the same plan on this CPU: toy preset, tiny sizes
    python -m kvlab plan h200 --list                       # jobs, estimates and deadlines; runs nothing

A plan file (YAML; a path or a name in kvlab/plans/) has:

    budget_s, reserve_s      the whole run's seconds; the last reserve_s are kept for the summary
    step_s, start_s          planning estimates: seconds per decoding step, seconds to start a process
    parallel, gib_per_lane   lanes run at once: a number, or auto (free GPU GiB // gib_per_lane; CPU: all)
    point                    parameters every point shares (the keys of kvlab.lab.point.DEFAULTS)
    phases                   [{name, ends_before_s, jobs}]: one after the other; a phase ends ends_before_s
                             before the budget's end (after the reserve)
    a job                    {name, lane, point, points: [...]} measured by kvlab.lab.point.measure in one
                             process (a point may be kind: reference), or {name, lane, sweep: {file, grid}}
                             run by `python -m kvlab sweep`; fit_new: {max, multiple, min, step_factor} picks
                             `new` from the time left; warmup: [points] run first and not recorded;
                             compare_speed: CACHE sets every point's tokens/s beside that cache's
    compare_with             [{label, path}]: data files whose overhead / KV the summary sets beside each point
    tolerance                how close a reference point and kvlab's loop at the same point must be
    dry_run                  a partial plan that --dry-run merges over this one (jobs by name), and
                             presets: {name: {preset, overrides}} to swap every point's preset

Jobs of different lanes run side by side, each in its own process (on one GPU each process has its own
allocator counters, so memory figures do not disturb each other; speed does: only a phase with one lane
times cleanly). Every point is validated before anything runs. A job whose estimate exceeds the time left
in its phase is skipped, a point likewise, a job still running at its phase's deadline is killed with all
its processes; each of these is listed in run.log and summary.md. Points already "ok" in OUT/results.csv
are not run again, so a second call resumes (a sweep job's own sweep, in OUT/sweep/<job> while the plan runs,
resumes likewise). OUT ends up flat: run.log, env.txt, results.csv (one row per point, kvlab.lab.store's store,
with job, lane and phase), provenance.json, summary.md, and sweep.tar.gz (OUT/sweep packed: what sweep jobs
executed, and what the next call unpacks to resume them).

Lanes are threads that each start one process at a time, not Ray tasks (kvlab.lab.store's cluster engine): the
GPU node carries only the papermill wheels (shared/DESIGN.md §5), and a lane is nothing more than a process
with a deadline, which subprocess and psutil (to end its whole process tree) do in a few lines.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path

import yaml

from .lab.point import DEFAULTS, normalize
from .lab.shipped import shipped_or_path
from .lab.store import done_point_ids

PLANS_DIR = Path(__file__).resolve().parent / "plans"
ROOT = Path(__file__).resolve().parent.parent
ROW = "kvlab-plan-row "  # the prefix of a worker's output line that carries one results row (JSON)
PLAN_KEYS = {"description", "budget_s", "reserve_s", "step_s", "start_s", "parallel", "gib_per_lane", "point",
             "phases", "compare_with", "tolerance", "dry_run"}
JOB_KEYS = {"name", "lane", "point", "points", "sweep", "fit_new", "warmup", "compare_speed"}


# -- the plan file -------------------------------------------------------------------------------
def plan_file(name: str | os.PathLike) -> Path:
    """An existing path, or the name of a plan shipped in kvlab/plans/."""
    return shipped_or_path(name, PLANS_DIR, "plan")


def data_path(path: str) -> Path:
    """A data file named in a plan: absolute, or relative to the repository (data/...)."""
    return Path(path) if Path(path).is_absolute() else ROOT / path


def merge(base, patch):
    """`patch` over `base`, key by key; lists of named things (phases, jobs) by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: merge(base.get(key), value) for key, value in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in base + patch):
        patches = {item["name"]: item for item in patch}
        unknown = set(patches) - {item["name"] for item in base}
        if unknown:
            raise ValueError(f"dry_run names {', '.join(sorted(unknown))}, which the plan does not have")
        return [merge(item, patches.get(item["name"], {})) for item in base]
    return copy.deepcopy(patch)


def load_plan(name: str | os.PathLike, dry_run: bool = False, only: list[str] | None = None,
              devices_here: bool = True) -> dict:
    """The plan, checked: the dry run merged in if asked, jobs outside `only` (name prefixes) dropped.
    devices_here=False checks every point as if on the meta device (a GPU plan listed on a CPU)."""
    path = plan_file(name)
    plan = yaml.safe_load(path.read_text()) or {}
    if not isinstance(plan, dict) or set(plan) - PLAN_KEYS:
        raise ValueError(f"{path}: unknown section(s) {', '.join(sorted(set(plan) - PLAN_KEYS))}; "
                         f"a plan has: {', '.join(sorted(PLAN_KEYS))}")
    patch = dict(plan.pop("dry_run", None) or {})
    presets = patch.pop("presets", {}) or {}
    if dry_run:
        plan = merge(plan, patch)
    else:
        presets = {}
    plan = dict(dict(budget_s=450, reserve_s=20, step_s=0.1, start_s=15, parallel="auto", gib_per_lane=24,
                     point={}, compare_with=[], tolerance=0.03), **plan, name=path.stem, path=str(path),
                dry_run=dry_run)
    for key in ("budget_s", "reserve_s", "step_s", "start_s", "tolerance"):
        if not isinstance(plan[key], (int, float)) or plan[key] < 0:
            raise ValueError(f"{path}: {key} must be a number of seconds >= 0, got {plan[key]!r}")
    if plan["parallel"] != "auto" and (not isinstance(plan["parallel"], int) or plan["parallel"] < 1):
        raise ValueError(f"{path}: parallel must be auto or a positive integer, got {plan['parallel']!r}")
    for source in plan["compare_with"]:
        if not isinstance(source, dict) or set(source) != {"label", "path"}:
            raise ValueError(f"{path}: each compare_with entry is {{label, path}}, got {source!r}")
        if not data_path(source["path"]).exists():
            raise ValueError(f"{path}: compare_with file {source['path']} not found")
    if not plan.get("phases"):
        raise ValueError(f"{path}: the plan has no phases")
    names = set()
    for phase in plan["phases"]:
        if not isinstance(phase.get("ends_before_s", 0), (int, float)) or not phase.get("name"):
            raise ValueError(f"{path}: a phase needs a name and ends_before_s (seconds)")
        jobs = []
        for job in phase.get("jobs") or []:
            _check_job(path, job, names)
            if only and not any(job["name"].startswith(prefix) for prefix in only):
                continue
            job = dict(job, phase=phase["name"], point={**plan["point"], **(job.get("point") or {})})
            _swap_presets(job, presets)
            jobs.append(job)
        phase["jobs"] = jobs
    if only and not any(phase["jobs"] for phase in plan["phases"]):
        raise ValueError(f"no job of {path} starts with {', '.join(only)}; jobs: {', '.join(sorted(names))}")
    for phase in plan["phases"]:  # every point, before anything runs
        for job in phase["jobs"]:
            points = sweep_points(job) if job.get("sweep") else points_of(job, new=job.get("fit_new", {}).get("min"))
            for point in points + warmups_of(job):
                try:
                    normalize(**(point if devices_here else dict(point, device="meta")))
                except ValueError as error:
                    raise ValueError(f"{path}: job {job['name']}: point {json.dumps(point)}: {error}") from None
    return plan


def _check_job(path: Path, job: dict, names: set) -> None:
    if not isinstance(job, dict) or not job.get("name") or not job.get("lane"):
        raise ValueError(f"{path}: every job needs a name and a lane, got {job!r}")
    unknown = set(job) - JOB_KEYS
    if unknown:
        raise ValueError(f"{path}: job {job['name']}: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(sorted(JOB_KEYS))}")
    if job["name"] in names:
        raise ValueError(f"{path}: two jobs are named {job['name']}")
    names.add(job["name"])
    if bool(job.get("points")) == bool(job.get("sweep")):
        raise ValueError(f"{path}: job {job['name']} needs either points or a sweep")
    fit = job.get("fit_new")
    if fit is not None and (set(fit) - {"max", "multiple", "min", "step_factor"} or not fit.get("max")):
        raise ValueError(f"{path}: job {job['name']}: fit_new has max, and optionally multiple, min, step_factor")


def _swap_presets(job: dict, presets: dict) -> None:
    """The dry run's stand-ins (e.g. llama2-7b → toy), in the job's points and its sweep grid."""
    def swap(point):
        if point.get("preset") in presets:
            point.update(presets[point["preset"]])
    swap(job["point"])
    for point in job.get("points") or []:
        swap(point)
    grid = (job.get("sweep") or {}).get("grid") or {}
    if grid.get("preset") in presets:
        grid.update(presets[grid["preset"]])


def points_of(job: dict, new: int | None = None) -> list[dict]:
    """The job's points, each over the job's shared parameters (and `new` when fit_new chose it)."""
    extra = {"new": new} if new else {}
    return [{**job["point"], **point, **extra} for point in job.get("points") or []]


def warmups_of(job: dict) -> list[dict]:
    return [{**job["point"], **point} for point in job.get("warmup") or []]


def sweep_grid_items(job: dict) -> list[str]:
    """The job's sweep grid as `--grid` items; an empty value (e.g. a dry run's `overrides: ""`) is `none`,
    which the sweep reads as None (no overrides), since --grid takes no empty value."""
    items = []
    for key, value in (job["sweep"].get("grid") or {}).items():
        values = value if isinstance(value, list) else [value]
        items.append(f"{key}=" + ",".join("none" if v in ("", None) else str(v) for v in values))
    return items


def sweep_points(job: dict) -> list[dict]:
    """The points a sweep job will run: its command's --grid items over its file, as `python -m kvlab sweep`
    merges and expands them."""
    from .lab.grid import expand, load_sweep, merge_grid_items
    fixed, grid = load_sweep(job["sweep"]["file"]) if job["sweep"].get("file") else ({}, {})
    return expand(*merge_grid_items(fixed, grid, sweep_grid_items(job)))


def sweep_command(job: dict, out: Path) -> list[str]:
    command = [sys.executable, "-m", "kvlab", "sweep"]
    if job["sweep"].get("file"):
        command.append(str(job["sweep"]["file"]))
    for item in sweep_grid_items(job):
        command += ["--grid", item]
    return command + ["--out", str(out)]


# -- estimates -----------------------------------------------------------------------------------
def point_seconds(point: dict, step_s: float, start_s: float) -> float:
    """What a point costs: its decoding steps (twice with the live-storage counter, which also runs a timed
    run without it), plus a process start for a reference point (its release runs in a subprocess)."""
    steps = int(point.get("new", DEFAULTS["new"])) + int(point.get("restart_new", 0))
    factor = 2.0 if point.get("track_storages") in (True, "true", "True") else 1.0
    return 2.0 + steps * step_s * factor + (start_s if point.get("kind") == "reference" else 0.0)


def job_seconds(job: dict, step_s: float, start_s: float, new: int | None = None) -> float:
    if job.get("sweep"):  # each sweep point: a fresh kernel, imports and a model build
        return sum(start_s + point_seconds(point, step_s, 0) for point in sweep_points(job))
    points = points_of(job, new) + warmups_of(job)
    builds = any(point.get("kind", "kvlab") == "kvlab" for point in points)  # the worker builds a model once
    return start_s * builds + sum(point_seconds(point, step_s, start_s) for point in points)


def fit_new(job: dict, seconds_left: float, step_s: float, start_s: float) -> int | None:
    """The most new tokens per point that fit the time left (None when fewer than fit_new.min fit)."""
    fit = job["fit_new"]
    step = step_s * fit.get("step_factor", 1.0)
    fixed = job_seconds(job, 0.0, start_s, new=1)  # starts and per-point costs without the decoding
    points = len(job["points"])
    new = min(fit["max"], int((seconds_left - fixed) / (points * step))) if step > 0 else fit["max"]
    new -= new % fit.get("multiple", 1)
    return new if new >= fit.get("min", 1) else None


# -- running ---------------------------------------------------------------------------------------
class Run:
    """One run of a plan: the clock, the log, the results table, and what was skipped, killed or failed."""

    def __init__(self, plan: dict, out: Path, command: str):
        self.plan, self.out, self.command = plan, out, command
        self.t0 = time.time()
        self.end = self.t0 + plan["budget_s"] - plan["reserve_s"]
        self.step_s = float(plan["step_s"])
        self.lock = threading.Lock()  # the log and the results file, written from several lane threads
        self.events: list[str] = []  # skipped, killed, failed: for the summary
        self.counts: dict[str, int] = {}
        self.work = Path(tempfile.mkdtemp(prefix="kvlab-plan-"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.log").touch()  # a rerun into the same folder (a resume) appends
        # Each sweep job's folder (its results.csv is what its sweep resumes from) lives in OUT/sweep while the
        # plan runs; finish() packs it into sweep.tar.gz, which a rerun unpacks (a killed run leaves the folder).
        self.sweeps = out / "sweep"
        if (out / "sweep.tar.gz").exists() and not self.sweeps.exists():
            with tarfile.open(out / "sweep.tar.gz") as archive:
                archive.extractall(out, filter="data")

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log(self, message: str, event: bool = False) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
        line = f"[{stamp} +{self.elapsed():.0f}s] {message}"
        with self.lock:
            print(line, flush=True)
            with open(self.out / "run.log", "a") as handle:
                handle.write(line + "\n")
            if event:
                self.events.append(message)

    def add_row(self, row: dict, job: dict) -> None:
        from .lab.store import append_row
        row = dict(row, job=job["name"], lane=job["lane"], phase=job["phase"])
        with self.lock:
            append_row(self.out / "results.csv", row)
            self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        self.log(f"  [{job['name']}] {describe(row)}", event=row["status"] != "ok")
        if row["status"] == "ok" and row.get("seconds") and row.get("new"):  # plan the rest on what was seen
            steps = int(row["new"]) + int(row.get("restart_new") or 0)
            self.step_s = max(self.step_s, float(row["seconds"]) / steps)

    def run(self) -> None:
        import torch
        self.log(f"plan {self.plan['name']} ({'dry run, CPU' if self.plan['dry_run'] else 'as written'}): budget "
                 f"{self.plan['budget_s']}s, {self.step_s * 1000:.0f} ms per step assumed; results in {self.out}")
        (self.out / "env.txt").write_text(environment_report())
        stop = threading.Event()
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            threading.Thread(target=self._watch_gpu, args=(stop,), daemon=True).start()
        try:
            for phase in self.plan["phases"]:
                self.run_phase(phase, self.end - phase.get("ends_before_s", 0))
        finally:
            stop.set()
            self.finish()

    def run_phase(self, phase: dict, deadline: float) -> None:
        lanes: dict[str, list[dict]] = {}
        for job in phase["jobs"]:
            lanes.setdefault(job["lane"], []).append(job)
        if not lanes:
            return
        parallel = lanes_at_once(self.plan, len(lanes), self.log)
        self.log(f"phase {phase['name']}: {len(lanes)} lane(s), {parallel} at a time, until "
                 f"+{deadline - self.t0:.0f}s")
        gate = threading.Semaphore(parallel)

        def lane(jobs):
            with gate:
                for job in jobs:
                    self.run_job(job, deadline)

        threads = [threading.Thread(target=lane, args=(jobs,)) for jobs in lanes.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run_job(self, job: dict, deadline: float) -> None:
        left = deadline - time.time()
        new = None
        if job.get("fit_new"):
            new = fit_new(job, left, self.step_s, self.plan["start_s"])
            if new is None:
                self.log(f"SKIPPED {job['name']}: too little time left ({left:.0f}s) for fit_new.min", event=True)
                return
        estimate = job_seconds(job, self.step_s, self.plan["start_s"], new)
        if estimate > left:
            self.log(f"SKIPPED {job['name']}: needs ≈{estimate:.0f}s, {left:.0f}s left in its phase", event=True)
            return
        self.log(f"START {job['name']} (lane {job['lane']}, ≈{estimate:.0f}s{f', new={new}' if new else ''}, "
                 f"{left:.0f}s left)")
        if job.get("sweep"):
            folder = self.sweeps / job["name"]
            done_before = done_point_ids(folder / "results.csv")  # its sweep skips these; not gathered again
            command = sweep_command(job, folder)
        else:
            spec = dict(points=points_of(job, new), warmup=warmups_of(job), deadline=deadline,
                        step_s=self.step_s, start_s=self.plan["start_s"], done=sorted(self.done()))
            spec_path = self.work / f"{job['name']}.json"
            spec_path.write_text(json.dumps(spec, default=str))
            command = [sys.executable, "-m", "kvlab.plan", "--worker", str(spec_path)]
        started = time.time()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   cwd=ROOT, env=worker_environment(job))
        timer = threading.Timer(max(1.0, deadline - time.time()), self.kill, (process, job))
        timer.start()
        for line in process.stdout:
            line = line.rstrip("\n")
            if line.startswith(ROW):
                self.add_row(json.loads(line[len(ROW):]), job)
            elif line.strip() and "\r" not in line:  # progress bars redraw with \r: not for the log
                self.log(f"  [{job['name']}] {line[-400:]}", event=line.startswith("SKIPPED"))
        process.wait()
        timer.cancel()
        if job.get("sweep"):
            self.gather_sweep(job, folder, done_before)
        if process.returncode not in (0, -9, -15):
            self.log(f"FAILED {job['name']}: exit status {process.returncode} (see run.log)", event=True)
        self.log(f"END {job['name']}: exit {process.returncode} after {time.time() - started:.0f}s")

    def done(self) -> set[str]:
        return done_point_ids(self.out / "results.csv")

    def kill(self, process: subprocess.Popen, job: dict) -> None:
        """At the phase's deadline: the job's process and everything it started (a papermill kernel too)."""
        import psutil
        if process.poll() is not None:
            return
        self.log(f"KILLED {job['name']}: still running at its phase's deadline (+{self.elapsed():.0f}s)", event=True)
        try:
            tree = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):  # it may have ended by itself meanwhile
                member.terminate()
        _, alive = psutil.wait_procs(tree, timeout=3)
        for member in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()

    def gather_sweep(self, job: dict, folder: Path, done_before: set[str]) -> None:
        """The rows this call's sweep wrote into the plan's results table (the sweep's own table goes into
        sweep.tar.gz); the points it skipped as ok already are in the plan's table from an earlier call."""
        from .lab.store import load_results
        if (folder / "results.csv").exists():
            table = load_results(folder)
            for row in table.astype(object).where(table.notna(), None).to_dict("records"):
                if row["point_id"] not in done_before:
                    self.add_row(row, job)

    def finish(self) -> None:
        from .lab.store import record_run
        if self.sweeps.exists():
            with tarfile.open(self.out / "sweep.tar.gz", "w:gz") as archive:
                archive.add(self.sweeps, arcname="sweep")
            shutil.rmtree(self.sweeps)
        shutil.rmtree(self.work, ignore_errors=True)
        if self.counts:
            from .models import resolve_device
            device = next((job["point"].get("device", "auto") for phase in self.plan["phases"]
                           for job in phase["jobs"]), "auto")
            from .lab.store import STATUSES
            record_run(self.out, self.command, sum(self.counts.values()), {**dict.fromkeys(STATUSES, 0), **self.counts},
                       datetime.datetime.fromtimestamp(self.t0, datetime.timezone.utc), resolve_device(device),
                       plan=self.plan["path"], dry_run=self.plan["dry_run"])
        from .plan_summary import write_summary
        write_summary(self.plan, self.out, self.events, self.elapsed(), [data_path(s["path"]) for s in
                                                                           self.plan["compare_with"]])
        self.log(f"done in {self.elapsed():.0f}s; files: {' '.join(sorted(p.name for p in self.out.iterdir()))}")

    def _watch_gpu(self, stop: threading.Event) -> None:
        """Every 30 s, the memory all lanes use together (an OOM in run.log is then explained)."""
        while not stop.wait(30):
            used = _nvidia_smi("memory.used,memory.total,utilization.gpu")
            self.log(f"gpu: {used}")


def _nvidia_smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def lanes_at_once(plan: dict, lanes: int, log=print) -> int:
    """`parallel` of the plan; auto: as many lanes as the free GPU memory holds (nvidia-smi, so that this
    process never holds a CUDA context of its own), or every lane on a CPU."""
    if plan["parallel"] != "auto":
        return min(lanes, plan["parallel"])
    if not shutil.which("nvidia-smi"):
        return lanes
    output = _nvidia_smi("memory.free")
    free_mib = free_memory_mib(output)
    if free_mib is None:  # e.g. "[N/A]" on a MIG slice: one lane is always safe
        log(f"parallel auto: cannot read free GPU memory from nvidia-smi ({output!r}); one lane at a time")
        return 1
    return max(1, min(lanes, free_mib // 1024 // plan["gib_per_lane"]))


def free_memory_mib(output: str) -> int | None:
    """The first GPU's free MiB from `nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits`;
    None when it is not a number (empty, "[N/A]" under MIG, an error message)."""
    try:
        return int(output.split()[0])
    except (IndexError, ValueError):
        return None


def worker_environment(job: dict) -> dict:
    """This kvlab first on the worker's path; one OpenMP thread on a CPU (threads spinning against the other
    lanes make every matmul slower, and memory does not depend on them)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    if str(job["point"].get("device", "cpu")).startswith("cpu"):
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def describe(row: dict) -> str:
    point = (f"{row.get('kind')} {row.get('preset')}{'(' + row['overrides'] + ')' if row.get('overrides') else ''} "
             f"{row.get('cache')}/{row.get('loop')} b{row.get('batch')} p{row.get('prompt')} n{row.get('new')}")
    if row["status"] != "ok":
        return f"{row['status']}: {point}: {str(row.get('error'))[:300]}"
    return (f"ok: {point}: overhead {int(row['overhead_bytes']) / 2**20:.2f} MiB = {row.get('overhead_over_kv')} x KV"
            f", {row.get('tokens_per_s') or '-'} tokens/s")


# -- the worker: one process, one job's points ----------------------------------------------------------
def work(spec: dict) -> None:
    """Measure the job's points in order, one model build per model; print one row line per point."""
    import torch

    from .lab.point import measure
    from .models import build_model
    from .lab.runner import mark_failed, new_row
    from .lab.grid import point_id
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    built, model, step_s = None, None, spec["step_s"]
    for warmup, point in [(True, p) for p in spec["warmup"]] + [(False, p) for p in spec["points"]]:
        params = normalize(**point)  # checked by the orchestrator already; here for the defaults
        key = point_id(params)
        what = f"{params['kind']} {params['cache']}/{params['loop']} n{params['new']}"
        if not warmup and key in spec["done"]:
            print(f"{what}: already ok in results.csv ({key}), not run again", flush=True)
            continue
        need, left = point_seconds(params, step_s, spec["start_s"]), spec["deadline"] - time.time()
        if need > left:
            print(f"SKIPPED {what}: needs ≈{need:.0f}s, {left:.0f}s left", flush=True)
            continue
        clock = time.perf_counter()
        row = new_row(params)  # a sweep point's columns, so that both tables read alike
        try:
            if params["kind"] == "kvlab" and built != _model_key(params):
                model, built = None, None
                gc.collect()
                model = build_model(*_model_key(params))
                built = _model_key(params)
            elif params["kind"] == "reference" and model is not None:  # its own process builds its own copy
                model, built = None, None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            record, _ = measure(model if params["kind"] == "kvlab" else None, **params)
            row.update(record, status="ok", error=None)
        except Exception as error:  # a failed point is a row, not the end of the job
            traceback.print_exc()
            row = mark_failed(row, type(error).__name__, str(error))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row["elapsed_s"] = round(time.perf_counter() - clock, 2)
        if row["status"] == "ok" and row.get("seconds"):  # plan the next point on what this one took
            step_s = max(step_s, row["seconds"] / (params["new"] + params["restart_new"]))
        if warmup:
            print(f"warmup {what}: {row['status']} in {row['elapsed_s']}s", flush=True)
        else:
            print(ROW + json.dumps(row, default=str), flush=True)
        gc.collect()


def _model_key(params: dict) -> tuple:
    """build_model's arguments: points that share them share one model."""
    return tuple(params[key] for key in ("preset", "overrides", "device", "dtype", "seed"))


# -- the machine -----------------------------------------------------------------------------------
def environment_report() -> str:
    """What env.txt holds: the machine, the GPU, and the version and origin of every package a run needs."""
    import importlib

    import torch
    lines = ["== uname", " ".join(platform.uname()), "== python", sys.version]
    for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "numpy", "pandas", "kvlab", "papermill",
                 "ipykernel", "nbformat", "jupyter_client", "zmq", "psutil", "filelock"):
        try:
            module = importlib.import_module(name)
            lines.append(f"{name:16s} {getattr(module, '__version__', '?'):14s} {getattr(module, '__file__', '')}")
        except Exception as error:  # a missing package is reported, not fatal: the points that need it fail
            lines.append(f"{name:16s} MISSING ({type(error).__name__}: {error})")
    lines.append(f"cuda available: {torch.cuda.is_available()} | torch.version.cuda: {torch.version.cuda}")
    if shutil.which("nvidia-smi"):
        lines += ["== nvidia-smi", subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout]
    from .lab.reference import RELEASES
    for version, (target, _) in RELEASES.items():
        installed = (target / f"transformers-{version}.dist-info").exists()
        lines.append(f"transformers {version} for reference points: {'in ' + str(target) if installed else 'absent'}")
    return "\n".join(lines) + "\n"


# -- command line ------------------------------------------------------------------------------------
def list_plan(plan: dict) -> str:
    """The jobs of each phase with their estimates and deadlines (the --list output)."""
    end = plan["budget_s"] - plan["reserve_s"]
    lines = [f"plan {plan['name']}{' (dry run)' if plan['dry_run'] else ''}: budget {plan['budget_s']}s, "
             f"{plan['step_s'] * 1000:.0f} ms per step and {plan['start_s']}s per process assumed"]
    for phase in plan["phases"]:
        lines.append(f"phase {phase['name']}: until +{end - phase.get('ends_before_s', 0):.0f}s")
        for job in phase["jobs"]:
            new = job["fit_new"]["max"] if job.get("fit_new") else None
            if job.get("sweep"):
                what = f"sweep, {len(sweep_points(job))} points"
            else:
                what = ", ".join(f"{p.get('kind', 'kvlab')}:{p['cache']}/{p['loop']}"
                                 f"{'+storages' if p.get('track_storages') is True else ''}" for p in points_of(job))
            fit = f" (new fitted to the time left, at most {new})" if new else ""
            lines.append(f"  lane {job['lane']:8s} {job['name']:26s} ≈{job_seconds(job, plan['step_s'], plan['start_s'], new):5.0f}s"
                         f"  {what}{fit}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    shipped = ", ".join(sorted(p.stem for p in PLANS_DIR.glob("*.yaml")))
    parser = argparse.ArgumentParser(prog="python -m kvlab plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", nargs="?", help=f"plan YAML, a path or one of: {shipped}")
    parser.add_argument("--out", help="results folder (default: results/plan-<name>)")
    parser.add_argument("--dry-run", action="store_true", help="the plan's CPU stand-in: toy preset, tiny sizes")
    parser.add_argument("--list", action="store_true", help="print the jobs, estimates and deadlines; run nothing")
    parser.add_argument("--only", default="", help="comma-separated job-name prefixes to run (e.g. a-,d-)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the plan's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        work(json.loads(Path(args.worker).read_text()))
        return
    try:
        if not args.plan:
            raise ValueError("name a plan file")
        only = [prefix for prefix in args.only.split(",") if prefix]
        out = Path(args.out or Path("results") / f"plan-{plan_file(args.plan).stem}")
        plan = load_plan(args.plan, dry_run=args.dry_run, only=only, devices_here=not args.list)
        if args.budget is not None:
            if args.budget <= plan["reserve_s"]:
                raise ValueError(f"--budget {args.budget:.0f}s leaves nothing after the {plan['reserve_s']}s reserve")
            plan["budget_s"] = args.budget
        if args.list:
            print(list_plan(plan))
            return
        command = " ".join(["python -m kvlab plan", *(argv if argv is not None else sys.argv[1:])])
        Run(plan, out, command).run()
    except ValueError as error:
        print(f"kvlab plan: error: {error}", file=sys.stderr)
        sys.exit(2)



if __name__ == "__main__":
    main()
