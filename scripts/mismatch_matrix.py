"""Counts, per API and configuration, how the cases of test_agreement.py end at W = 2 and 3:
a clear error on every rank, a hang (a timeout or over the time limit), silent (no rank raised),
or partial (some ranks raised); and how many name no field where the ranks' inputs differ (the
error shows fingerprints only). Run it against any checkout to compare before and after:

    python scripts/mismatch_matrix.py [path/to/test_agreement.py] [--out counts.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from _test_module import load_test_module

from shardopt.testing import spawn

DEFAULT = "packages/functional/tests/engine/test_agreement.py"


def outcome(mod: object, api: str, outs: list[tuple[str, float]]) -> str:
    names = mod.NAMES[api]  # type: ignore[attr-defined]
    if any("imeout" in o or s > mod.SECONDS for o, s in outs):  # type: ignore[attr-defined]
        return "hang"
    if all(o == "no error" for o, _ in outs):
        return "silent"
    if all(o != "no error" and any(n in o for n in names) for o, _ in outs):
        return "clear"
    return "partial"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tests", nargs="?", default=DEFAULT)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    mod: Any = load_test_module(args.tests, "test_agreement")
    rows = []
    for api, configs in (("zero", mod.ZERO_CONFIGS), ("shard", mod.SHARD_CONFIGS)):
        for config in configs:
            for world in (2, 3):
                res = spawn(mod.run_cases, world, api, config, backend="gloo", timeout=600)
                for name in res[0]:
                    kind = outcome(mod, api, [r[name] for r in res])
                    unnamed = any("got fingerprints [" in r[name][0] for r in res)
                    rows.append((api, config, world, name, kind, unnamed))
    for api, config in dict.fromkeys((r[0], r[1]) for r in rows):
        c = Counter(r[4] for r in rows if r[:2] == (api, config))
        print(
            f"{api:5} {config:20} cases={sum(c.values()):3} clear={c['clear']:3} "
            f"hang={c['hang']:3} silent={c['silent']:3} partial={c['partial']:3} "
            f"difference-unnamed={sum(1 for r in rows if r[:2] == (api, config) and r[5]):3}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
