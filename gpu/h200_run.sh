#!/usr/bin/env bash
# One prepared device call on the lent H200 (one call of at most ~8 minutes, see shared/DESIGN.md §2, §5):
#
#   (a) ±3 % check: transformers 4.40.1's own generate() vs kvlab's v4.40 loop with the tuple cache
#       on llama2-7b and mistral-7b, bf16, batch 8, prompt 300, 500 new tokens;
#   (b) dynamic, prealloc, static, list and transformers' own generate() (its default DynamicCache) on
#       those two points;
#   (c) a budget-sized subset of the shipped sweep kvlab/sweeps/pr-batch.yaml, through `python -m kvlab.sweep`
#       (papermill, one fresh kernel per point; the executed notebooks come back in sweep.tar.gz);
#   (d) prealloc vs dynamic tokens/s side by side, alone on the GPU, at the longest generation the time
#       left affords;
#   (e) one full point with the live-storage meter (track_storages=True) next to the CUDA allocator.
#
# Usage, in the repo root:
#   OUT=/some/dir gpu/h200_run.sh               on the GPU node (needs the wheelhouse, see docs/offline-gpu.md)
#   OUT=/tmp/gpu-dry DRY_RUN=1 gpu/h200_run.sh  the same script on CPU: toy preset, tiny sizes (also: --cpu)
#
# Environment: OUT (required), DRY_RUN=1, BUDGET_S (seconds for the whole script, default 450 on the GPU),
# WHEELHOUSE (default wheelhouse), SITE (default /tmp/site), PYTHON (default python3; dry run: .venv/bin/python),
# STEP_S (seconds per decoding step assumed for planning, default 0.09 on the GPU), PLAN=1 (print the plan and
# its estimates, run nothing; works on any machine), SWEEP_ARGS (replaces the
# `python -m kvlab.sweep` arguments of step c), SPEED_MAX_NEW (cap on step d's new tokens), MAX_PARALLEL (lanes
# run at once), ONLY (comma-separated job-name prefixes to run, e.g. ONLY=a-emu,c-sweep,d; the rest is skipped).
#
# Everything lands in $OUT, flat, at most 8 files: run.log, env.txt, records.jsonl, records.csv, summary.md,
# sweep_results.csv, sweep.tar.gz. Every job is checked against the clock before it starts and killed at its
# phase's deadline; what was skipped or killed is in run.log and summary.md. The script ends by itself
# before BUDGET_S.
#
# Budget arithmetic (GPU; DESIGN §2: 75-90 ms per decoding step at batch 8 with transformers' generate(),
# step time is set by kernel launches, not by batch or cache size, so a 500-step point is ≈ 45 s):
#   install ≈ 10 s, GPU check ≈ 10 s
#   phase 1 (until BUDGET_S - 140 s = 310 s): five lanes in parallel, each its own process(es) on the one
#     GPU. The allocator counters are per process, so memory numbers do not disturb each other; speed does
#     (tokens/s of phase 1 is indicative only). GPU memory: ≈ 19 + 19 + 17 + 15 + 26 GiB ≈ 96 GiB of 139.
#     ref      4.40.1 llama2 (≈ 12 s start + 45 s), 4.40.1 mistral (≈ 57 s)                       ≈ 115 s
#     emu      v4.40 tuple emulation llama2, mistral (2 × ≈ 50 s); (e) llama2 tuple/v4.40 with track_storages,
#              live-storage counting in Python at every aten op: ≈ 2 × slower (≈ 90 s)            ≈ 200 s
#     llama2   hf generate(), dynamic, prealloc, static, list: 15 s build + 5 × ≈ 47 s          ≈ 250 s
#     mistral  the same five                                                                    ≈ 250 s
#     sweep    `python -m kvlab.sweep` on pr-batch.yaml with --grid preset=llama2-7b batch=24 new=200: 5 designs, each
#              ≈ 18 s (fresh kernel, import, 7B build) + 200 × 0.09 s; 24 × 500 cached tokens = the
#              cache of pr-batch's batch 5 × 2300 tokens, reached in a tenth of the steps        ≈ 190 s
#   phase 2 (d) alone, until BUDGET_S - 20 s: llama2-7b, batch 128, prompt 300, N new tokens, N from the
#     time left and the step time phase 1 saw (≈ 120 s, ≈ 0.1-0.15 s per step → N ≈ 300-450; ≤ 1200 so that
#     128 × 1500 tokens × 0.5 MiB ≈ 94 GiB of cache fits). The dynamic cache copies the whole cache every
#     step (128 × 750 tokens ≈ 47 GiB at the end: ≈ 20 ms of copying per step at 4.8 TB/s), prealloc writes
#     one token; the batch is large so that the copies are not hidden behind the ≈ 80 ms of kernel launches
#     of an eager step. 2 × N steps ≈ 2 × 45 s.
#   final ≈ 5 s: records.csv, summary.md, sweep.tar.gz
# Full PR-sized sweeps (pr-batch: 75 points of 2000 steps ≈ 2 h) do not fit a 15-minute lease.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[[ "${1:-}" == "--cpu" ]] && DRY_RUN=1
DRY_RUN=${DRY_RUN:-0}
if [[ -z "${OUT:-}" ]]; then
    echo "h200_run: set OUT to the folder that receives the results" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/run.log"
