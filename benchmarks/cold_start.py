"""A cold `kvlab predict` beside a bare `import torch`, in one run: fresh processes, interleaved, the median of each.

    python benchmarks/cold_start.py [--repeats 5]

Each command runs in a new Python process, so every import is paid; the rounds interleave the commands so that a
busy machine slows them alike. The ratio is each command's median over the bare `python -c "import torch"`'s. A
prediction for a preset or a config.json of the families kvlab.theory walks imports torch and kvlab's planner, not
transformers (kvlab.planner.plain); a hub id, another model type or `--dry-run` still imports it.
"""

import argparse
import statistics
import subprocess
import sys
import time

POINT = ["--batch", "8", "--prompt", "300", "--new", "500", "--dtype", "bfloat16"]
COMMANDS = {
    'python -c "import torch"': ["-c", "import torch"],
    "kvlab predict --help": ["-m", "kvlab", "predict", "--help"],
    "kvlab predict llama2-7b, cuda, 80GiB": ["-m", "kvlab", "predict", "--preset", "llama2-7b", *POINT]
    + ["--device", "cuda", "--memory", "80GiB"],
    "kvlab predict gemma-3-4b, cpu": ["-m", "kvlab", "predict", "--preset", "gemma-3-4b", *POINT, "--device", "cpu"],
}


def seconds(arguments: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *arguments], check=True, capture_output=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every command (default: 5)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    times = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, arguments in COMMANDS.items():
            times[name].append(seconds(arguments))
    torch_alone = statistics.median(times['python -c "import torch"'])
    width = max(map(len, COMMANDS))
    print(f"{'command':<{width}}  median s  min s  x import torch")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"{name:<{width}}  {median:8.2f}  {min(runs):5.2f}  {median / torch_alone:14.2f}")


if __name__ == "__main__":
    main()
