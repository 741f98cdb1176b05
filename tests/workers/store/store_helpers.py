"""Small helpers for page store tests: layouts, KV, stand-in digests, child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from workers.store.digests import DIGEST_BYTES
from workers.store.layout import StoreLayout

REPO_ROOT = Path(__file__).resolve().parents[3]
OWN_PREFIX = f"kvmesh-{os.getpid()}-"
DIGESTS = [bytes([i + 1]) * DIGEST_BYTES for i in range(8)]  # stand-ins, one per page


def make_layout(**overrides: object) -> StoreLayout:
    fields = dict(num_pages=8, num_layers=2, num_kv_heads=3, page_tokens=4, head_dim=5)
    fields.update(overrides)
    return StoreLayout(**fields)


def make_kv(layout: StoreLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.page_shape, generator=gen).to(layout.torch_dtype)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
    )


def start_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
