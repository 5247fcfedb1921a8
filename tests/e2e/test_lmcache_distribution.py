"""The ``lmcache`` distribution is ours: plugins written for LMCache install beside our wheels.

One fresh venv, as a new user has it (issue: "`lmcache` is our distribution"):

1. our wheels (``LMCACHE_DIST_DIR``, which ``nox -s wheels`` sets, or built here) installed
   as ``pip install lmcache``;
2. the external Foo device wheel, built from examples/lmcache-foo-device and installed exactly as
   docs/devices.md installs it (``python -m pip install dist/lmcache_foo_device-0.1.0-py3-none-any.whl``,
   dependencies included), then examples/lmc_external_l2_adapter with its dependencies: pip's
   own ``--dry-run --report`` shows that neither fetches ``lmcache`` (or anything of ours) from
   the registry, and every file of ours still has the hash its RECORD names;
3. ``DEVICE_TYPE=foo`` selects Foo; the L2 plugin loads through ``--l2-adapter`` (a real
   ``lmcache server`` and ``lmcache bench l2`` with verification);
4. PyPI's ``lmcache==0.5.6`` forced over ours: ``lmcache plugins`` and ``lmcache server`` stop
   with the namespace guard's message (exit 3), and the pip commands it prints repair the venv.

Needs the package registries (torch from the local wheel, core's dependencies, LMCache 0.5.6's
wheel); about three minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from testsupport.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PACKAGES = REPO / "packages"
EXAMPLES = REPO / "examples"
TORCH = "torch==2.13.0"  # the pin of noxfile.py: pip takes the local CPU wheel
LMCACHE_056 = "lmcache==0.5.6"
GUARD_EXIT_CODE = 3
# The meta-package and what it depends on: what `pip install lmcache` needs from us.
DEFAULT_SET = [
    "lmcache",
    "lmcache-core",
    "lmcache-fs",
    "lmcache-redis",
    "lmcache-s3",
    "lmcache-cuda",
]
ENV = {
    **os.environ,
    "LMCACHE_TRACK_USAGE": "false",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "NO_GPU_EXT": "1",
}
ENV.pop("PYTHONPATH", None)  # the fresh venv must see only what is installed in it

pytestmark = pytest.mark.slow


def _version() -> str:
    text = (PACKAGES / "lmcache" / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def _run(*cmd: str | Path, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("env", ENV)
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kwargs
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    """Our wheels: the ones `nox -s wheels` built, or the default set built here."""
    given = os.environ.get("LMCACHE_DIST_DIR")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    for name in DEFAULT_SET:
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, PACKAGES / name)
    return out


class Venv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "bin" / "python"
        self.bin = root / "bin"

    def pip(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.python, "-m", "pip", *args, check=check)

    def versions(self) -> dict[str, str]:
        rows = json.loads(self.pip("list", "--format", "json").stdout)
        return {r["name"].lower().replace("_", "-"): r["version"] for r in rows}

    def dry_run_installs(self, target: str | Path, tmp: Path) -> list[str]:
        """What pip would install for ``target`` ("name==version" each), from its own report."""
        report = tmp / "report.json"
        self.pip("install", "--dry-run", "--quiet", "--report", report, target)
        data = json.loads(report.read_text())
        return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in data["install"]]

    def changed_files(self, dists: list[str]) -> list[str]:
        """Files of these distributions that are missing or no longer match their RECORD."""
        out = _run(self.python, "-c", RECORD_CHECK, *dists).stdout
        return json.loads(out)

    def lmcache(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return _run(self.bin / "lmcache", *args, check=check, **kw)


RECORD_CHECK = r"""
import base64, hashlib, importlib.metadata as md, json, sys
bad = []
for name in sys.argv[1:]:
    dist = md.distribution(name)
    for f in dist.files or []:
        if f.hash is None:
            continue
        try:
            data = f.locate().read_bytes()
        except FileNotFoundError:
            bad.append(f"{name}: {f} is missing")
            continue
        digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b"=")
        if digest.decode() != f.hash.value:
            bad.append(f"{name}: {f} was overwritten")
