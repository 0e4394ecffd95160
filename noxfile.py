"""Developer sessions: tests, lint, typecheck, demo, bench, gpu."""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PACKAGES = ("packages/core", "packages/functional", "packages/testing")
SOURCE_PATHS = tuple(f"{p}/src/shardopt" for p in PACKAGES)
TEST_PATHS = ("README.md", *(f"{p}/tests" for p in PACKAGES), *SOURCE_PATHS)
# One intra-op thread per rank: CI has 2 cores and the suite runs worlds side by side.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _install(session: nox.Session, requirements: str = "ci/requirements.txt") -> None:
    session.install("-r", requirements)
    session.install("--no-deps", *(arg for p in PACKAGES for arg in ("-e", p)))


@nox.session
def tests(session: nox.Session) -> None:
    """Runs the whole suite with pytest-xdist (a run that collects nothing fails: exit 5)."""
    _install(session)
    args = session.posargs or ["-n", "auto", "--timeout=600", "--doctest-modules", *TEST_PATHS]
    session.run("pytest", *args, env=THREAD_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.install("-r", "ci/requirements-dev.txt")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the three packages (strict about untyped definitions)."""
    _install(session, "ci/requirements-dev.txt")
    session.run(
        "mypy",
        "packages/core/src/shardopt/core",
        "packages/functional/src/shardopt/functional",
        "packages/functional/src/shardopt/optim",
        "packages/testing/src/shardopt/testing",
    )


@nox.session
def demo(session: nox.Session) -> None:
    """Trains the demo model on 2 gloo ranks and writes a report and a PNG."""
    _install(session)
    session.run("shardopt", "demo", *session.posargs, env=THREAD_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch baselines measured in the same run (ratios printed)."""
    _install(session)
    session.run("python", "benchmarks/bench_flat_adam.py")
    session.run("python", "benchmarks/bench_plan.py")
    session.run("python", "benchmarks/bench_zero_consolidate.py")
    session.run("python", "benchmarks/bench_zero_step.py")
    session.run("python", "benchmarks/bench_zero_step_check.py")
    session.run("shardopt", "bench", *session.posargs, env=THREAD_ENV)


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU-only tests (NCCL/CUDA); they skip where CUDA is absent."""
    _install(session)
    session.run("pytest", "-m", "gpu", *(f"{p}/tests" for p in PACKAGES), env=dict(os.environ))
