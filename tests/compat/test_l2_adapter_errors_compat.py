"""Bad ``--l2-adapter`` values: 0.5.6's ``lmcache server`` and ours get the same command line,
both stop with a non-zero exit, and ours prints 0.5.6's sentence verbatim at the start of its
one error line (0.5.6 prints it as the last line of a traceback, after ``ValueError: ``).
Where the sentence lists the known types, each side lists its own installed ones; ours then
adds the fix. Needs LMCACHE_COMPAT_VENV (see conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MOCK = json.dumps({"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 1})
# Both reach --l2-adapter parsing only with an L1 size and policy (0.5.6 insists on them).
BASE = ("server", "--l1-size-gb", "1", "--eviction-policy", "LRU", "--port", "0")
OURS_PREFIX = "lmcache server: error: "
UNKNOWN = re.compile(r"^(--l2-adapter #\d+: unknown adapter type .+?\. Known: )(.*)$")

CASES = {
    "invalid JSON": ["notjson"],
    "not an object (list)": ["[1, 2]"],
    "not an object (string)": ['"fs"'],
    "missing type": ['{"base_path": "/tmp"}'],
    "null type": ['{"type": null}'],
    "unknown type": ['{"type": "x"}'],
    "unknown type, second flag": [MOCK, '{"type": "nope"}'],
    "refused 0.5.6 type": ['{"type": "p2p"}'],
    "non-string type": ['{"type": 1}'],
    "from_dict: missing field": ['{"type": "mock"}'],
    "from_dict: bad value": ['{"type": "mock", "max_size_gb": -1, "mock_bandwidth_gb": 1}'],
    "bad affinity_tag": [json.dumps({**json.loads(MOCK), "affinity_tag": ""})],
    "bad eviction policy": [json.dumps({**json.loads(MOCK), "eviction": {"eviction_policy": "X"}})],
}


def _argv(values: list[str]) -> list[str]:
    return [*BASE, *(a for v in values for a in ("--l2-adapter", v))]


def _theirs_sentence(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("ValueError: ")]
    assert lines, stderr[-3000:]
    return lines[-1].removeprefix("ValueError: ")


def _ours_message(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(OURS_PREFIX)]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0].removeprefix(OURS_PREFIX)


@pytest.fixture(scope="module")
def outcomes(venvs: dict[str, Path], lmcache_cli) -> dict[str, dict[str, object]]:
    """Each case run by both CLIs (0.5.6 needs ~2 s per start, so two at a time)."""
    jobs = [(name, side) for name in CASES for side in ("theirs", "ours")]
    with ThreadPoolExecutor(2) as pool:
        procs = list(
            pool.map(
                lambda job: lmcache_cli(venvs[job[1]], *_argv(CASES[job[0]]), timeout=120), jobs
            )
        )
    out: dict[str, dict[str, object]] = {name: {} for name in CASES}
    for (name, side), proc in zip(jobs, procs, strict=True):
        out[name][side] = proc
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_ours_prints_0_5_6_s_sentence_first(outcomes, case):
    theirs, ours = outcomes[case]["theirs"], outcomes[case]["ours"]
    assert theirs.returncode == 1, theirs.stderr[-3000:]
    assert ours.returncode != 0, ours.stderr[-3000:]
    sentence = _theirs_sentence(theirs.stderr)
    message = _ours_message(ours.stderr)
    if case == "refused 0.5.6 type":  # intended difference: ours refuses the type itself
        from lmcache.v1.errors import L2_TYPE_REFUSALS

        assert sentence.startswith("--l2-adapter #1 ('p2p'): "), sentence  # a missing field
        assert message == L2_TYPE_REFUSALS["p2p"].message("p2p", "--l2-adapter #1")
        return
    match = UNKNOWN.match(sentence)
    if match is None:
        assert message == sentence
        return
    # The known types are each side's installed ones: compare up to the list, then ours must
    # list exactly its own types and follow them with the fix.
    from lmcache.v1.distributed.l2_adapters.config import get_registered_l2_adapter_types

    head = match.group(1)
    assert message.startswith(head), (message, sentence)
    known = ", ".join(get_registered_l2_adapter_types())
    assert message.startswith(f"{head}{known}. "), message
    assert "`lmcache plugins`" in message


def test_refused_type_says_why_and_never_gets_a_pip_hint(outcomes):
    message = _ours_message(outcomes["refused 0.5.6 type"]["ours"].stderr)
    assert "L2 adapter type 'p2p' (LMCache 0.5.6's" in message
    assert "is not provided by this release" in message and "Use instead: " in message
    assert "unknown" not in message and "pip install" not in message
    assert "pip install" not in _ours_message(outcomes["unknown type"]["ours"].stderr)


def test_the_types_0_5_6_registers_are_all_accounted_for(compat_venv):
    """Every type 0.5.6 ships is ours (core or a wheel of ours) or listed as not provided."""
    from lmcache.v1.errors import L2_TYPE_REFUSALS, L2_TYPE_WHEELS, LMCACHE_056_ONLY_L2_TYPES

    script = (
        "import pathlib, re, lmcache.v1.distributed.l2_adapters as p\n"
        "names = set()\n"
        "for f in pathlib.Path(p.__path__[0]).glob('*_l2_adapter.py'):\n"
        '    names |= set(re.findall(r\'register_l2_adapter_type\\(\\s*"([^"]+)"\', f.read_text()))\n'
        "print(' '.join(sorted(names)))\n"
    )
    proc = subprocess.run(
        [str(compat_venv / "bin" / "python"), "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = set(proc.stdout.split())
    assert len(theirs) >= 20, theirs
    core = {"fault_inject", "mock", "native_plugin", "plugin"}
    ours = core | set(L2_TYPE_WHEELS) | LMCACHE_056_ONLY_L2_TYPES
    assert theirs <= ours, sorted(theirs - ours)
    assert not LMCACHE_056_ONLY_L2_TYPES - theirs, sorted(LMCACHE_056_ONLY_L2_TYPES - theirs)
    assert set(L2_TYPE_REFUSALS) <= LMCACHE_056_ONLY_L2_TYPES
