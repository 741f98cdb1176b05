"""The GPU worker's checks, in one script for a machine with one NVIDIA GPU.

    python benchmarks/gpu_check.py                      # on cuda, every section
    python benchmarks/gpu_check.py --device cpu --quick # the same code paths on the CPU

Each section (`benchmarks/gpu_checks/`) checks one part of a GPU worker and times it:

    store     the page store on the device, a CUDA IPC copy between two processes with
              its validation (and a page rewritten during the copy caught), write-back to
              the host tier and load-back, against plain copies of the same bytes
    tiers     the device tier: the prefix cache over device pages, evicted pages written
              down to the host tier and loaded back, validated, against plain copies
    compute   the model and BatchRunner on the device against the same model on the CPU
    layouts   the vLLM connector's KV layouts on device tensors, round-tripped

It needs only torch, transformers, numpy and msgpack: no Ray, no ZeroMQ, no network, no
model download (the model is a seeded random Llama of SmolLM2-135M's shape). A section
that fails is reported with its error and the others still run; the script exits 1 when
any failed. Progress goes to stderr; the last line of stdout is one JSON object (also
written to `--out`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: the repository root is importable, and this folder is not (its
    # modules' names, copy.py among them, would hide the standard library's).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

SECTIONS = ("store", "tiers", "compute", "layouts")


def machine(device: str) -> dict:
    """What ran the checks: Python, torch, and the device's name."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def run_section(name: str, device: str, quick: bool) -> dict:
    """One section's figures, or its error (a failed check is a result, not a crash)."""
    start = time.perf_counter()
    print(f"[gpu_check] {name} on {device} ...", file=sys.stderr, flush=True)
    try:
        module = importlib.import_module(f"benchmarks.gpu_checks.{name}")
        figures = {"passed": True, **module.run(device, quick)}
    except Exception as exc:  # each section's failure is reported, the rest still run
        traceback.print_exc()
        figures = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    figures["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    result = {"machine": machine(args.device), "quick": args.quick}
    for name in sections:
        result[name] = run_section(name, args.device, args.quick)
    # What the machine lacks (a GPU machine may have no Ray, ZeroMQ or gguf) no check uses.
    result["imported"] = sorted(m for m in ("ray", "zmq", "gguf", "vllm") if m in sys.modules)
    result["passed"] = all(result[name]["passed"] for name in sections)
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
