"""The GPU check's report: items with a status, figures and a reason; report.json and report.md."""

from __future__ import annotations

import datetime
import enum
import json
import math
import os
import platform
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "Item",
    "Report",
    "Status",
    "environment",
    "failed_item",
    "render_markdown",
    "write_report",
]


class Status(str, enum.Enum):
    """The outcome of one item."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass
class Item:
    """One checked thing: ``name`` (``"b/adamw/float32"``, ...), its status, its figures (plain
    JSON values) and why it has that status."""

    name: str
    status: Status
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        out["figures"] = _plain(self.figures)
        return out


@dataclass
class Report:
    """The whole report: the environment, then every item in the order they ran."""

    environment: dict[str, Any]
    items: list[Item] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many items have each status (every status listed, zeros included)."""
        return {s.value: sum(1 for i in self.items if i.status is s) for s in Status}

    def to_dict(self) -> dict[str, Any]:
        return {
            "environment": _plain(self.environment),
            "counts": self.counts(),
            "items": [i.to_dict() for i in self.items],
        }


def failed_item(name: str, exc: BaseException, seconds: float | None = None) -> Item:
    """A FAIL item for an exception raised while checking ``name``: its type, words and the last
    frames of its traceback (so one failure names where it happened)."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)
    reason = f"{type(exc).__name__}: {exc}".strip()
    if where:
        reason += f" (at {where})"
    return Item(name, Status.FAIL, reason, seconds=seconds)


def _plain(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: non-finite floats as strings, tuples as
    lists, other objects by ``str``."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def environment(torch_module: Any | None, device: str) -> dict[str, Any]:
    """Where the check ran: date, host, Python, torch, CUDA, NCCL and the device's name."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "device": device,
    }
    if torch_module is None:
        return env
    env["torch"] = torch_module.__version__
    env["cuda"] = torch_module.version.cuda
    env["device_name"] = "cpu"
    if device.startswith("cuda") and torch_module.cuda.is_available():
        env["device_name"] = torch_module.cuda.get_device_name(0)
        env["device_count"] = torch_module.cuda.device_count()
    env["nccl"] = _nccl_version(torch_module)
    return env


def _nccl_version(torch_module: Any) -> str | None:
    try:
        version = torch_module.cuda.nccl.version()
    except Exception:  # a CPU build has no NCCL
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def _text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _cell(value: Any) -> str:
    """``value`` as one Markdown table cell: floats to 4 digits, pipes escaped, one line."""
    return _text(value).replace("|", "\\|").replace("\n", " ")


def _figures(figures: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_text(v)}" for k, v in figures.items() if not isinstance(v, list))


def render_markdown(report: Report) -> str:
    """The report as Markdown: the environment, the counts, then one table row per item;
    list-valued figures (every host sync found, ...) follow the table, item by item."""
    lines = ["# shardopt GPU check", ""]
    lines += [f"- {k}: {_cell(v)}" for k, v in report.environment.items()]
    counts = report.counts()
    lines += ["", "Counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()), ""]
    lines += ["| item | status | figures | reason |", "| --- | --- | --- | --- |"]
    for item in report.items:
        cells = (item.name, item.status.value, _figures(item.figures), item.reason)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for item in report.items:
        for key, value in item.figures.items():
            if isinstance(value, list) and value:
                lines += ["", f"## {item.name}: {key}", ""]
                lines += [f"- {_cell(v)}" for v in value]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: str) -> tuple[str, str]:
    """Writes ``report.json`` and ``report.md`` into ``out_dir`` (made if missing); returns their
    paths. Each file is written whole to a temporary name first, then renamed into place."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "report.json")
    md_path = os.path.join(out_dir, "report.md")
    _write(json_path, json.dumps(report.to_dict(), indent=2) + "\n")
    _write(md_path, render_markdown(report))
    return json_path, md_path


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(tmp, path)