: > "$LOG"
T0=$(date +%s)
export KVRUN_T0=$T0
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

if [[ "$DRY_RUN" == 1 ]]; then
    BUDGET_S=${BUDGET_S:-300}
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
    fi
else
    BUDGET_S=${BUDGET_S:-450}
    PYTHON=${PYTHON:-python3}
fi
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
SITE=${SITE:-/tmp/site}
LEGACY_TARGET="$ROOT/.legacy-tf"  # kvlab.reference.DEFAULT_TARGET for the kvlab of this checkout
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvrun.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export KVRUN_DRY_RUN=$DRY_RUN KVRUN_BUDGET_S=$BUDGET_S KVRUN_OUT=$OUT KVRUN_WORK=$WORK KVRUN_LOG=$LOG
export KVRUN_LEGACY_TARGET=$LEGACY_TARGET KVRUN_PYTHON=$PYTHON
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
export JUPYTER_PLATFORM_DIRS=1 JUPYTER_RUNTIME_DIR="$WORK/jupyter-runtime" MPLBACKEND=Agg
log "h200_run: DRY_RUN=$DRY_RUN BUDGET_S=$BUDGET_S OUT=$OUT python=$PYTHON commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"

PLAN=${PLAN:-0}
if [[ "$PLAN" != 1 ]]; then  # PLAN=1: print the plan (GPU or dry-run sizes, estimates, deadlines), run nothing
# -- 1. wheels ---------------------------------------------------------------------------------------
# The lock's pins, each exactly once in the wheelhouse (two versions of one package stop pip's install).
check_wheelhouse() {
    "$PYTHON" - "$WHEELHOUSE" "$ROOT/scripts/wheelhouse.lock" <<'PY'
import re, sys
from pathlib import Path
house, lock = Path(sys.argv[1]), Path(sys.argv[2])
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
section, pins = None, {"kernel": [], "legacy": []}
for line in lock.read_text().splitlines():
    line = line.split("#")[0].strip()
    if line.startswith("["):
        section = line.strip("[]")
    elif line:
        pins[section].append(line)
problems = []
for section, folder in (("kernel", house), ("legacy", house / "legacy")):
    found = {}
    for wheel in folder.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        found.setdefault(norm(name), []).append(version)
    for pin in pins[section]:
        name, version = pin.split("==")
        if found.get(norm(name)) != [version]:
            problems.append(f"{pin}: found {found.get(norm(name), 'nothing')}")
    if section == "kernel" and len(found.get("kvlab", [])) != 1:
        problems.append(f"kvlab: found {found.get('kvlab', 'nothing')}")
print("wheelhouse matches the lock" if not problems else "wheelhouse does NOT match the lock: " + "; ".join(problems))
sys.exit(1 if problems else 0)
PY
}
if [[ "$DRY_RUN" == 1 ]]; then
    if [[ -d "$WHEELHOUSE" ]]; then
        check_wheelhouse 2>&1 | tee -a "$LOG"
    fi
    log "dry run: no install (the wheels are for CPython 3.12 manylinux; $PYTHON has what it needs)"
    if [[ ! -d "$LEGACY_TARGET/transformers-4.40.1.dist-info" ]]; then
        log "dry run: $LEGACY_TARGET has no transformers 4.40.1 (make legacy): the 4.40.1 jobs will be skipped"
    fi
