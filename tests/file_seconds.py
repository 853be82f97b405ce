"""Each test file's seconds in one run (``tests/file_seconds.json``), which ``conftest.py``
sends to the workers longest first. ``make durations`` writes it from a run's JUnit report:
``python -m tests.file_seconds REPORT.xml``."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

PATH = Path(__file__).with_name("file_seconds.json")


def from_report(report: str | Path) -> dict[str, int]:
    """Seconds per test file (``tests/....py``) in a JUnit report, rounded up."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time") or 0.0)
    return {name: int(s) + 1 for name, s in sorted(seconds.items())}


def load() -> dict[str, int]:
    try:
        return json.loads(PATH.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    PATH.write_text(json.dumps(from_report(sys.argv[1]), indent=1) + "\n")
