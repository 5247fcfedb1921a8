"""Task runner for the monorepo: every way to build, test, lint, benchmark and serve.

nox -s tests     install every package and example, run the whole test suite
nox -s lint      ruff check + format check
nox -s wheels    build each package's wheel into dist/ and prove each installs on its own
nox -s serve     run `lmcache server` with its embedded defaults
nox -s bench     run the benchmarks (JSON into bench-results/)
nox -s native    build and run the C++ connector framework's unit tests
nox -s cuda      compile the CUDA kernels with nvcc and run their host-side tests
nox -s compat    (optional) check against LMCache 0.5.6 from PyPI in a throwaway venv
nox -s vllm      (optional) instantiate the connector against vLLM's real base class
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
EXAMPLES = ROOT / "examples"
DIST = ROOT / "dist"

# torch first and pinned: pip takes the local CPU wheel; a bare newer torch downloads GBs of CUDA.
TORCH = "torch==2.13.0"
CORE = PACKAGES / "lmcache-core"

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False


def _projects(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if (p / "pyproject.toml").is_file())


def package_dirs() -> list[Path]:
    """Core first, then every other package in name order."""
    others = [p for p in _projects(PACKAGES) if p != CORE]
    return [CORE, *others]


def example_dirs() -> list[Path]:
    return _projects(EXAMPLES) if EXAMPLES.is_dir() else []


def install_torch(session: nox.Session) -> None:
    session.install(TORCH)


def install_everything(session: nox.Session, *, editable: bool = False) -> None:
    """torch, then every package and example in one resolver run (local paths win)."""
    install_torch(session)
    targets: list[str] = []
    for path in [*package_dirs(), *example_dirs()]:
        targets += ["-e", str(path)] if editable else [str(path)]
    session.install(*targets)


@nox.session
def tests(session: nox.Session) -> None:
    install_everything(session)
    session.install("pytest>=8", "hypothesis>=6", "httpx>=0.24", "moto[server]>=5", "psutil")
    args = session.posargs or ["tests"]
    session.run("python", "-m", "pytest", *args, env={"LMCACHE_TRACK_USAGE": "false"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every package's wheel, then install each beside core alone and import-check it."""
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    install_torch(session)
    session.install("build", "pip>=23")
    for path in package_dirs():
        session.run("python", "-m", "build", "--wheel", "--outdir", str(DIST), str(path))

    def wheel_for(path: Path) -> str:
        dist_name = path.name.replace("-", "_")
        matches = sorted(DIST.glob(f"{dist_name}-*.whl"))
        if not matches:
            session.error(f"no wheel built for {path.name} in {DIST}")
        return str(matches[-1])

    core_wheel = wheel_for(CORE)
    session.install(core_wheel)
    session.run("python", "-c", IMPORT_CHECK, "lmcache-core")
    for path in package_dirs()[1:]:
        whl = wheel_for(path)
        session.install("--no-deps", whl)
        session.run("python", "-c", IMPORT_CHECK, path.name)
        session.run("python", "-m", "pip", "uninstall", "-y", path.name)
    # All together: any subset must coexist in one environment.
    session.install("--no-deps", *[wheel_for(p) for p in package_dirs()[1:]])
    for path in package_dirs():
        session.run("python", "-c", IMPORT_CHECK, path.name)
    session.run("lmcache", "plugins", "--json", silent=False)


# Imports the top-level module(s) of one distribution and checks the namespace rule.
IMPORT_CHECK = r"""
import importlib, importlib.metadata as md, sys
dist = sys.argv[1]
files = md.distribution(dist).files or []
mods = set()
for f in files:
    parts = f.parts
    if parts and parts[0] == "lmcache" and f.suffix == ".py":
        if f.name == "__init__.py" and len(parts) <= 2:
            raise SystemExit(f"{dist} ships {f}: 'lmcache' must stay a PEP 420 namespace")
        if len(parts) >= 3 and parts[1] in ("devices", "storage") and f.name == "__init__.py" and len(parts) == 3:
            raise SystemExit(f"{dist} ships {f}: 'lmcache.{parts[1]}' must stay a namespace")
        if len(parts) >= 3 and parts[1] in ("devices", "storage"):
            mods.add(".".join(parts[:3]))
        elif len(parts) >= 2:
            mods.add(".".join(parts[:2]).removesuffix(".py"))
for m in sorted(mods):
    importlib.import_module(m)
print(f"{dist}: imported {', '.join(sorted(mods))}")
"""


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: `lmcache server` with its embedded defaults (extra args after --)."""
    install_everything(session)
    session.run("lmcache", "server", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks with JSON output into bench-results/."""
    install_everything(session)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    session.run("lmcache", "bench", "kernels", "--output", str(out / "kernels.json"))


@nox.session
def native(session: nox.Session) -> None:
    """Build and run the C++ connector framework's unit tests (CMake + ctest)."""
    session.error("the native connector framework has not landed yet")


@nox.session
def cuda(session: nox.Session) -> None:
    """Compile the CUDA kernels with nvcc and run their host-side unit tests."""
    session.error("the CUDA device wheel has not landed yet")


@nox.session
def compat(session: nox.Session) -> None:
    """Optional: our server against LMCache 0.5.6's client and the reverse (not part of tests)."""
    session.error("the compat check has not landed yet")


@nox.session
def vllm(session: nox.Session) -> None:
    """Optional: instantiate LMCacheMPConnector against vLLM 0.33's real KVConnectorBase_V1."""
    session.error("the vLLM check has not landed yet")
