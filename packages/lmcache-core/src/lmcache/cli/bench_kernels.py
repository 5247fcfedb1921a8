"""``lmcache bench kernels``: time the torch baseline's block KV transfer against a plain copy.

One request of 512 tokens, 32 layers x 8 heads x 128 dims, fp16, vLLM NHD layout
(EngineKVFormat #1), 16-token blocks, 256-token chunks. D2H (store) and H2D
(retrieve) are each compared with ``Tensor.copy_`` of the same number of bytes,
measured in the same run. Prints JSON (and writes it to ``--output``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

from lmcache.cli.errors import CLIError
from lmcache.cli.report import add_json_output_arg, print_json_result

TOKENS = 512
LAYERS = 32
HEADS = 8
HEAD_SIZE = 128
BLOCK = 16
CHUNK = 256
ENGINE_BLOCKS = 128  # the engine cache holds more blocks than one request uses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_output_arg(parser)
    parser.add_argument(
        "--iterations", type=int, default=20, help="timed runs per case (default 20)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.set_defaults(func=run)


def _time(fn: Any, iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def _summary(samples_ms: list[float], nbytes: int) -> dict[str, float]:
    p50 = statistics.median(samples_ms)
    return {
        "p50_ms": round(p50, 4),
        "mean_ms": round(statistics.fmean(samples_ms), 4),
        "min_ms": round(min(samples_ms), 4),
        "gb_per_s": round(nbytes / (p50 / 1000.0) / 1e9, 3),
    }


def measure(iterations: int = 20, warmup: int = 3, seed: int = 0) -> dict[str, Any]:
    import torch

    from lmcache.v1.platform.ops_types import (
        EngineKVFormat,
        PageBufferShapeDesc,
        TransferDirection,
    )
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    paged = [
        torch.randn(2, ENGINE_BLOCKS, BLOCK, HEADS, HEAD_SIZE, generator=g).to(dtype)
        for _ in range(LAYERS)
    ]
    n_blocks = TOKENS // BLOCK
    block_ids = torch.randperm(ENGINE_BLOCKS, generator=g)[:n_blocks].tolist()
    n_chunks = TOKENS // CHUNK
    chunks = [
        torch.empty(2, LAYERS, CHUNK, HEADS * HEAD_SIZE, dtype=dtype) for _ in range(n_chunks)
    ]
    desc = PageBufferShapeDesc(
        kv_size=2,
        nl=LAYERS,
        nb=ENGINE_BLOCKS,
        bs=BLOCK,
        nh=HEADS,
        hs=HEAD_SIZE,
        element_size=2,
        block_stride_elems=0,
        dtype=dtype,
    )
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    nbytes = sum(c.numel() * c.element_size() for c in chunks)

    def d2h() -> None:
        multi_layer_block_kv_transfer(
            paged, chunks, block_ids, "cpu", TransferDirection.D2H, desc, CHUNK, fmt, 0
        )

    def h2d() -> None:
        multi_layer_block_kv_transfer(
            paged, chunks, block_ids, "cpu", TransferDirection.H2D, desc, CHUNK, fmt, 0
        )

    # Baseline: one contiguous copy of exactly the bytes the transfer moves.
    src = torch.randn(nbytes // 2, generator=g).to(dtype)
    dst = torch.empty_like(src)

    def plain_copy() -> None:
        dst.copy_(src)

    results: dict[str, Any] = {}
    for name, fn in (("d2h", d2h), ("h2d", h2d)):
        base = _summary(_time(plain_copy, iterations, warmup), nbytes)
        op = _summary(_time(fn, iterations, warmup), nbytes)
        results[name] = {
            "multi_layer_block_kv_transfer": op,
            "plain_copy": base,
            "ratio_p50": round(op["p50_ms"] / base["p50_ms"], 3),
            "within_2x": op["p50_ms"] <= 2.0 * base["p50_ms"],
        }
    # Correctness guard: what went out must come back.
    check = [torch.zeros_like(p) for p in paged]
    multi_layer_block_kv_transfer(
        check, chunks, block_ids, "cpu", TransferDirection.H2D, desc, CHUNK, fmt, 0
    )
    ids = torch.tensor(block_ids)
    roundtrip_ok = all(
        torch.equal(c[:, ids], p[:, ids]) for c, p in zip(check, paged, strict=False)
    )
    return {
        "benchmark": "kernels",
        "op": "multi_layer_block_kv_transfer (torch baseline)",
        "device": "cpu",
        "config": {
            "tokens": TOKENS,
            "layers": LAYERS,
            "heads": HEADS,
            "head_size": HEAD_SIZE,
            "dtype": "float16",
            "engine_kv_format": f"{fmt.name} (#{int(fmt)})",
            "block_size": BLOCK,
            "chunk_size": CHUNK,
            "bytes_per_direction": nbytes,
            "iterations": iterations,
            "warmup": warmup,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "results": results,
        "roundtrip_ok": roundtrip_ok,
    }


def run(args: argparse.Namespace) -> int:
    if args.iterations <= 0 or args.warmup < 0:
        raise CLIError(
            f"--iterations must be > 0 and --warmup >= 0 (got {args.iterations}, {args.warmup})"
        )
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise CLIError(f"'lmcache bench kernels' needs torch: {exc}") from None
    report = measure(args.iterations, args.warmup)
    print_json_result(report, args.output)
    return 0 if report["roundtrip_ok"] else 1
