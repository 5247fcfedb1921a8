"""Tell, before anything of ``lmcache`` is imported, whether another package took our namespace.

``lmcache`` is a PEP 420 namespace that every wheel of ours shares, and the distribution name
``lmcache`` is ours too (a meta-package, ``packages/lmcache``). LMCache's own wheel from PyPI
(or any package that ships ``lmcache/__init__.py``) breaks both: its ``__init__.py`` turns the
namespace into its regular package, and its files land on the paths of ours without a warning
(pip does not check who owns a file). What then fails is far from the cause: an ``ImportError``
deep inside, or a CLI that rejects every flag because it is not ours any more.

This module lives outside the ``lmcache`` folder, so no such package can overwrite or shadow it,
and it imports nothing of ``lmcache``. It runs from three places:

* the ``lmcache`` console script (``lmcache_namespace_guard:main``) checks, then hands over to
  ``lmcache.cli.main``;
* ``lmcache-namespace-guard.pth`` (installed by the lmcache-core wheel beside this module) runs
  :func:`guard_console_script` when the program is ``lmcache``: when a foreign wheel replaced
  our console script, its CLI is stopped with our message instead of running half-broken;
* ``lmcache.cli.main`` and ``lmcache plugins`` (the state is part of its report).

A problem is reported with what happened, which distribution did it, and the pip commands that
repair it. The check reads installed ``RECORD`` files (a few milliseconds in a large
environment) and only for the ``lmcache`` command, never in other processes.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

__all__ = [
    "CORE_DISTRIBUTION",
    "EXIT_CODE",
    "NamespaceReport",
    "check_namespace",
    "guard_console_script",
    "main",
]

CORE_DISTRIBUTION = "lmcache-core"
META_DISTRIBUTION = "lmcache"
EXIT_CODE = 3  # distinct from a usage error (2) and a failed command (1)
_SHOWN_FILES = 5

_cached: NamespaceReport | None = None


@dataclass
class NamespaceReport:
    """What :func:`check_namespace` found; ``problems`` is empty when all is well."""

    problems: list[str] = field(default_factory=list)
    foreign_distributions: list[str] = field(default_factory=list)
    reinstall: list[str] = field(default_factory=list)  # "name==version" of ours

    @property
    def ok(self) -> bool:
        """True when nothing foreign owns a part of the ``lmcache`` namespace."""
        return not self.problems

    def repair_commands(self) -> list[str]:
        """The pip commands that put our wheels back (uninstalling the foreign ones first)."""
        pip = f"{sys.executable} -m pip"
        cmds = []
        if self.foreign_distributions:
            cmds.append(f"{pip} uninstall -y {' '.join(self.foreign_distributions)}")
        if self.reinstall:
            cmds.append(f"{pip} install --force-reinstall --no-deps {' '.join(self.reinstall)}")
        return cmds

    def message(self) -> str:
        """The text the CLI prints: what happened, then how to repair it."""
        if self.ok:
            return "the lmcache namespace is intact"
        lines = [
            "another package has taken over the 'lmcache' namespace of this environment "
            f"({sys.prefix}); lmcache cannot run until it is repaired:"
        ]
        lines += [f"  - {p}" for p in self.problems]
        lines.append(
            "Repair (our wheels come from where you installed them before: add the same "
            "--find-links DIR or --index-url URL to the install line):"
        )
        lines += [f"  {c}" for c in self.repair_commands()]
        lines.append(
            "Plugins that declare a dependency on 'lmcache' (as LMCache plugins do) are "
            "satisfied by our 'lmcache' package: install them after ours and pip fetches "
            "nothing else (docs/install.md)."
        )
        return "\n".join(lines)


def _record_paths(dist: metadata.Distribution) -> list[str]:
    """The paths a distribution's RECORD lists under ``lmcache/`` (cheap pre-filter first:
    torch's RECORD has ~15k lines, and most distributions own nothing of ours)."""
    text = dist.read_text("RECORD") or ""
    if not (text.startswith("lmcache/") or "\nlmcache/" in text):
        return []
    return [
        row[0]
        for row in csv.reader(io.StringIO(text))
        if row and row[0].startswith("lmcache/") and "__pycache__" not in row[0]
    ]


def _is_ours(dist: metadata.Distribution) -> bool:
    name = _name(dist)
    if name == CORE_DISTRIBUTION:
        return True
    # Every wheel of ours, the 'lmcache' meta-package included, depends on lmcache-core;
    # LMCache's wheel and plugins written for it depend on 'lmcache' at most.
    return any(_requirement_name(r) == CORE_DISTRIBUTION for r in dist.requires or [])


def _name(dist: metadata.Distribution) -> str:
    return (dist.metadata["Name"] or "").lower().replace("_", "-")


def _requirement_name(requirement: str) -> str:
    head = requirement.split(";", 1)[0].strip()
    for stop in "<>=!~[ (":
        head = head.split(stop, 1)[0]
    return head.lower().replace("_", "-")


