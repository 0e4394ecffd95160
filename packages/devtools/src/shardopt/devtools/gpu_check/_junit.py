"""Item a: the pytest tests marked ``gpu``, run as a subprocess and read back from JUnit XML."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from shardopt.devtools.gpu_check._report import Item, Status

__all__ = ["PLUGIN", "junit_items", "pytest_command", "plugin_is_installed", "run_gpu_tests"]

PLUGIN = "shardopt.testing.pytest_plugin"
TEST_DIRS = ("packages/core/tests", "packages/functional/tests", "packages/testing/tests")


def plugin_is_installed() -> bool:
    """Whether an installed distribution registers shardopt's pytest plugin (then ``-p`` would
    register it a second time, which pytest refuses)."""
    from importlib.metadata import entry_points

    return any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))


def pytest_command(
    python: str, junit: str, test_dirs: Sequence[str], *, with_plugin: bool
) -> list[str]:
    """The pytest command line of item a.

    Example:
        >>> " ".join(pytest_command("py", "j.xml", ["t"], with_plugin=False))
        'py -m pytest -m gpu -p no:cacheprovider --junitxml=j.xml -q t'
    """
    cmd = [python, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider"]
    if with_plugin:
        cmd += ["-p", PLUGIN]
    return [*cmd, f"--junitxml={junit}", "-q", *test_dirs]


def _case_name(case: ET.Element) -> str:
    module = case.get("classname", "").split(".")
    # classname is module(.Class): keep from the test file on ("test_gpu" or "test_x.TestY")
    tail = next((i for i, part in enumerate(module) if part.startswith("test_")), 0)
    return ".".join(module[tail:]) + "::" + case.get("name", "?")


def _outcome(case: ET.Element) -> tuple[Status, str]:
    for tag, status in (("failure", Status.FAIL), ("error", Status.FAIL), ("skipped", Status.SKIP)):
        found = case.find(tag)
        if found is not None:
            text = (found.text or "").strip().splitlines()
            return status, found.get("message") or (text[-1] if text else tag)
    return Status.PASS, ""


def junit_items(xml_text: str, prefix: str = "a/") -> list[Item]:
    """One item per test case of a JUnit XML report (pytest's ``--junitxml``): PASS, FAIL
    (failure or error, with its message) or SKIP (with pytest's skip reason)."""
    root = ET.fromstring(xml_text)
    items = []
    for case in root.iter("testcase"):
        status, reason = _outcome(case)
        seconds = float(case.get("time", "nan"))
        items.append(Item(prefix + _case_name(case), status, reason, seconds=seconds))
    return items


def run_gpu_tests(repo: str, out_dir: str, timeout: float) -> list[Item]:
    """Runs every test marked ``gpu`` under ``repo``'s packages in a subprocess; one item per
    test, then one for the run itself (pytest's exit status and the tail of its output)."""
    dirs = [d for d in TEST_DIRS if os.path.isdir(os.path.join(repo, d))]
    if not dirs:
        return [Item("a/pytest", Status.SKIP, f"no test folders under {repo}")]
    junit = os.path.abspath(os.path.join(out_dir, "pytest-gpu.xml"))
    cmd = pytest_command(sys.executable, junit, dirs, with_plugin=not plugin_is_installed())
    try:
        done = subprocess.run(
            cmd, cwd=repo, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return [Item("a/pytest", Status.FAIL, f"pytest ran past {timeout:.0f} s: {cmd}")]
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:]
    items = []
    if os.path.exists(junit):
        with open(junit, encoding="utf-8") as file:
            items = junit_items(file.read())
    return [*items, pytest_run_item(done.returncode, "".join(tail), len(items))]


def pytest_run_item(returncode: int, last_line: str, cases: int) -> Item:
    """The item of the pytest run itself: PASS on exit 0, SKIP when nothing was selected
    (exit 5), FAIL otherwise (failed tests, or a run that broke before its tests).

    Example:
        >>> pytest_run_item(5, "no tests ran", 0).status
        <Status.SKIP: 'SKIP'>
    """
    figures = {"exit_status": returncode, "test_cases": cases}
    if returncode == 0:
        return Item("a/pytest", Status.PASS, last_line, figures)
    if returncode == 5:
        return Item("a/pytest", Status.SKIP, "no test marked gpu was selected", figures)
    return Item("a/pytest", Status.FAIL, f"pytest exit status {returncode}: {last_line}", figures)
