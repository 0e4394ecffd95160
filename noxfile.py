"""Developer sessions: tests, compiled, integration, torch_range, lint, typecheck, docs, demo,
bench, gpu."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import nox

# [Note: installs by uv]
# Environments are made and filled by uv where it is installed (ci/nox.sh puts it beside nox),
# several times faster than pip; by venv and pip where it is not. uv reads none of pip's
# configuration, and a bare `uv pip install torch==2.13.0` brings the 4.6 GB CUDA build where
# pip, configured here, takes a local CPU wheel. So pip's settings (`pip config list`:
# find-links, index URLs, constraints, from its files and PIP_* variables) are handed to uv as
# its UV_* variables, with pip's way of choosing among indexes (the best version in any of
# them, `unsafe-best-match`), and uv installs the wheels pip would. Like pip, it compiles the
# bytecode at install (`--compile-bytecode`; uv's default is not to): where PYTHONDONTWRITEBYTECODE
# is set, as on these machines, every process that imports torch would otherwise compile it from
# source, about 2.5 s more a process on 2 cores.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PACKAGES = ("packages/core", "packages/functional", "packages/testing", "packages/devtools")
SOURCE_PATHS = tuple(f"{p}/src/shardopt" for p in PACKAGES)
# The docs pages' examples are doctests too (docs/conftest.py collects docs/**/*.md).
TEST_PATHS = ("README.md", "docs", *(f"{p}/tests" for p in PACKAGES), *SOURCE_PATHS)
# One intra-op thread per rank: CI has 2 cores and the suite runs worlds side by side.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# [Note: one environment]
# tests, demo, bench and gpu run in one virtual environment, .nox/shared, so the quick start's
# two commands install torch once. Nox makes a venv per session, so these sessions make none
# (venv_backend="none") and share ours: created on first use, reinstalled only when its inputs
# (the pinned requirements, the packages' pyproject.toml files) change, as recorded in its stamp
# file.
SHARED = os.path.join(".nox", "shared")
REQUIREMENTS = (
    "ci/requirements.txt",
    "ci/requirements-test.txt",
    "ci/requirements-integration.txt",
)

# [Note: torch range]
# Every package declares torch>=2.4, and each end of that range is tested: the torch_range
# sessions run the suite (RANGE_TESTS, below; the floor leaves out the doctests) on the floor, on
# the CI pin (the torch of `tests`, in .nox/shared) and on the newest torch these machines serve,
# each in a venv of its own (.nox/torch-<version>) with the same pinned test dependencies. The
# floor is 2.4 because the code needs nothing newer: what later releases added is looked up where
# it is used (the root of a broadcast by group rank, DTensor's public module and chunk list, DCP's
# hooks, the optimizers torch.optim gained) and tests of a feature torch lacks skip with the
# version they need (shardopt.testing.requires_torch). A plain PyPI torch on Linux brings CUDA
# wheels: 2.7 GB for 2.4.1, downloaded once into pip's cache.
TORCH_FLOOR = "2.4.1"
TORCH_PIN = "2.13.0"  # ci/requirements.txt
TORCH_NEWEST = "2.14.1"
# What torch_range runs: every test file, and on every torch but the floor every doctest too. A
# doctest ends with destroy_process_group, which on torch 2.4 can deadlock in gloo's destructor
# (it holds the GIL while joining a worker thread that still needs it); the harness's worlds leave
# together through a barrier ([Note: leave together]), so the test files are not exposed to it.
RANGE_TESTS = tuple(f"{p}/tests" for p in PACKAGES)


def _find_uv() -> str | None:
    """uv's executable: the one installed beside nox (ci/requirements-nox.txt), else on PATH."""
    try:
        import uv  # type: ignore[import-not-found]

        return str(uv.find_uv_bin())
    except Exception:
        return shutil.which("uv")


UV = _find_uv()
_PIP_TO_UV = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
}