else
    # Before anything is installed: never overwrite this checkout's .legacy-tf on a machine without a GPU.
    if ! nvidia-smi -L >>"$LOG" 2>&1 \
        && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >>"$LOG" 2>&1; then
        log "FATAL: no NVIDIA GPU here (nvidia-smi -L and torch.cuda both say none); on a CPU use DRY_RUN=1"
        exit 1
    fi
    if ! check_wheelhouse 2>&1 | tee -a "$LOG"; then
        log "FATAL: build the wheelhouse with scripts/build_wheelhouse.sh and carry it"
        exit 1
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELHOUSE"/*.whl >>"$LOG" 2>&1 \
        && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$LEGACY_TARGET" "$WHEELHOUSE"/legacy/*.whl >>"$LOG" 2>&1
    status=$?
    if (( status != 0 )); then
        log "FATAL: pip install from $WHEELHOUSE failed (status $status), see above"
        exit 1
    fi
    log "installed $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels into $SITE, $(ls "$WHEELHOUSE"/legacy/*.whl | wc -l) into $LEGACY_TARGET"
    export PATH="$SITE/bin:$PATH"
fi
# This checkout's kvlab first (not the wheel's copy, which may be older), then the carried wheels.
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# -- 2. the machine ----------------------------------------------------------------------------------
{
    echo "== uname"; uname -a
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    echo "== python"; "$PYTHON" - <<'PY' 2>&1
import importlib, sys
print(sys.version)
for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "numpy", "pandas", "kvlab", "papermill",
             "ipykernel", "nbformat", "jupyter_client", "zmq"):
    try:
        module = importlib.import_module(name)
        print(f"{name:16s} {getattr(module, '__version__', '?'):14s} {getattr(module, '__file__', '')}")
    except Exception as error:
        print(f"{name:16s} MISSING ({type(error).__name__}: {error})")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch.version.cuda:", torch.version.cuda)
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print("device:", torch.cuda.get_device_name(0), f"| free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
PY
    echo "== legacy target"; ls "$LEGACY_TARGET" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >> "$LOG"
if [[ "$DRY_RUN" != 1 ]] && ! grep -q "^cuda available: True" "$OUT/env.txt"; then
    log "FATAL: torch sees no CUDA GPU (env.txt)"
    exit 1
fi
log "machine checked: $(grep -E '^(device|cuda available)' "$OUT/env.txt" | tr '\n' ' ')"

fi
# -- 3. the measurements -----------------------------------------------------------------------------
cat > "$WORK/kvrun.py" <<'PY'
"""Orchestrator (lanes of jobs against a clock) and worker (one process, several points) for h200_run.sh."""
import csv, gc, json, os, signal, subprocess, sys, threading, time, traceback
from pathlib import Path

ENV = os.environ
T0 = float(ENV["KVRUN_T0"])
DRY = ENV["KVRUN_DRY_RUN"] == "1"
BUDGET = float(ENV["KVRUN_BUDGET_S"])
OUT, WORK, PY = Path(ENV["KVRUN_OUT"]), Path(ENV["KVRUN_WORK"]), ENV["KVRUN_PYTHON"]
LEGACY_TARGET = Path(ENV["KVRUN_LEGACY_TARGET"])
STEP_S = float(ENV.get("STEP_S") or (0.02 if DRY else 0.09))  # planning estimate per decoding step
START_S = 6.0 if DRY else 15.0  # a new process: imports + model build
GIB = 2**30
UNIT, UNIT_NAME = (2**20, "MiB") if DRY else (GIB, "GiB")


def elapsed():
    return time.time() - T0


_lock = threading.Lock()


def log(message):
    line = f"[{time.strftime('%H:%M:%S', time.gmtime())} +{elapsed():.0f}s] {message}"
    with _lock:
        print(line, flush=True)
        with open(ENV["KVRUN_LOG"], "a") as handle:
            handle.write(line + "\n")


def add_record(record):
    with _lock, open(OUT / "records.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")


# -- the plan ----------------------------------------------------------------------------------------
if DRY:  # the same plan on CPU in seconds: toy (MHA) stands in for llama2-7b, toy with GQA for mistral-7b
    MODELS = {"llama2-7b": dict(preset="toy", overrides=""),
              "mistral-7b": dict(preset="toy", overrides="num_key_value_heads=2")}
    CHECK = dict(device="cpu", dtype="float32", batch=2, prompt=8, new=8)
    SWEEP = ["--file", "pr-batch", "--grid", "preset=toy", "--grid", "device=cpu", "--grid", "dtype=float32",
             "--grid", "batch=2", "--grid", "prompt=8", "--grid", "new=4"]
    SPEED = dict(preset="toy", overrides="", device="cpu", dtype="float32", batch=4, prompt=8, max_new=64)
    SWEEP_POINTS = 5
else:
    MODELS = {"llama2-7b": dict(preset="llama2-7b", overrides=""),
              "mistral-7b": dict(preset="mistral-7b", overrides="")}
    CHECK = dict(device="cuda", dtype="bfloat16", batch=8, prompt=300, new=500)
    SWEEP = ["--file", "pr-batch", "--grid", "preset=llama2-7b", "--grid", "batch=24", "--grid", "new=200"]
    SPEED = dict(preset="llama2-7b", overrides="", device="cuda", dtype="bfloat16", batch=128, prompt=300,
                 max_new=1200)  # 128 x 1500 x 0.5 MiB = 94 GiB of cache at most
    SWEEP_POINTS = 5
if ENV.get("SPEED_MAX_NEW"):
    SPEED["max_new"] = int(ENV["SPEED_MAX_NEW"])
if ENV.get("SWEEP_ARGS"):
    SWEEP = ENV["SWEEP_ARGS"].split()
FINAL_RESERVE = 20.0  # summary, archive
SPEED_RESERVE = 120.0  # phase 2
PHASE1_END = BUDGET - FINAL_RESERVE - (SPEED_RESERVE if not DRY else 60.0)
PHASE2_END = BUDGET - FINAL_RESERVE


def point_seconds(point):
    factor = 2.0 if point.get("track_storages") is True else 1.0
    return 2.0 + point["new"] * STEP_S * factor


def worker_job(name, step, model, points, lane):
    spec = dict(model=MODELS[model] if isinstance(model, str) else model, check=CHECK, points=points)
    return dict(name=name, step=step, lane=lane, spec=spec,
                est=START_S + sum(point_seconds({**CHECK, **p}) for p in points))


def plan():
    lanes = {"ref": [], "emu": [], "llama2": [], "mistral": [], "sweep": []}
    for model in MODELS:
        lanes["ref"].append(worker_job(f"a-ref-4.40.1-{model}", "a", model, [dict(kind="reference", label=model)],
                                       "ref"))
        lanes["emu"].append(worker_job(f"a-emu-legacy-{model}", "a", model,
                                       [dict(kind="kvlab", cache="tuple", loop="v4.40", label=model)], "emu"))
    lanes["emu"].append(worker_job("e-storages-llama2-7b", "e", "llama2-7b",
                                   [dict(kind="kvlab", cache="tuple", loop="v4.40", track_storages=True,
                                         label="llama2-7b")], "emu"))
    for model, lane in (("llama2-7b", "llama2"), ("mistral-7b", "mistral")):
        points = [dict(kind="hf_generate", label=model)] + [
            dict(kind="kvlab", cache=cache, loop="v5", label=model)
            for cache in ("dynamic", "prealloc", "static", "list")]
        lanes[lane].append(worker_job(f"b-designs-{model}", "b", model, points, lane))
    sweep_est = SWEEP_POINTS * (START_S + 5 + 200 * STEP_S) if not DRY else 30.0
    lanes["sweep"].append(dict(name="c-sweep", step="c", lane="sweep", est=sweep_est,
                               cmd=[PY, "-m", "kvlab.sweep", *SWEEP, "--out", str(WORK / "sweep")]))
    only = [name for name in ENV.get("ONLY", "").split(",") if name]
    if only:  # e.g. ONLY=b-designs-llama2-7b,c-sweep: the tests run a small part of the plan
        for lane, jobs in lanes.items():
            for job in jobs:
                if not any(job["name"].startswith(name) for name in only):
                    skipped.append(f"{job['name']}: not in ONLY={ENV['ONLY']}")
            lanes[lane] = [job for job in jobs if any(job["name"].startswith(name) for name in only)]
    return lanes


# -- running jobs ------------------------------------------------------------------------------------
skipped, killed, failed_jobs = [], [], []


def run_job(job, deadline):
    left = deadline - elapsed()
    if job["est"] > left:
        reason = f"needs ≈{job['est']:.0f}s, {left:.0f}s left before the phase deadline"
        skipped.append(f"{job['name']}: {reason}")
        log(f"SKIPPED {job['name']}: {reason}")
        return
    if "cmd" in job:
        cmd = job["cmd"]
    else:
        spec = dict(job["spec"], deadline=deadline, t0=T0, step=job["step"], job=job["name"], step_s=STEP_S)
        cmd = [PY, str(WORK / "kvrun.py"), "worker", json.dumps(spec)]
    log(f"START {job['name']} (lane {job['lane']}, est ≈{job['est']:.0f}s, {left:.0f}s left)")
    started = time.time()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                               start_new_session=True, cwd=str(WORK if "cmd" not in job else Path.cwd()))
    timer = threading.Timer(max(1.0, deadline - elapsed()), kill, (process, job))
    timer.start()
    for line in process.stdout:
        line = line.rstrip("\n")
        if line.startswith("RECORD "):
            record = json.loads(line[7:])
            add_record(record)
            log(f"  [{job['name']}] record: {short(record)}")
        elif line.strip() and "\r" not in line:
            log(f"  [{job['name']}] {line[-400:]}")
    process.wait()
    timer.cancel()
    if process.returncode != 0 and not any(k.startswith(job["name"] + ":") for k in killed):
        failed_jobs.append(f"{job['name']}: exit status {process.returncode} (see run.log)")
    log(f"END {job['name']}: exit {process.returncode} after {time.time() - started:.0f}s")


def descendants(pid):
    """Every process below `pid` (a papermill kernel runs in a session of its own, so killpg misses it)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill(process, job):
    if process.poll() is None:
        killed.append(f"{job['name']}: still running at its phase deadline (+{elapsed():.0f}s)")
        log(f"KILLING {job['name']} at the phase deadline")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in [process.pid] + descendants(process.pid):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(3)
            if process.poll() is not None and not descendants(process.pid):
                return


def short(r):
    if r.get("status") != "ok":
        return f"{r.get('label')} {r.get('cache')} {r.get('status')}: {str(r.get('error'))[:200]}"
    gib = lambda key: f"{r[key] / UNIT:.3f}" if isinstance(r.get(key), (int, float)) else "-"
    return (f"{r.get('label')} {r.get('cache')}/{r.get('loop')} b{r.get('batch')} p{r.get('prompt')} "
            f"n{r.get('new')}: overhead {gib('overhead_bytes')} {UNIT_NAME} = {r.get('overhead_over_kv')} x KV, "
            f"storages {gib('storages_peak_bytes')} {UNIT_NAME}, {r.get('tokens_per_s')} tok/s")


def free_gib():
    """Free GPU memory (nvidia-smi, so this process never holds a CUDA context); a phase-1 lane needs ≤ 24 GiB."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        return int(text.split()[0]) // 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 120


def run_lanes(lanes, deadline):
    parallel = int(ENV.get("MAX_PARALLEL") or (2 if DRY else min(len(lanes), max(1, free_gib() // 24))))
    if parallel < len(lanes):
        log(f"{len(lanes)} lanes, {parallel} at a time")
    gate = threading.Semaphore(parallel)

    def lane_thread(jobs):
        with gate:
            for job in jobs:
                run_job(job, deadline)

    threads = [threading.Thread(target=lane_thread, args=(jobs,)) for jobs in lanes.values() if jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def speed_job():
    """(d): prealloc vs dynamic, alone, N from the time left and the step time seen in phase 1."""
    left = PHASE2_END - elapsed()
    seen = [r["seconds"] / r["new"] for r in read_records()
            if r.get("status") == "ok" and r.get("step") == "b" and r.get("cache") in ("dynamic", "prealloc")
            and r.get("label") == "llama2-7b" and r.get("seconds")]
    step = max(seen) if seen else STEP_S  # phase 1 shared the GPU: an upper bound for a lone run at batch 8
    step *= 1.0 if DRY else 1.3  # batch 128 reads and (dynamic) copies a much larger cache each step
    budget = left - START_S - 10 - (2 * SPEED["prompt"] * SPEED["batch"] / 20000 if not DRY else 0)
    new = int(min(SPEED["max_new"], budget / (2 * step)) // 50 * 50) if not DRY else int(
        min(SPEED["max_new"], max(8, budget / (2 * step))))
    log(f"phase 2: {left:.0f}s left, step ≈{step * 1000:.0f} ms → {new} new tokens per cache")
    if new < (8 if DRY else 100):
        return None
    model = dict(preset=SPEED["preset"], overrides=SPEED["overrides"])
    point = dict(batch=SPEED["batch"], prompt=SPEED["prompt"], new=new, loop="v5", label=SPEED["preset"])
    points = [dict(point, kind="kvlab", cache="dynamic", new=4, warmup=True),
              dict(point, kind="kvlab", cache="prealloc"), dict(point, kind="kvlab", cache="dynamic")]
    spec_check = dict(device=SPEED["device"], dtype=SPEED["dtype"])
    job = dict(name=f"d-speed-b{SPEED['batch']}-n{new}", step="d", lane="speed",
               spec=dict(model=model, check=spec_check, points=points), est=START_S + 2 * (5 + new * step))
    return job


def print_plan():
    print(f"{'GPU' if not DRY else 'dry run'}: budget {BUDGET:.0f}s, phase 1 until +{PHASE1_END:.0f}s, phase 2 (d) "
          f"until +{PHASE2_END:.0f}s, {STEP_S * 1000:.0f} ms per step assumed; check point {CHECK}")
    for lane, jobs in plan().items():
        print(f"lane {lane}: ≈{sum(job['est'] for job in jobs):.0f}s")
        for job in jobs:
            what = " ".join(job["cmd"][3:]) if "cmd" in job else ", ".join(
                f"{p['kind']}:{p.get('cache', '')}{'+storages' if p.get('track_storages') else ''}"
                for p in job["spec"]["points"])
            print(f"  {job['name']:28s} ≈{job['est']:4.0f}s  {what}")
    print(f"phase 2: {SPEED}, new tokens from the time left")


def read_records():
    path = OUT / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def sweep_records():
    results = WORK / "sweep" / "results.csv"
    if not results.exists():
        return
    import shutil
    shutil.copy(results, OUT / "sweep_results.csv")
    with results.open(newline="") as handle:
        for row in csv.DictReader(handle):
            record = {key: _number(value) for key, value in row.items()}
            record.update(step="c", job="c-sweep", kind="kvlab", label=row.get("preset"))
            add_record(record)


def _number(text):
    if text in ("", None):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def gpu_monitor(stop):
    """Every 30 s, the GPU's memory in use by all lanes together (an OOM in run.log is then explained)."""
    while not stop.wait(30):
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
            log(f"gpu: {used.strip()}")
        except (OSError, subprocess.SubprocessError):
            return


def orchestrate():
    (OUT / "records.jsonl").write_text("")
    stop = threading.Event()
    if not DRY:
        threading.Thread(target=gpu_monitor, args=(stop,), daemon=True).start()
    log(f"phase 1 (a, b, c, e) until +{PHASE1_END:.0f}s; phase 2 (d) until +{PHASE2_END:.0f}s; "
        f"planning with {STEP_S * 1000:.0f} ms per step")
    run_lanes(plan(), PHASE1_END)
    sweep_records()
    only = [name for name in ENV.get("ONLY", "").split(",") if name]
    job = speed_job() if not only or any(name.startswith("d") for name in only) else None
    if job is None and only and not any(name.startswith("d") for name in only):
        skipped.append(f"d-speed: not in ONLY={ENV['ONLY']}")
    elif job is None:
        skipped.append("d-speed: too little time left for a useful run")
        log("SKIPPED d-speed: too little time left")
    else:
        run_lanes({"speed": [job]}, PHASE2_END)
    stop.set()
    write_summary()
    log("done")


# -- the summary -------------------------------------------------------------------------------------
def write_summary():
    import pandas as pd
    records = read_records()
    frame = pd.DataFrame(records)
    if not frame.empty:
        frame.to_csv(OUT / "records.csv", index=False)
    lines = [f"# h200_run {'DRY RUN (CPU, toy)' if DRY else 'GPU'}: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
             "", f"{len(records)} records, {elapsed():.0f}s of a {BUDGET:.0f}s budget. Sizes in {UNIT_NAME}; overhead = peak"
             " allocated above the post-load baseline.", ""]
    ok = [r for r in records if r.get("status") == "ok"]
    find = lambda **kw: [r for r in ok if all(r.get(k) == v for k, v in kw.items())]
    gib = lambda b: f"{b / UNIT:.4f}" if isinstance(b, (int, float)) else "-"

    lines += ["## (a) transformers 4.40.1 vs kvlab's tuple / v4.40 loop (±3 % check)", "",
              "| model | 4.40.1 overhead | emulation overhead | emulation / 4.40.1 − 1 | within ±3 % |",
              "|---|---|---|---|---|"]
    for model in MODELS:
        ref, emu = find(step="a", kind="reference", label=model), find(step="a", kind="kvlab", label=model)
        if ref and emu:
            error = emu[0]["overhead_bytes"] / ref[0]["overhead_bytes"] - 1
            lines.append(f"| {model} | {gib(ref[0]['overhead_bytes'])} | {gib(emu[0]['overhead_bytes'])} | "
                         f"{100 * error:+.2f} % | {'yes' if abs(error) <= 0.03 else 'NO'} |")
        else:
            lines.append(f"| {model} | {gib(ref[0]['overhead_bytes']) if ref else 'missing'} | "
                         f"{gib(emu[0]['overhead_bytes']) if emu else 'missing'} | - | - |")
    # shared/DESIGN.md §2, H200, same point: 4.40.1 generate(), 5.17 generate() (DynamicCache), 5.17 StaticCache
    design = {} if DRY else {("llama2-7b", "legacy-4.40.1"): 6.248, ("llama2-7b", "hf-generate"): 3.173,
                             ("llama2-7b", "static"): 3.343, ("mistral-7b", "legacy-4.40.1"): 1.661,
                             ("mistral-7b", "hf-generate"): 0.795, ("mistral-7b", "static"): 1.048}
    lines += ["", "## (a, b) every design at the check point", "",
              "| model | cache | loop | overhead | overhead / KV | predicted | DESIGN §2 | tokens/s (shared GPU) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(ok, key=lambda r: (str(r.get("label")), str(r.get("step")), str(r.get("cache")))):
        if r.get("step") in ("a", "b"):
            lines.append(f"| {r.get('label')} | {r.get('cache')} | {r.get('loop')} | {gib(r.get('overhead_bytes'))} | "
                         f"{r.get('overhead_over_kv', '-')} | {gib(r.get('predicted_overhead_bytes'))} | "
                         f"{design.get((r.get('label'), r.get('cache')), '-')} | {r.get('tokens_per_s', '-')} |")
    lines += ["", "## (c) sweep subset (`python -m kvlab.sweep " + " ".join(SWEEP) + "`)", "",
              "| cache | loop | batch | new | status | overhead | overhead / KV |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("step") == "c":
            lines.append(f"| {r.get('cache')} | {r.get('loop')} | {r.get('batch')} | {r.get('new')} | "
                         f"{r.get('status')} | {gib(r.get('overhead_bytes'))} | {r.get('overhead_over_kv', '-')} |")
    lines += ["", "## (d) prealloc vs dynamic, alone on the device", "",
              "| cache | batch | prompt | new | tokens/s | seconds | overhead |", "|---|---|---|---|---|---|---|"]
    speed = [r for r in find(step="d") if not r.get("warmup")]
    for r in speed:
        lines.append(f"| {r['cache']} | {r['batch']} | {r['prompt']} | {r['new']} | {r['tokens_per_s']} | "
                     f"{r['seconds']} | {gib(r['overhead_bytes'])} |")
    by_cache = {r["cache"]: r for r in speed}
    if {"prealloc", "dynamic"} <= set(by_cache):
        lines.append(f"\nprealloc / dynamic tokens/s = "
                     f"{by_cache['prealloc']['tokens_per_s'] / by_cache['dynamic']['tokens_per_s']:.3f}")
    lines += ["", "## (e) live-storage meter vs the allocator", "",
              "| point | allocator overhead | storages peak | storages / allocator | kv at peak | logits at peak |",
              "|---|---|---|---|---|---|"]
    for r in find(step="e"):
        ratio = (r["storages_peak_bytes"] / r["overhead_bytes"]) if r.get("storages_peak_bytes") else None
        lines.append(f"| {r['label']} {r['cache']}/{r['loop']} | {gib(r['overhead_bytes'])} | "
                     f"{gib(r.get('storages_peak_bytes'))} | {f'{ratio:.4f}' if ratio else '-'} | "
                     f"{gib(r.get('kv_at_peak_bytes'))} | {gib(r.get('logits_at_peak_bytes'))} |")
    failed = [r for r in records if r.get("status") not in ("ok", None)]
    lines += ["", "## Skipped, killed, failed", ""]
    lines += [f"- skipped {s}" for s in skipped] + [f"- killed {k}" for k in killed]
    lines += [f"- job failed {f}" for f in failed_jobs]
    lines += [f"- {r.get('status')} {r.get('job')} {r.get('label')} {r.get('cache')}: {str(r.get('error'))[:300]}"
              for r in failed]
    if not (skipped or killed or failed or failed_jobs):
        lines.append("- nothing")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")


# -- the worker: one process, one model, several points ----------------------------------------------
def worker(spec):
    deadline, t0 = spec["deadline"], spec["t0"]
    model_spec, check = spec["model"], spec["check"]
    model = None
    for point in spec["points"]:
        params = {**check, **{k: v for k, v in point.items() if k not in ("kind", "label", "warmup")}}
        base = dict(step=spec["step"], job=spec["job"], kind=point["kind"], label=point.get("label"),
                    warmup=point.get("warmup", False))
        left = deadline - (time.time() - t0)
        need = 2.0 + params["new"] * spec["step_s"] * (2.0 if params.get("track_storages") is True else 1.0)
        if need > left:
            print(f"SKIP {point['kind']} {params.get('cache', '')}: needs ≈{need:.0f}s, {left:.0f}s left", flush=True)
            continue
        try:
            if point["kind"] == "reference":
                from kvlab.reference import measure_legacy_generate
                if not (Path(os.environ["KVRUN_LEGACY_TARGET"]) / "transformers-4.40.1.dist-info").exists():
                    print("SKIP reference: no transformers 4.40.1 in " + os.environ["KVRUN_LEGACY_TARGET"], flush=True)
                    continue
                overrides = [o for o in model_spec["overrides"].split(",") if o]
                record = measure_legacy_generate(model_spec["preset"], overrides, params["batch"], params["prompt"],
                                                 params["new"], params["device"], params["dtype"],
                                                 target=Path(os.environ["KVRUN_LEGACY_TARGET"]))
                record.update(_kv_fields(model_spec, params, record["overhead_bytes"]), cache="legacy-4.40.1",
                              loop="generate", preset=model_spec["preset"], overrides=model_spec["overrides"])
            else:
                from kvlab.models import build_model
                if model is None:
                    model = build_model(model_spec["preset"], [o for o in model_spec["overrides"].split(",") if o],
                                        params["device"], params["dtype"])
                if point["kind"] == "hf_generate":
                    record = hf_generate(model, model_spec, params)
                else:
                    from kvlab.experiment import run_point
                    # force: the lanes share one GPU and plan its memory themselves
                    record = run_point(model, preset=model_spec["preset"], overrides=model_spec["overrides"],
                                       force=True, **params)
            record.update(base, status="ok", error=None)
        except Exception as error:
            import torch
            name = type(error).__name__
            status = "oom" if "OutOfMemory" in name or "out of memory" in str(error).lower() else "failed"
            traceback.print_exc()
            record = dict(base, **params, preset=model_spec["preset"], status=status,
                          error=f"{name}: {str(error)[-500:]}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print("RECORD " + json.dumps(record, default=str), flush=True)
        if record.get("status") == "ok" and record.get("seconds") and record.get("new"):
            factor = 2.0 if params.get("track_storages") is True else 1.0  # plan the next point on what was seen
            spec["step_s"] = max(spec["step_s"], record["seconds"] / record["new"] / factor)
        gc.collect()


def _kv_fields(model_spec, params, overhead):
    from kvlab.models import build_config, kv_bytes_per_token
    config = build_config(model_spec["preset"], [o for o in model_spec["overrides"].split(",") if o])
    kv = kv_bytes_per_token(config, params["batch"], params["dtype"]) * (params["prompt"] + params["new"])
    return dict(kv_final_bytes=kv, overhead_over_kv=round(overhead / kv, 4))


def hf_generate(model, model_spec, params):
    """transformers' own generate(), greedy, its default cache (DynamicCache), measured like a kvlab point."""
    import torch
    from kvlab.experiment import provenance
    from kvlab.memory import MemoryMeter
    device = params["device"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (params["batch"], params["prompt"]), generator=generator).to(device)
    gc.collect()
    with torch.inference_mode(), MemoryMeter(device, model) as meter:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params["new"],
                             min_new_tokens=params["new"], do_sample=False, pad_token_id=0)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        cache_class = "DynamicCache (default)"
        del out
    report = meter.report()
    return dict(preset=model_spec["preset"], overrides=model_spec["overrides"], cache="hf-generate",
                loop="generate", cache_class=cache_class, strategy="greedy", batch=params["batch"],
                prompt=params["prompt"], new=params["new"], device=device, dtype=params["dtype"], meter=report.method,
                baseline_bytes=report.baseline_bytes, peak_bytes=report.peak_bytes,
                overhead_bytes=report.overhead_bytes, reserved_peak_bytes=report.reserved_peak_bytes,
                storages_peak_bytes=report.storages_peak_bytes,
                **_kv_fields(model_spec, params, report.overhead_bytes), seconds=round(seconds, 4),
                tokens_per_s=round(params["batch"] * params["new"] / seconds, 2), **provenance(device))


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    elif sys.argv[1] == "plan":
        print_plan()
    else:
        orchestrate()
PY
if [[ "$PLAN" == 1 ]]; then
    "$PYTHON" "$WORK/kvrun.py" plan
    exit $?
fi
"$PYTHON" "$WORK/kvrun.py" orchestrate
status=$?
if (( status != 0 )); then
    log "the orchestrator exited with status $status"
fi

# -- 4. what comes back --------------------------------------------------------------------------------
if [[ -d "$WORK/sweep" ]]; then
    tar -czf "$OUT/sweep.tar.gz" -C "$WORK" sweep && log "sweep.tar.gz: $(du -h "$OUT/sweep.tar.gz" | cut -f1)"
fi
log "finished in $(( $(date +%s) - T0 ))s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $status
