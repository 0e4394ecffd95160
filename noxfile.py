"""Developer sessions: tests, lint, typecheck, demo, bench, gpu."""

from __future__ import annotations

import os
import pathlib
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PACKAGES = ("packages/core", "packages/functional", "packages/testing")
SOURCE_PATHS = tuple(f"{p}/src/shardopt" for p in PACKAGES)
TEST_PATHS = ("README.md", *(f"{p}/tests" for p in PACKAGES), *SOURCE_PATHS)
# One intra-op thread per rank: CI has 2 cores and the suite runs worlds side by side.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# [Note: one environment]
# tests, demo, bench and gpu run in one virtual environment, .nox/shared, so the quick start's
# two commands install torch once. Nox makes a venv per session, so these sessions make none
# (venv_backend="none") and share ours: created on first use, reinstalled only when its inputs
# (the pinned requirements, the packages' pyproject.toml files) change, as recorded in its stamp
# file.
SHARED = os.path.join(".nox", "shared")


def _shared_env(session: nox.Session, *, one_thread: bool = True) -> tuple[str, dict[str, str]]:
    """Creates or refreshes .nox/shared; returns its scripts folder and the environment that
    runs commands from it (one intra-op thread per process unless told otherwise)."""
    bin_dir = os.path.join(SHARED, "Scripts" if os.name == "nt" else "bin")
    python = os.path.join(bin_dir, "python")
    inputs = ["ci/requirements.txt", *(f"{p}/pyproject.toml" for p in PACKAGES)]
    wanted = "".join(pathlib.Path(p).read_text() for p in inputs)
    stamp = pathlib.Path(SHARED, "installed.txt")
    if not stamp.exists() or stamp.read_text() != wanted:
        session.run(sys.executable, "-m", "venv", "--clear", SHARED, external=True)
        pip = (python, "-m", "pip", "install", "-q", "--disable-pip-version-check")
        session.run(*pip, "-r", "ci/requirements.txt", external=True)
        session.run(*pip, "--no-deps", *(a for p in PACKAGES for a in ("-e", p)), external=True)
        stamp.write_text(wanted)
    path = bin_dir + os.pathsep + os.environ.get("PATH", "")
    threads = THREAD_ENV if one_thread else {}
    return bin_dir, {**threads, "PATH": path, "VIRTUAL_ENV": os.path.abspath(SHARED)}


def _install(session: nox.Session, requirements: str = "ci/requirements.txt") -> None:
    session.install("-r", requirements)
    session.install("--no-deps", *(arg for p in PACKAGES for arg in ("-e", p)))


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Runs the whole suite with pytest-xdist (a run that collects nothing fails: exit 5)."""
    bin_dir, env = _shared_env(session)
    args = session.posargs or ["-n", "auto", "--timeout=600", "--doctest-modules", *TEST_PATHS]
    session.run(os.path.join(bin_dir, "pytest"), *args, env=env, external=True)


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
        "packages/functional/src/shardopt/cli",
        "packages/testing/src/shardopt/testing",
    )


@nox.session(venv_backend="none")
def demo(session: nox.Session) -> None:
    """Trains the demo model on 2 gloo ranks and writes a report and a PNG."""
    bin_dir, env = _shared_env(session)
    session.run(os.path.join(bin_dir, "shardopt"), "demo", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks against torch baselines measured in the same run (ratios printed)."""
    bin_dir, env = _shared_env(session)
    python = os.path.join(bin_dir, "python")
    for script in (
        "bench_flat_adam.py",
        "bench_plan.py",
        "bench_zero_consolidate.py",
        "bench_zero_step.py",
        "bench_zero_step_check.py",
        "bench_gloo_collectives.py",
        "bench_iteration_floor.py",
        "bench_state_dtype.py",
        "bench_muon_balance.py",
    ):
        session.run(python, f"benchmarks/{script}", env=env, external=True)
    shardopt = os.path.join(bin_dir, "shardopt")
    session.run(shardopt, "bench", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The offline GPU check (ci/gpu.sh: its own venv over the interpreter's torch, a report in
    out/gpu); one line and exit 0 where torch sees no CUDA device."""
    session.run("sh", "ci/gpu.sh", *session.posargs, external=True)
