"""Command results for people and for scripts: ``--format``, ``--output`` and ``-q``.

LMCache 0.5.6's commands print one report in one of two forms, and ours print the same:

* ``json``: ``{"title": ..., "metrics": {...}}``. Top-level entries sit directly in
  ``metrics``; a section is a nested object under its key; sections of a list group
  (``models``, ``quotas``, ...) become a list of objects under the group's name.
* ``terminal`` (the default): the title centred in ``=`` at the report's width, each
  section's label centred in ``-``, one ``Label: value`` line per entry with the value
  right-aligned, a closing ``=`` line. Floats show two decimals, a missing value ``N/A``.

``--output PATH`` writes the same form to a file; ``-q`` prints nothing (the exit status
still tells the outcome).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from lmcache.cli.errors import CLIError

FORMATS = ("terminal", "json")


def add_output_args(parser: argparse.ArgumentParser, inherit: bool = False) -> None:
    """The three output flags every report-printing command takes (as in 0.5.6).

    ``inherit``: the parser is a sub-command of one that has them too (0.5.6 puts them on
    ``lmcache kvcache``, before ``clear``); given here, they override the parent's, and
    left out they keep it (argparse would otherwise reset them to the defaults)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if inherit else value

    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=default(None),
        metavar="FORMAT",
        help="stdout output format: terminal or json (default: terminal)",
    )
    parser.add_argument(
        "--output",
        default=default(None),
        metavar="PATH",
        help="also write the report to PATH, in the --format form",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default(False),
        help="print nothing; exit code only",
    )


def add_json_output_arg(parser: argparse.ArgumentParser) -> None:
    """``--output FILE`` of the ``lmcache bench`` commands, which print JSON."""
    parser.add_argument("--output", metavar="FILE", default=None, help="also write the JSON here")


def print_json_result(result: Any, output: str | None) -> None:
    """A benchmark's result: printed as indented JSON, and also written to ``output``."""
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if output:
        try:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            Path(output).write_text(text + "\n")
        except OSError as exc:
            raise CLIError(f"cannot write --output {output}: {exc}") from None


@dataclass
class Section:
    key: str | None
    label: str | None
    group: str | None = None
    entries: list[tuple[str, str, Any]] = field(default_factory=list)
    columns: list[tuple[str, str]] = field(default_factory=list)  # a table: (key, header)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, key: str, label: str, value: Any) -> Section:
        self.entries.append((key, label, value))
        return self

    def add_row(self, **values: Any) -> Section:
        unknown = set(values) - {k for k, _h in self.columns}
        if unknown:
            raise ValueError(f"not columns of table {self.key!r}: {sorted(unknown)}")
        self.rows.append(values)
        return self


class Report:
    def __init__(self, title: str, width: int = 48) -> None:
        self.title = title
        self.width = width
        self._top = Section(None, None)
        self._sections: list[Section] = []
        self._keys: set[str] = set()

    def add(self, key: str, label: str, value: Any) -> Report:
        """A top-level entry (shown before every section)."""
        self._top.add(key, label, value)
        return self

    def section(self, key: str, label: str, group: str | None = None) -> Section:
        """A named section; with ``group`` it is one element of the JSON list ``group``."""
        if key in self._keys:
            raise ValueError(f"report section {key!r} added twice")
        self._keys.add(key)
        sec = Section(key, label, group)
        self._sections.append(sec)
        return sec

    def table(self, key: str, *columns: tuple[str, str]) -> Section:
        """Uniform rows (``add_row``): aligned columns on a terminal, a JSON list."""
        sec = self.section(key, key)
        sec.columns = list(columns)
        return sec

    def to_dict(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {k: v for k, _label, v in self._top.entries}
        groups: dict[str, list[dict[str, Any]]] = {}
        for sec in self._sections:
            body = {k: v for k, _label, v in sec.entries}
            if sec.columns:
                metrics[sec.key] = [{k: row.get(k) for k, _h in sec.columns} for row in sec.rows]
            elif sec.group is None:
                metrics[sec.key] = body
            else:
                groups.setdefault(sec.group, []).append(body)
        metrics.update(groups)
        return {"title": self.title, "metrics": metrics}

    def render(self, fmt: str | None) -> str:
        if (fmt or "terminal") == "json":
            return json.dumps(self.to_dict(), indent=2)
        return self._terminal()

    def _terminal(self) -> str:
        w = self.width
        lines = [f" {self.title} ".center(w, "=")]
        for sec in (self._top, *self._sections):
            if sec.columns:
                lines += _table_lines(sec)
                continue
            if sec.label is not None:
                lines.append(f" {sec.label} ".center(w, "-"))
            for _key, label, value in sec.entries:
                text = _terminal_value(value)
                name = f"{label}:"
                lines.append(name + " " * max(1, w - len(name) - len(text)) + text)
        lines.append("=" * w)
        return "\n".join(lines)

    def emit(self, args: argparse.Namespace, stream: TextIO | None = None) -> None:
        """Print (unless ``-q``) and write ``--output`` (if given), both in ``--format``."""
        fmt = getattr(args, "format", None)
        text = self.render(fmt)
        if not getattr(args, "quiet", False):
            print(text, file=stream or sys.stdout, flush=True)
        output = getattr(args, "output", None)
        if output:
            from lmcache.cli.errors import CLIError

            try:
                with open(output, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                raise CLIError(
                    f"cannot write --output {output}: {exc.strerror}; pick a writable path", 1
                ) from None


def _table_lines(sec: Section) -> list[str]:
    headers = [h for _k, h in sec.columns]
    cells = [[_terminal_value(row.get(k)) for k, _h in sec.columns] for row in sec.rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values)
        ).rstrip()

    out = [line(headers), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    out += [line(r) for r in cells] or ["(none)"]
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _terminal_value(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):  # nested results (ours) on one line
        return ", ".join(f"{k}={_terminal_value(v)}" for k, v in value.items())
    return str(value)
