"""How each one-rank failure of tests/engine/test_failure.py ends at W = 2 and 3, on any checkout:
the last rank fails inside a shardopt API and stays alive for ``--hold`` seconds; the others
either raise within 5 s (``named``: a RankFailedError naming the failing rank; ``together``: all
raise another error at once, as DCP does) or do not (``hang``: they raise only when the failing rank
leaves, or never within the world's timeout).

    PYTHONPATH=<checkout>/packages/core/src:<checkout>/packages/functional/src:... \\
        python scripts/failure_matrix.py [path/to/test_failure.py] [--hold 8] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _test_module import load_test_module
from tqdm import tqdm

from shardopt.testing import spawn

DEFAULT = "packages/functional/tests/engine/test_failure.py"
LIMIT_S = 5.0


def outcome(rows: list[tuple[str, float, str]], failing: int) -> str:
    others = [r for i, r in enumerate(rows) if i != failing]
    if any(kind == "no error" or seconds > LIMIT_S for kind, seconds, _ in others):
        return "hang"
    named = all(
        kind == "RankFailedError" and "rank" in message and "failed" in message
        for kind, _, message in others
    )
    return "named" if named else "together"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tests", nargs="?", default=DEFAULT)
    parser.add_argument("--hold", type=float, default=8.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    mod: Any = load_test_module(args.tests, "test_failure")
    results = []
    cases = [(case, world) for case in mod.CASES for world in (2, 3)]
    for case, world in tqdm(cases, desc="failure_matrix"):
        start = time.perf_counter()
        try:
            rows = spawn(
                mod.run_case, world, case, args.hold, backend="gloo", timeout=args.hold + 20
            )
            kind = outcome(rows, world - 1)
            slowest = max(s for i, (_, s, _) in enumerate(rows) if i != world - 1)
        except Exception as exc:  # the world's timeout: some rank never returned
            kind, slowest, rows = "hang", float("inf"), [("timeout", 0.0, str(exc)[:200])]
        results.append((case, world, kind, slowest, time.perf_counter() - start))
    print(f"\n{'case':45} {'W':>2} {'outcome':9} {'others raised after':>20}")
    for case, world, kind, slowest, _ in results:
        print(f"{case:45} {world:>2} {kind:9} {slowest:>19.2f}s")
    counts = {k: sum(1 for r in results if r[2] == k) for k in ("named", "together", "hang")}
    print(f"\n{len(results)} cases: {counts}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
