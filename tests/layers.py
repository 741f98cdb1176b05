"""What importing a package loads, each measured in a fresh interpreter.

One child process forks a fresh copy of itself per package (a fork of an interpreter
that has imported nothing of the project: what a fresh one would load, without paying
the interpreter's start each time). Packages that must not load torch or numpy go first;
then the child imports torch once, and the rest are forked from there, since importing
torch is what costs (seconds) and none of those forbids what it loads (checked).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence

_CHILD = r"""
import importlib, json, os, pkgutil, sys

def load(package):
    top = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(top, "__path__", []), top.__name__ + "."):
        if not info.name.endswith(("vllm_connector", "ray_serve")):  # vLLM: its own venv
            importlib.import_module(info.name)
    return sorted(sys.modules)

def probe(package):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = {"modules": load(package)}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write, "w") as pipe:
            json.dump(out, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = json.load(pipe)
    os.waitpid(pid, 0)
    return out

light, heavy = json.loads(sys.argv[1])
results = {package: probe(package) for package in light}
import torch  # noqa: E402,F401  (shared by every package below: none forbids it)
results["(preloaded)"] = {"modules": sorted(sys.modules)}
results |= {package: probe(package) for package in heavy}
print(json.dumps(results))
"""


def loaded_modules(forbidden: Mapping[str, Sequence[str]]) -> dict[str, set[str]]:
    """package -> every module a fresh interpreter has loaded once it imported the package
    and every module in it.

    Raises:
        AssertionError: a package failed to import (with its error).
    """
    light = sorted(p for p, names in forbidden.items() if {"torch", "numpy"} & set(names))
    heavy = sorted(set(forbidden) - set(light))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([light, heavy])],
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for package, result in results.items():
        assert "error" not in result, f"importing {package} failed: {result['error']}"
    preloaded = set(results.pop("(preloaded)")["modules"])
    for package in heavy:  # what torch loaded must not be what a package is checked for
        assert not violations(preloaded, forbidden[package]), (package, forbidden[package])
    return {package: set(result["modules"]) for package, result in results.items()}


def violations(loaded: set[str], forbidden: Sequence[str]) -> list[str]:
    """The loaded modules that are, or are inside, one of `forbidden`."""
    return sorted(
        name for name in loaded for bad in forbidden if name == bad or name.startswith(bad + ".")
    )
