"""lmcache_namespace_guard on synthetic site directories (the real-wheel flow with LMCache 0.5.6
forced over ours is tests/e2e/test_lmcache_distribution.py).

Each case lays out a site directory with ``*.dist-info`` folders (METADATA + RECORD) and the
files they claim, and reads the guard's report in a fresh interpreter that sees only that
directory (``-S``: no site-packages, so the development environment's own wheels stay out).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmcache_namespace_guard

GUARD_FILE = Path(lmcache_namespace_guard.__file__)

REPORT = r"""
import json, lmcache_namespace_guard as g
r = g.check_namespace()
print(json.dumps({"ok": r.ok, "problems": r.problems, "repair": r.repair_commands()}))
"""


def _dist(site: Path, name: str, version: str, files: list[str], requires: list[str]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    record = [f"{f},," for f in files] + [f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    for f in files:
        path = site / f
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")


def _ours(site: Path, core_files: list[str] | None = None) -> None:
    core_files = core_files or ["lmcache/cli/main.py", "lmcache/v1/errors.py"]
    _dist(site, "lmcache-core", "0.5.6.1", core_files, ["torch>=2.4"])
    _dist(site, "lmcache-fs", "0.5.6.1", ["lmcache/storage/fs/hooks.py"], ["lmcache-core>=0.5.6.1"])
    _dist(site, "lmcache", "0.5.6.1", [], ["lmcache-core==0.5.6.1", "lmcache-fs==0.5.6.1"])


def _guard_path(site: Path) -> str:
    """PYTHONPATH: the synthetic site, holding a copy of the guard module (its installed folder
    may be site-packages, whose distributions must stay out of sight)."""
    shutil.copy(GUARD_FILE, site / GUARD_FILE.name)
    return str(site)


def _report(site: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": _guard_path(site)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", REPORT], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout)


def test_our_wheels_and_a_plugin_beside_them_are_intact(tmp_path):
    _ours(tmp_path)
    # A third-party plugin that depends on "lmcache" and has its own part of the namespace.
    _dist(tmp_path, "lmcache-foo-device", "0.1.0", ["lmcache_foo/device.py"], ["lmcache"])
    _dist(tmp_path, "vendor-store", "1.0", ["lmcache/storage/vendor/hooks.py"], ["lmcache"])
    assert _report(tmp_path) == {"ok": True, "problems": [], "repair": []}


def test_lmcache_over_ours_names_the_init_the_overwrites_and_the_repair(tmp_path):
    _ours(tmp_path)
    # What `pip install lmcache==0.5.6` leaves: our meta-package replaced by LMCache's own
    # distribution, which claims lmcache/__init__.py and one of core's files.
    for info in tmp_path.glob("lmcache-0.5.6.1.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    _dist(
        tmp_path,
        "lmcache",
        "0.5.6",
        ["lmcache/__init__.py", "lmcache/cli/main.py", "lmcache/logging.py"],
        ["torch", "cupy-cuda13x"],
    )
    report = _report(tmp_path)
    assert not report["ok"]
    text = "\n".join(report["problems"])
    assert "the distribution 'lmcache' 0.5.6 is not ours" in text
    assert f"{tmp_path / 'lmcache' / '__init__.py'} (from lmcache 0.5.6)" in text
    assert (
        "1 file(s) of lmcache-core were overwritten by lmcache 0.5.6: lmcache/cli/main.py" in text
    )
    assert "lmcache-fs" not in text  # its file is its own
    assert report["repair"] == [
        f"{sys.executable} -m pip uninstall -y lmcache",
        f"{sys.executable} -m pip install --force-reinstall --no-deps "
        "lmcache==0.5.6.1 lmcache-core==0.5.6.1 lmcache-fs==0.5.6.1",
    ]


def test_an_init_nobody_claims_and_files_of_core_that_are_gone(tmp_path):
    _ours(tmp_path)
    (tmp_path / "lmcache" / "__init__.py").write_text("")  # left behind by hand or a bad tool
    (tmp_path / "lmcache" / "v1" / "errors.py").unlink()  # taken away by a foreign uninstall
    report = _report(tmp_path)
    text = "\n".join(report["problems"])
    assert f"{tmp_path / 'lmcache' / '__init__.py'} makes 'lmcache' a regular package" in text
    assert "1 file(s) of lmcache-core are missing" in text and "lmcache/v1/errors.py" in text
    # Nothing foreign to uninstall: the repair is our wheels, reinstalled.
    assert report["repair"] == [
        f"{sys.executable} -m pip install --force-reinstall --no-deps "
        "lmcache==0.5.6.1 lmcache-core==0.5.6.1 lmcache-fs==0.5.6.1"
    ]


def test_the_cli_stops_with_the_report_before_running_a_command(tmp_path):
    _ours(tmp_path)
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": _guard_path(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import lmcache_namespace_guard as g; g.main()", "plugins"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == lmcache_namespace_guard.EXIT_CODE, out.stderr
    assert out.stderr.startswith("lmcache: error: another package has taken over")
    assert "Traceback" not in out.stderr
