"""How long each test module took in a whole run, to hand the slowest out first.

`make test` spreads whole modules over its pytest processes (`--dist loadfile`), each
taking the next module when it runs short of work. Handed out in file order, a module of
two minutes can start last and leave the other process idle while it runs; handed out
longest first, the processes finish within about the shortest module of each other.
`durations.json` holds each module's seconds in one run on this kind of machine; a module
missing from it (a new one) goes after those listed, in file order. Refresh it from a run's
JUnit report when modules change much:

    python -m pytest ... --junitxml=/tmp/junit.xml
    python -m tests.durations /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORD = HERE / "durations.json"
MIN_SECONDS = 2.0  # shorter modules are not worth listing: file order is as good for them


def recorded() -> dict[str, float]:
    """Module path (as pytest names it, `tests/x/test_y.py`) -> seconds; empty if absent."""
    try:
        return json.loads(RECORD.read_text())
    except FileNotFoundError:
        return {}


def from_junit(report: Path) -> dict[str, float]:
    """Seconds per module in a JUnit report (pytest's `--junitxml`), slowest first."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[_module_path(case.get("classname", ""))] += float(case.get("time") or 0.0)
    return {p: round(s, 1) for p, s in seconds.most_common() if s >= MIN_SECONDS}


def _module_path(classname: str) -> str:
    """`tests.x.test_y` or `tests.x.test_y.TestClass` -> `tests/x/test_y.py`."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (HERE.parent / path).is_file():
            return path
    return "/".join(parts) + ".py"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.durations JUNIT_XML", file=sys.stderr)
        return 2
    RECORD.write_text(json.dumps(from_junit(Path(argv[0])), indent=0) + "\n")
    print(f"wrote {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