print(json.dumps(bad))
"""

SELECTED_DEVICE = r"""
import json
from lmcache.v1.platform.testing import install_fake_device
with install_fake_device("foo"):  # no Foo hardware here: a fake torch.foo, as its own tests
    from lmcache.cli.plugins import collect
    report = collect()
foo = [b for b in report["device_backends"] if b["name"] == "foo"]
print(json.dumps({"selected": report["selected_device"], "foo": foo}))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory, dist_dir) -> Venv:
    root = tmp_path_factory.mktemp("fresh") / "venv"
    _run(sys.executable, "-m", "venv", root)
    env = Venv(root)
    env.pip("install", "-q", TORCH)
    env.pip("install", "-q", "--find-links", dist_dir, f"lmcache=={_version()}")
    return env


@pytest.fixture(scope="module")
def ours(venv) -> list[str]:
    versions = venv.versions()
    mine = sorted(n for n in versions if n == "lmcache" or n.startswith("lmcache-"))
    assert set(DEFAULT_SET) <= set(mine), mine
    assert {versions[n] for n in mine} == {_version()}, {n: versions[n] for n in mine}
    return mine


def _build_wheel(venv: Venv, project: Path, out: Path) -> Path:
    # The guide builds with `python -m build --wheel`; pip's builder makes the same wheel and the
    # fresh venv already has pip. A copy keeps build folders out of the checkout.
    src = out / f"src-{project.name}"
    shutil.copytree(project, src, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info"))
    venv.pip("wheel", "-q", "--no-deps", "-w", src / "dist", src)
    (wheel,) = (src / "dist").glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def plugins_installed(venv, ours, tmp_path_factory) -> dict[str, list[str]]:
    """Foo and the L2 example installed as their users install them; pip's dry-run plans."""
    tmp = tmp_path_factory.mktemp("plugins")
    plans = {}
    foo_wheel = _build_wheel(venv, EXAMPLES / "lmcache-foo-device", tmp)
    assert foo_wheel.name == "lmcache_foo_device-0.1.0-py3-none-any.whl"
    plans["foo"] = venv.dry_run_installs(foo_wheel, tmp)
    # Exactly the guide's line, run from the project folder: dependencies resolved, no flags.
    _run(venv.python, "-m", "pip", "install", f"dist/{foo_wheel.name}", cwd=foo_wheel.parents[1])
    l2_src = tmp / "lmc_external_l2_adapter"
    shutil.copytree(EXAMPLES / "lmc_external_l2_adapter", l2_src)
    plans["l2"] = venv.dry_run_installs(l2_src, tmp)
    venv.pip("install", "-q", l2_src)
    return plans


@pytest.mark.parametrize(
    "requirement",
    ["lmcache", "lmcache>=0.5,<0.6", "lmcache~=0.5.6", "lmcache==0.5.*", "lmcache>=0.5.6.1,<0.6"],
)
def test_requirements_written_against_lmcache_05_are_satisfied_by_ours(
    venv, ours, requirement, tmp_path
):
    assert venv.dry_run_installs(requirement, tmp_path) == []


def test_plugins_that_depend_on_lmcache_fetch_nothing_of_ours(venv, ours, plugins_installed):
    assert plugins_installed["foo"] == ["lmcache-foo-device==0.1.0"]
    assert plugins_installed["l2"] == ["lmc-external-l2-adapter==0.1.0"]
    versions = venv.versions()
    assert versions["lmcache"] == _version()  # still ours, not LMCache from the registry
    assert venv.changed_files(ours) == []
    venv.pip("check")  # every requirement of every installed distribution is met
    namespace = json.loads(venv.lmcache("plugins", "--json").stdout)["namespace"]
    assert namespace == {"ok": True, "problems": [], "repair": []}


def test_device_type_foo_selects_the_foo_wheel(venv, plugins_installed):
    env = {**ENV, "DEVICE_TYPE": "foo"}
    out = json.loads(_run(venv.python, "-c", SELECTED_DEVICE, env=env).stdout)
    assert out["selected"]["backend"] == "foo", out
    assert out["foo"][0]["distribution"] == "lmcache-foo-device", out


L2_PLUGIN = json.dumps(
    {
        "type": "plugin",
        "module_path": "lmc_external_l2_adapter",
        "class_name": "InMemoryL2Adapter",
        "adapter_params": {"max_size_gb": 0.1, "mock_bandwidth_gb": 20.0},
    }
)


def test_the_l2_plugin_loads_through_l2_adapter(venv, plugins_installed):
    bench = venv.lmcache(
        "bench", "l2", "--l2-adapter", L2_PLUGIN, "--num-keys", "4", "--data-size-kb", "16",
        "--no-skip-verify", "--lookup-max-hit-rate", "1.0", "--format", "json",
    )  # fmt: skip
    (result,) = json.loads(bench.stdout)["metrics"]["l2"]["adapters"]
    assert result["type"] == "plugin"
    for op in ("store", "lookup", "load"):
        assert result["results"][op]["successful_keys"] == 4, result["results"][op]

    port, http_port = free_port(), free_port()
    log = venv.root / "server.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [venv.bin / "lmcache", "server", "--host", "127.0.0.1", "--port", str(port),
             "--http-port", str(http_port), "--l1-size-gb", "0.25", "--shm-name", "",
             "--l2-adapter", L2_PLUGIN],
            stdout=sink, stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
    try:
        status = _wait_status(f"http://127.0.0.1:{http_port}", server, log)
        assert status["is_healthy"], status["unhealthy_reasons"]
        assert status["storage_manager"]["num_l2_adapters"] == 1
    finally:
        server.terminate()
        server.wait(30)
    assert "L2 adapter #0 created: plugin" in log.read_text()


