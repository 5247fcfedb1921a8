"""``turboquant`` serde interchange with LMCache 0.5.6 through a real fs L2 directory.

0.5.6's codec is Triton kernels for CUDA; on a host without a GPU its side runs them under
Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors; tests/compat/serde_fs_driver.py
has the test-only shim), which needs ``triton`` in the 0.5.6 venv (``nox -s compat`` installs
it). For each preset, 0.5.6 and ours each store the same four objects (bfloat16
``[2, 4, 16, 64]``: one raw layer at each end, two quantized, one head of 64), then both
sides load both directories:

* what 0.5.6 stored, our decode equals 0.5.6's decode bit for bit, and the reverse;
* the stored files are byte-identical, except, for ``turboquant_k8v4``, some fp8 key bytes:
  the interpreter's float -> fp8 cast is not the GPU's (it rounds ties away from zero, drops
  the carry into the exponent and turns values below fp8's range into small numbers; on a
  GPU, SM89+, 0.5.6 casts with ``cvt.rn.satfinite``: round-to-nearest-even, saturated at
  +-448), so there ours must be that cast of the source and only key bytes may differ.

Needs LMCACHE_COMPAT_VENV (see conftest.py). About 20-40 s (three processes).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from testsupport.serde_compat import ALL_HITS, drive, files

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
# the driver's objects: [2, 4 layers, 16 tokens, 64] bfloat16; one quantized token slot of a
# k8v4 object: 64 fp8 key bytes, then the value part (32 + 4 bytes)
RAW_BYTES = 2 * 16 * 64 * 2


def spec(base, preset: str) -> dict:
    serde = {
        "type": "turboquant",
        "preset": preset,
        "head_dim": 64,
        "skip_first_layers": 1,
        "skip_last_layers": 1,
    }
    return {"type": "fs", "base_path": str(base), "serde": serde}


@pytest.fixture(scope="module")
def exchanged(venvs, tmp_path_factory):
    theirs_py = venvs["theirs"] / "bin" / "python"
    probe = subprocess.run([str(theirs_py), "-c", "import triton"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            "triton is not installed in the 0.5.6 venv (0.5.6's turboquant runs as Triton "
            "kernels; `pip install triton` there, as nox -s compat does)"
        )
    root = tmp_path_factory.mktemp("turboquant")
    written = {side: {p: root / side / p / "fs" for p in PRESETS} for side in ("theirs", "ours")}

    def out(side: str, p: str, what: str):
        return root / side / p / what

    drive(
        venvs,
        "ours",
        *(("store", spec(written["ours"][p], p), out("ours", p, "w")) for p in PRESETS),
    )
    theirs_env = {"TRITON_INTERPRET": "1"}
    steps = [("store", spec(written["theirs"][p], p), out("theirs", p, "w")) for p in PRESETS]
    for writer in ("theirs", "ours"):
        steps += [
            ("load", spec(written[writer][p], p), out("theirs", p, f"from-{writer}"))
            for p in PRESETS
        ]
    got_theirs = drive(venvs, "theirs", *steps, env=theirs_env)
    got_ours = drive(
        venvs,
        "ours",
        *(
            ("load", spec(written[writer][p], p), out("ours", p, f"from-{writer}"))
            for writer in ("theirs", "ours")
            for p in PRESETS
        ),
    )
    return root, written, got_theirs, got_ours


def test_every_store_and_load_succeeds(exchanged):
    _, _, got_theirs, got_ours = exchanged
    assert got_theirs == [{"stored": True}] * 4 + [ALL_HITS] * 8
    assert got_ours == [ALL_HITS] * 8


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("writer", ["theirs", "ours"])
def test_both_sides_decode_what_either_stored_bit_for_bit_alike(exchanged, preset, writer):
    root = exchanged[0]
    loaded = {
        side: (root / side / preset / f"from-{writer}" / "loaded.bin").read_bytes()
        for side in ("theirs", "ours")
    }
    assert loaded["ours"] == loaded["theirs"]
    source = (root / writer / preset / "w" / "source.bin").read_bytes()
    assert loaded["ours"] != source  # really quantized
    decoded = torch.frombuffer(bytearray(loaded["ours"]), dtype=torch.bfloat16).float()
    original = torch.frombuffer(bytearray(source), dtype=torch.bfloat16).float()
    rel = (decoded - original).norm() / original.norm()
    assert rel < 0.2, rel  # close to the source, not garbage


@pytest.mark.parametrize("preset", PRESETS)
def test_stored_files_are_byte_identical_but_for_the_interpreters_fp8_cast(exchanged, preset):
    root, written = exchanged[0], exchanged[1]
    theirs, ours = files(written["theirs"][preset]), files(written["ours"][preset])
    assert len(ours) == 4 and theirs.keys() == ours.keys()
    if preset != "turboquant_k8v4":
        assert theirs == ours
        return
    # the source keys of the quantized layers (1 and 2), in key order as the files sort
    source = (root / "ours" / preset / "w" / "source.bin").read_bytes()
    src = torch.frombuffer(bytearray(source), dtype=torch.bfloat16).view(4, 2, 4, 16, 64)
    keys = src[:, 0, 1:3].reshape(4, -1, 64).float()
    rne = keys.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    slot = 100  # 64 fp8 key bytes + 32 packed value bytes + fp16 scale + fp16 min
    for name in ours:
        a = torch.frombuffer(bytearray(theirs[name]), dtype=torch.uint8)
        b = torch.frombuffer(bytearray(ours[name]), dtype=torch.uint8)
        assert torch.equal(a[:RAW_BYTES], b[:RAW_BYTES])  # raw first layer
        assert torch.equal(a[-RAW_BYTES:], b[-RAW_BYTES:])  # raw last layer
        qa, qb = a[RAW_BYTES:-RAW_BYTES].view(-1, slot), b[RAW_BYTES:-RAW_BYTES].view(-1, slot)
        assert torch.equal(qa[:, 64:], qb[:, 64:])  # values, scales, mins
        ka = qa[:, :64].contiguous().view(torch.float8_e4m3fn).float()
        kb = qb[:, :64].contiguous().view(torch.float8_e4m3fn).float()
        # ours: each source key element cast round-to-nearest-even (saturating), as a GPU
        assert any(torch.equal(kb, r) for r in rne), name
        # the interpreter's cast differs on a few elements (ties, lost carries, values below
        # fp8's range), and only there
        assert 0 < (ka != kb).sum() < ka.numel() // 4
