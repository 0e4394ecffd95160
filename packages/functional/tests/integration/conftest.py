"""The integration tests: shardopt inside transformers, accelerate and Lightning.

[Note: integration tests]
transformers, accelerate and pytorch-lightning are test-only dependencies, installed only in the
integration session's venv (see [Note: integration] in noxfile.py); no shardopt module imports
them. Where one is missing (the tests session's .nox/shared) this folder's test files are not
collected at all: no import errors and no skips reported. The integration session sets
SHARDOPT_INTEGRATION=1, and then a missing one is an error before anything runs.

Their warnings meet the suite's ``filterwarnings = error``; the few these tests trigger and
cannot avoid are ignored here, one filter each, for the tests of this folder only (the ranks of
a world test inherit them, see [Note: world tests]).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

STACKS = ("transformers", "accelerate", "pytorch_lightning")
# test_third_party_optimizers.py: optimizer classes run through ZeroRedundancyOptimizer.
OPTIMIZERS = ("pytorch_optimizer", "lion_pytorch", "schedulefree")
# test_optax_parity.py: shardopt.core's optax-style library against optax on CPU jax.
PARITY = ("jax", "optax")
MISSING = [name for name in STACKS + OPTIMIZERS + PARITY if importlib.util.find_spec(name) is None]

if MISSING and os.environ.get("SHARDOPT_INTEGRATION") == "1":
    raise pytest.UsageError(
        "integration tests: SHARDOPT_INTEGRATION=1 but these test dependencies are not "
        f"importable: {', '.join(MISSING)} (install ci/requirements-integration.txt)"
    )

# Helper modules too: the tests session's --doctest-modules would import them.
collect_ignore_glob = ["test_*.py", "_*.py"] if MISSING else []

# No network on CI: the models are built from configs, never downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

_HERE = Path(__file__).resolve().parent
# The stack tests share _stack_helpers.py, importable as the functional tests' helpers are (see
# [Note: shared test helpers] in the core tests' conftest.py).
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

# Added to every test of this folder, one reason each.
WARNING_FILTERS = [
    # Lightning 2.6's pytree helper still tests isinstance(spec, LeafSpec), which torch 2.13
    # deprecates; nothing the tests can change.
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning",
    # test_lightning resumes into a new directory on purpose, to keep the first run's files.
    "ignore:The dirpath has changed from:UserWarning",
    # Lightning asks for DataLoader workers on machines with more than 2 cores; the batches
    # are tiny tensors in memory.
    "ignore:The 'train_dataloader' does not have many workers"
    ":lightning_fabric.utilities.warnings.PossibleUserWarning",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            for spec in WARNING_FILTERS:
                item.add_marker(pytest.mark.filterwarnings(spec))