def _pip_settings_for_uv() -> dict[str, str]:
    """pip's configured sources as uv's variables ([Note: installs by uv])."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in _PIP_TO_UV:
            for item in value.strip().strip("'\"").split():
                if item not in found.setdefault(name, []):
                    found[name].append(item)
    env = {_PIP_TO_UV[n][0]: _PIP_TO_UV[n][1].join(v) for n, v in found.items()}
    return {**env, "UV_INDEX_STRATEGY": "unsafe-best-match"} if env else env


if UV is not None:
    for _name, _value in _pip_settings_for_uv().items():
        os.environ.setdefault(_name, _value)


def _create(session: nox.Session, where: str) -> tuple[str, ...]:
    """Makes an empty venv ``where``; returns the command that installs into it."""
    python = os.path.join(where, "Scripts" if os.name == "nt" else "bin", "python")
    if UV is not None:
        session.run(UV, "venv", "-q", "--clear", "--python", sys.executable, where, external=True)
        return (UV, "pip", "install", "-q", "--compile-bytecode", "--python", python)
    session.run(sys.executable, "-m", "venv", "--clear", where, external=True)
    return (python, "-m", "pip", "install", "-q", "--disable-pip-version-check")


def _shared_env(session: nox.Session, *, one_thread: bool = True) -> tuple[str, dict[str, str]]:
    """Creates or refreshes .nox/shared; returns its scripts folder and the environment that
    runs commands from it (one intra-op thread per process unless told otherwise)."""
    return _venv(session, SHARED, ("-r", "ci/requirements.txt"), one_thread=one_thread)


def _venv(
    session: nox.Session, where: str, requirements: tuple[str, ...], *, one_thread: bool = True
) -> tuple[str, dict[str, str]]:
    """Creates or refreshes the venv ``where`` with ``requirements`` (pip arguments) and the
    packages (editable); returns its scripts folder and the environment to run it with."""
    bin_dir = os.path.join(where, "Scripts" if os.name == "nt" else "bin")
    inputs = [*REQUIREMENTS, *(f"{p}/pyproject.toml" for p in PACKAGES)]
    wanted = " ".join(requirements) + "\n" + "".join(pathlib.Path(p).read_text() for p in inputs)
    stamp = pathlib.Path(where, "installed.txt")
    if not stamp.exists() or stamp.read_text() != wanted:
        pip = _create(session, where)  # [Note: installs by uv]
        session.run(*pip, *requirements, external=True)
        session.run(*pip, "--no-deps", *(a for p in PACKAGES for a in ("-e", p)), external=True)
        stamp.write_text(wanted)
    path = bin_dir + os.pathsep + os.environ.get("PATH", "")
    threads = THREAD_ENV if one_thread else {}
    return bin_dir, {**threads, "PATH": path, "VIRTUAL_ENV": os.path.abspath(where)}


def _install(session: nox.Session, requirements: str = "ci/requirements.txt") -> None:
    session.install("-r", requirements)
    session.install("--no-deps", *(arg for p in PACKAGES for arg in ("-e", p)))


# Each xdist worker takes another's pending tests once its own run out ("worksteal"), so the
# suite need not end on one worker finishing a heavy file while the other waits. Measured on the
# 2-core machine: 241 and 249 s against 274 s with xdist's default ("load") in the dev venv, back
# to back; 253 s against 252 s from fresh clones an hour apart, within the machine's noise.
XDIST = ("-n", "auto", "--dist", "worksteal")


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Runs the whole suite with pytest-xdist (a run that collects nothing fails: exit 5)."""
    bin_dir, env = _shared_env(session)
    args = session.posargs or [*XDIST, "--timeout=600", "--doctest-modules", *TEST_PATHS]
    session.run(os.path.join(bin_dir, "pytest"), *args, env=env, external=True)


@nox.session(venv_backend="none")
@nox.parametrize("torch", [TORCH_FLOOR, TORCH_PIN, TORCH_NEWEST], ids=["floor", "pin", "newest"])
def torch_range(session: nox.Session, torch: str) -> None:
    """The suite on one torch of the supported range (see [Note: torch range])."""
    if torch == TORCH_PIN:
        bin_dir, env = _shared_env(session)
    else:
        where = os.path.join(".nox", f"torch-{torch}")
        bin_dir, env = _venv(session, where, (f"torch=={torch}", "-r", "ci/requirements-test.txt"))
    doctests = ("--doctest-modules", "README.md", "docs", *SOURCE_PATHS)
    doctests = doctests if torch != TORCH_FLOOR else ()
    args = session.posargs or [*XDIST, "--timeout=600", *RANGE_TESTS, *doctests]
    session.run(os.path.join(bin_dir, "pytest"), *args, env=env, external=True)


# [Note: integration]
# shardopt inside the stacks users train with: transformers, accelerate and pytorch-lightning,
# test-only dependencies pinned in ci/requirements-integration.txt and installed only in this
# session's venv, .nox/integration (with ci/requirements.txt: the same torch and test tools as
# .nox/shared), so no other session sees them and no shardopt module may import them. The tests
# (packages/functional/tests/integration) are tiny random-init models at W=2 over gloo on CPU,
# each beside the same run with torch's own classes. Elsewhere (the tests session) that folder's
# conftest.py leaves its test files uncollected, without skips; here SHARDOPT_INTEGRATION=1 makes
# it fail at once when one of the three is missing.
INTEGRATION = os.path.join(".nox", "integration")
INTEGRATION_REQUIREMENTS = ("-r", "ci/requirements.txt", "-r", "ci/requirements-integration.txt")
INTEGRATION_TESTS = ("packages/functional/tests/integration",)


