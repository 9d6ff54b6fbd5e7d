"""What each test tier cost in a pytest run: minutes by folder of tests/, from the run's JUnit XML
(`make test-python` writes build/pytest.xml).

    python scripts/test_tiers.py build/pytest.xml
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ElementTree


def tier_of(classname: str) -> str:
    parts = classname.split(".")  # (tests.engine.test_engine[.Class])
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def main(path: str) -> None:
    seconds, counts = collections.Counter(), collections.Counter()
    for case in ElementTree.parse(path).iter("testcase"):
        tier = tier_of(case.get("classname", ""))
        seconds[tier] += float(case.get("time", 0))
        counts[tier] += 1
    print(f"{'tier':<14} {'tests':>6} {'minutes':>8}")
    for tier, total in seconds.most_common():
        print(f"{'tests/' + tier:<14} {counts[tier]:>6} {total / 60:>8.1f}")
    print(f"{'all':<14} {sum(counts.values()):>6} {sum(seconds.values()) / 60:>8.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/pytest.xml")
