"""``lmcache server --help`` names the L2 types without importing any plugin: the built-in
types, plus the entry-point names of group ``lmcache.l2_adapters`` read from the installed
metadata (an entry point may provide several types; ``lmcache plugins`` loads them all).

Checked in a fresh interpreter, so ``sys.modules`` shows exactly what building the server's
parser imported: the installed plugins' entry-point modules and a synthetic plugin whose
module would record its import are never imported, and their entry-point names are listed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import contextlib, importlib.metadata as md, io, json, sys

    from lmcache.cli.main import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            build_parser("server").parse_args(["server", "--help"])
        except SystemExit:
            pass
    eps = [{"name": ep.name, "module": ep.module} for ep in md.entry_points(group="lmcache.l2_adapters")]
    print(json.dumps({"help": out.getvalue(), "modules": sorted(sys.modules), "eps": eps}))
    """
)


def _server_help(extra_path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(extra_path), env.get("PYTHONPATH", "")) if p
    )
    env["COLUMNS"] = "400"  # one help line per flag: names are not split across lines
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_server_help_lists_entry_point_names_without_importing_plugins(tmp_path):
    # A synthetic plugin: importing its module at all would show in sys.modules.
    (tmp_path / "zz_help_probe_plugin.py").write_text("raise RuntimeError('imported')\n")
    info = tmp_path / "zz_help_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zz-help-probe\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[lmcache.l2_adapters]\nzz_probe = zz_help_probe_plugin\n"
    )

    got = _server_help(tmp_path)
    help_text = " ".join(got["help"].split())
    modules = set(got["modules"])
    assert "--l2-adapter" in help_text

    eps = got["eps"]
    assert {"name": "zz_probe", "module": "zz_help_probe_plugin"} in eps
    imported = [
        m for ep in eps for m in modules if m == ep["module"] or m.startswith(ep["module"] + ".")
    ]
    assert not imported, f"building the server parser imported plugin modules: {imported}"
    assert not [m for m in modules if m.startswith("lmcache.storage.")]

    for t in ("fault_inject", "mock", "native_plugin", "plugin"):
        assert t in help_text
    for ep in eps:
        assert ep["name"] in help_text, ep
    assert "`lmcache plugins` lists every type" in help_text