@nox.session(venv_backend="none")
def integration(session: nox.Session) -> None:
    """The integration tests in transformers, accelerate and Lightning ([Note: integration])."""
    bin_dir, env = _venv(session, INTEGRATION, INTEGRATION_REQUIREMENTS)
    env = {**env, "SHARDOPT_INTEGRATION": "1"}
    options = (*XDIST, "--timeout=600", "-p", "no:cacheprovider")
    args = session.posargs or [*options, *INTEGRATION_TESTS]
    session.run(os.path.join(bin_dir, "pytest"), *args, env=env, external=True)


# The tests that torch.compile an update run in this session only, in .nox/shared ([Note:
# compiled tests] in packages/functional/tests/compiled/conftest.py).
COMPILED_TESTS = ("packages/functional/tests/compiled",)


@nox.session(venv_backend="none")
def compiled(session: nox.Session) -> None:
    """The tests that torch.compile an update (SHARDOPT_COMPILED=1 collects them)."""
    bin_dir, env = _shared_env(session)
    env = {**env, "SHARDOPT_COMPILED": "1"}
    options = ("-n", "2", "--timeout=900", "-p", "no:cacheprovider")
    args = session.posargs or [*options, *COMPILED_TESTS]
    session.run(os.path.join(bin_dir, "pytest"), *args, env=env, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace (ruff alone: no torch)."""
    session.install("-r", "ci/requirements-lint.txt")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the four packages (strict about untyped definitions)."""
    _install(session, "ci/requirements-dev.txt")
    session.run(
        "mypy",
        "packages/core/src/shardopt/core",
        "packages/functional/src/shardopt/functional",
        "packages/functional/src/shardopt/optim",
        "packages/functional/src/shardopt/cli",
        "packages/devtools/src/shardopt/devtools",
        "packages/testing/src/shardopt/testing",
    )


# [Note: docs]
# The docs site (mkdocs.yml, docs/): mkdocs-material, with the API pages generated from the
# docstrings by mkdocstrings, whose griffe reads the source statically, so this session's venv,
# .nox/docs, holds the pinned docs tools (ci/requirements-docs.txt, whose pins are the stamp's
# requirements: a new pin rebuilds it) and the four packages, but no torch. ``--strict`` makes
# every warning fail the build: a broken link or anchor, a page missing from the nav, an API
# name or cross-reference that does not resolve; the README, outside the site, has its links
# checked first. The pages' examples run as doctests in the tests session, not here.
DOCS = os.path.join(".nox", "docs")
DOCS_REQUIREMENTS = "ci/requirements-docs.txt"


def _missing_readme_links() -> list[str]:
    """README.md's relative links whose file does not exist (mkdocs never reads the README, and
    GitHub renders its links as they are)."""
    targets = re.findall(r"\]\(([^)#\s]+)[^)]*\)", pathlib.Path("README.md").read_text())
    return [t for t in targets if "://" not in t and not pathlib.Path(t).exists()]


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Builds the docs site into site/ with mkdocs build --strict ([Note: docs]); fails first on
    a README link to a missing file."""
    if missing := _missing_readme_links():
        session.error(f"docs: expected README.md's links to name existing files, got {missing}")
    lines = pathlib.Path(DOCS_REQUIREMENTS).read_text().splitlines()
    pins = tuple(line for line in lines if line.strip() and not line.startswith("#"))
    bin_dir, env = _venv(session, DOCS, pins)
    env = {**env, "NO_MKDOCS_2_WARNING": "1"}  # material's end-of-life banner
    args = session.posargs or ["--site-dir", "site"]
    session.run(os.path.join(bin_dir, "mkdocs"), "build", "--strict", *args, env=env, external=True)


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
        "bench_fail_fast.py",
        "bench_host.py",
        "bench_host_large.py",
        "bench_worlds.py",
    ):
        session.run(python, f"benchmarks/{script}", env=env, external=True)
    shardopt = os.path.join(bin_dir, "shardopt")
    session.run(shardopt, "bench", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The offline GPU check (ci/gpu.sh: its own venv over the interpreter's torch, a report in
    out/gpu); one line and exit 0 where torch sees no CUDA device."""
    session.run("sh", "ci/gpu.sh", *session.posargs, external=True)