def _namespace_dirs() -> list[Path]:
    """Every ``lmcache`` folder on ``sys.path``, in import order."""
    found = []
    for entry in sys.path:
        candidate = Path(entry or ".") / "lmcache"
        if candidate.is_dir() and candidate not in found:
            found.append(candidate)
    return found


def check_namespace(refresh: bool = False) -> NamespaceReport:
    """Look for a foreign ``lmcache/__init__.py``, a foreign ``lmcache`` distribution, files of
    ours that another distribution overwrote, and files of ours that are gone. Cached per
    process (the console script, the .pth hook and the CLI share one answer)."""
    global _cached
    if _cached is not None and not refresh:
        return _cached
    report = NamespaceReport()
    # Only distributions that own files under lmcache/ (and the two names we look up) have
    # their metadata parsed: parsing every one of a large environment's would cost ~1 s.
    owners: dict[str, list[str]] = {}  # path -> names
    dists: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        paths = _record_paths(dist)
        if not paths:
            continue
        name = _name(dist)
        if name in dists:  # the first on sys.path is the one imported
            continue
        dists[name] = dist
        for path in paths:
            owners.setdefault(path, []).append(name)
    for name in (META_DISTRIBUTION, CORE_DISTRIBUTION):
        if name not in dists:
            try:
                dists[name] = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                pass
    ours_names = {n for n, d in dists.items() if _is_ours(d)}
    core = dists.get(CORE_DISTRIBUTION)
    core_version = core.version if core is not None else None

    foreign: dict[str, str] = {}  # name -> version
    meta = dists.get(META_DISTRIBUTION)
    if meta is not None and META_DISTRIBUTION not in ours_names:
        foreign[META_DISTRIBUTION] = meta.version
        report.problems.append(
            f"the distribution 'lmcache' {meta.version} is not ours (it does not depend on "
            f"{CORE_DISTRIBUTION}): it is LMCache's own package, installed over our "
            "'lmcache' package of the same name"
        )

    for ns_dir in _namespace_dirs():
        init = ns_dir / "__init__.py"
        if init.is_file():
            owner = [n for n in owners.get("lmcache/__init__.py", []) if n not in ours_names]
            foreign.update({n: dists[n].version for n in owner})
            by = f" (from {owner[0]} {dists[owner[0]].version})" if owner else ""
            report.problems.append(
                f"{init}{by} makes 'lmcache' a regular package: the parts of the namespace that "
                "our other wheels install are hidden behind it"
            )
            break

    overwritten: dict[tuple[str, str], list[str]] = {}  # (ours, theirs) -> paths
    for path, names in owners.items():
        ours = [n for n in names if n in ours_names]
        theirs = [n for n in names if n not in ours_names]
        for our_name in ours:
            for their_name in theirs:
                overwritten.setdefault((our_name, their_name), []).append(path)
    for (our_name, their_name), paths in sorted(overwritten.items()):
        foreign[their_name] = dists[their_name].version
        report.problems.append(
            f"{len(paths)} file(s) of {our_name} were overwritten by {their_name} "
            f"{dists[their_name].version}: {_sample(paths)}"
        )

    if core is not None:
        missing = _missing_files(core)
        if missing:
            report.problems.append(
                f"{len(missing)} file(s) of {CORE_DISTRIBUTION} are missing (removed when a "
                f"package that had overwritten them was uninstalled): {_sample(missing)}"
            )

    if report.problems:
        report.foreign_distributions = sorted(foreign)
        ours = sorted(n for n in ours_names if n not in foreign)
        if core_version and META_DISTRIBUTION not in ours:
            ours.append(META_DISTRIBUTION)
        report.reinstall = [
            f"{n}=={dists[n].version if n in dists and n not in foreign else core_version}"
            for n in sorted(ours)
        ]
    _cached = report
    return report


def _sample(paths: list[str]) -> str:
    shown = ", ".join(sorted(paths)[:_SHOWN_FILES])
    return shown + (f" and {len(paths) - _SHOWN_FILES} more" if len(paths) > _SHOWN_FILES else "")


def _missing_files(dist: metadata.Distribution) -> list[str]:
    missing = []
    for f in dist.files or []:
        is_code = f.parts and f.parts[0] == "lmcache" and f.suffix == ".py"
        if is_code and not Path(str(dist.locate_file(f))).exists():
            missing.append(str(f))
    return missing


def guard_console_script() -> None:
    """Stop the ``lmcache`` program with the report when the namespace is not ours."""
    if os.environ.get("LMCACHE_SKIP_NAMESPACE_GUARD") == "1":
        return
    try:
        report = check_namespace()
    except Exception:  # a guard that crashes would be worse than no guard
        return
    if not report.ok:
        print(f"lmcache: error: {report.message()}", file=sys.stderr)
        sys.stderr.flush()
        # From a .pth file this runs inside `import site`, where SystemExit is a fatal error
        # with a traceback; nothing is set up yet that an orderly exit would have to close.
        os._exit(EXIT_CODE)


def main() -> int:
    """The ``lmcache`` console script: guard, then run the CLI."""
    guard_console_script()
    from lmcache.cli.main import main as cli_main

    return cli_main()
