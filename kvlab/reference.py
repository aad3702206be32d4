"""The real thing: transformers 4.40.1's own `generate()`, measured with kvlab's meter.

4.40.1 cannot share a process with transformers 5, so it is installed into its own folder
(`--target`, with the tokenizers and huggingface-hub it was released with) and run in a subprocess
with that folder first on PYTHONPATH. The subprocess imports only `kvlab.memory` (plain torch), builds
the preset's config with 4.40.1's classes and prints one JSON record.

    python -m kvlab.reference --preset toy --batch 8 --prompt 64 --new 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LEGACY_TRANSFORMERS = ("transformers==4.40.1", "tokenizers==0.19.1", "huggingface-hub==0.23.4")
DEFAULT_TARGET = Path(__file__).resolve().parent.parent / ".legacy-tf"


def install_legacy_transformers(target: Path = DEFAULT_TARGET) -> Path:
    """Install transformers 4.40.1 into `target` (once); raises CalledProcessError if pip cannot."""
    if not (target / "transformers-4.40.1.dist-info").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        *LEGACY_TRANSFORMERS], check=True)
    return target


def measure_legacy_generate(preset: str = "toy", overrides=None, batch: int = 8, prompt: int = 64, new: int = 512,
                            device: str = "cpu", dtype: str = "float32", target: Path = DEFAULT_TARGET) -> dict:
    """Run 4.40.1's `generate()` on the preset in a subprocess and return its measured record."""
    from .models import PRESETS, build_config
    config = build_config(preset, overrides)  # validates the preset and overrides in this process
    config_class, _ = PRESETS[preset]
    values = {key: getattr(config, key) for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "max_position_embeddings", "rms_norm_eps")}
    spec = dict(model_type=config_class.model_type, config=values, batch=batch, prompt=prompt, new=new,
                device=device, dtype=dtype)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(Path(__file__).resolve().parent.parent)]))
    result = subprocess.run([sys.executable, "-m", "kvlab.reference", "--worker", json.dumps(spec)],
                            env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"transformers 4.40.1 run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _worker(spec: dict) -> dict:
    """Runs inside the 4.40.1 subprocess."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvlab.memory import MemoryMeter

    assert transformers.__version__ == "4.40.1", transformers.__version__
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[spec["dtype"]]
    config = AutoConfig.for_model(spec["model_type"], **spec["config"], attn_implementation="sdpa")
    config.eos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(spec["device"]).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["prompt"]), generator=generator).to(spec["device"])
    with torch.inference_mode(), MemoryMeter(spec["device"], model) as meter:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                       min_new_tokens=spec["new"], do_sample=False, pad_token_id=0)
    report = meter.report()
    return dict(transformers_version=transformers.__version__, torch_version=torch.__version__,
                baseline_bytes=report.baseline_bytes, peak_bytes=report.peak_bytes,
                overhead_bytes=report.overhead_bytes, meter=report.method, **{k: spec[k] for k in (
                    "batch", "prompt", "new", "device", "dtype")})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    install_legacy_transformers()
    print(json.dumps(measure_legacy_generate(args.preset, None, args.batch, args.prompt, args.new, args.device,
                                             args.dtype)))


if __name__ == "__main__":
    main()