def _wait_status(url: str, proc: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"lmcache server exited {proc.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(url + "/status", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"lmcache server did not answer in 120 s:\n{log.read_text()}")


def test_lmcache_056_forced_over_ours_is_stopped_and_repaired(
    venv, ours, plugins_installed, dist_dir
):
    venv.pip("install", "-q", "--no-deps", LMCACHE_056)  # its other requirements are CUDA-only
    assert venv.versions()["lmcache"] == "0.5.6"

    for args in (["plugins"], ["server", "--l1-size-gb", "0.25"]):
        out = venv.lmcache(*args, check=False)
        assert out.returncode == GUARD_EXIT_CODE, out.stdout + out.stderr
        err = out.stderr
        assert "another package has taken over the 'lmcache' namespace" in err, err
        assert "the distribution 'lmcache' 0.5.6 is not ours" in err
        assert "lmcache/__init__.py (from lmcache 0.5.6) makes 'lmcache' a regular package" in err
        assert "of lmcache-core were overwritten by lmcache 0.5.6" in err
        assert "Traceback" not in err and "Fatal Python error" not in err

    repair = [
        line.strip()
        for line in err.splitlines()
        if line.strip().startswith(f"{venv.python} -m pip ")
    ]
    assert repair[0] == f"{venv.python} -m pip uninstall -y lmcache", repair
    assert repair[1].startswith(f"{venv.python} -m pip install --force-reinstall --no-deps ")
    assert f"lmcache=={_version()}" in repair[1] and f"lmcache-core=={_version()}" in repair[1]
    # Run them as printed; our wheels come from where they came from the first time.
    _run(*repair[0].split())
    _run(*repair[1].split(), "--find-links", dist_dir)

    report = json.loads(venv.lmcache("plugins", "--json").stdout)
    assert report["namespace"]["ok"], report["namespace"]
    assert any(b["name"] == "foo" for b in report["device_backends"])
    assert venv.versions()["lmcache"] == _version()
    assert venv.changed_files(ours) == []
