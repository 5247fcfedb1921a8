"""A vLLM-free harness that drives ``LMCacheMPConnector`` in vLLM's call order.

Only what the connector reads is modelled: small stand-ins for ``VllmConfig``,
``KVCacheConfig``, ``Request``, ``KVCacheBlocks``, ``SchedulerOutput``,
``ForwardContext`` and ``KVConnectorOutput``, a block allocator, and a toy
"model" whose KV for a token is a deterministic function of the token prefix,
the layer and the TP rank. KV caches are CPU tensors shaped as vLLM 0.32 passes them: 4-D views of
one shared buffer (``[NB, NH, BS, 2*HS]`` per layer for the CPU backend's HND layout), the
model writing through its own views; older vLLM's 5-D tensors with ``kv_shape="split"``,
``[NB, BS, HS]`` for MLA.

Per step it calls, like vLLM's scheduler and model runner:
  scheduler: get_num_new_matched_tokens (again while it returns None) ->
             update_state_after_alloc -> build_connector_meta
  workers:   bind_connector_metadata -> handle_preemptions -> start_load_kv ->
             wait_for_layer_load / save_kv_layer per layer -> wait_for_save ->
             get_finished -> get_block_ids_with_load_errors -> clear_connector_metadata
  scheduler: update_connector_output, request_finished for finished requests;
             blocks of a request are freed only after all workers reported it in
             finished_sending.
"""

from __future__ import annotations

import mmap
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.vllm_base import KVConnectorRole

# ---------------------------------------------------------------------------
# Stand-ins for vLLM's config and scheduler objects
# ---------------------------------------------------------------------------


@dataclass
class KVTransferConfig:
    kv_connector: str = "LMCacheMPConnector"
    kv_connector_module_path: str = "lmcache.integration.vllm.lmcache_mp_connector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")


@dataclass
class ModelConfig:
    model: str = "harness/toy-model"
    use_mla: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_layout: str | None = None


@dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    model_config: ModelConfig
    parallel_config: ParallelConfig
    cache_config: CacheConfig


@dataclass
class KVCacheSpec:
    block_size: int


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]


@dataclass
class KVCacheBlocks:
    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.block_ids)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None
    kv_connector_metadata: Any = None


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)


class ForwardContext:
    """vLLM passes its forward context to start_load_kv; the connector reads nothing from it."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int = 1
    cache_salt: str | None = None
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # harness bookkeeping
    status: str = "waiting"  # waiting | loading | loaded | running | finished
    block_ids: list[int] = field(default_factory=list)
    apc_tokens: int = 0
    external_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def make_vllm_config(
    *,
    port: int,
    host: str = "tcp://127.0.0.1",
    tp: int = 1,
    rank: int = 0,
    mla: bool = False,
    block_size: int = 16,
    extra: dict[str, Any] | None = None,
    model: str = "harness/toy-model",
) -> VllmConfig:
    cfg = {"lmcache.mp.host": host, "lmcache.mp.port": str(port)}
    cfg.update(extra or {})
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector_extra_config=cfg),
        model_config=ModelConfig(model=model, use_mla=mla),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
        cache_config=CacheConfig(block_size=block_size),
    )


# ---------------------------------------------------------------------------
# The toy model: KV is a deterministic function of (prefix, layer, rank)
# ---------------------------------------------------------------------------


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) % 2147483647
        out.append(h)
    return out


@dataclass
class ToyModel:
    """``fused`` (the default) is vLLM >= 0.29: every layer a 4-D ``[NB, NH, BS, 2*HS]``
    (HND) or ``[NB, BS, NH, 2*HS]`` (NHD) view of ONE shared int8 buffer, as vLLM's
    ``allocate_kv_cache`` makes them (vLLM 0.32's CPU backend: LBHNC, i.e. HND). The
    attention layers then hold their own views of that buffer (``bind_kv_cache``), so the
    model never writes through the tensors the connector was given. Inside a CS row the
    HND (CPU) backend keeps a block-head's K rows then its V rows (``view(.., 2*BS, HS)``),
    the NHD (GPU) backends K then V per token. ``fused=False`` gives the 5-D per-layer
    tensors of older vLLM (``[2, NB, BS, NH, HS]`` / HND ``[2, NB, NH, BS, HS]``)."""

    num_layers: int = 2
    num_heads: int = 2
    head_size: int = 8
    mla: bool = False
    hnd: bool = False  # heads before tokens inside a block
    fused: bool = True
    dtype: torch.dtype = torch.float16

    @property
    def width(self) -> int:
        return self.head_size if self.mla else self.num_heads * self.head_size

    def kv(self, tokens: list[int], start: int, end: int, layer: int, rank: int) -> torch.Tensor:
        """[kv_size, n, width] values for positions [start, end) (ints < 251: exact in fp16)."""
        hs = torch.tensor(prefix_hashes(tokens[:end])[start:end], dtype=torch.int64)
        kv_size = 1 if self.mla else 2
        r = 0 if self.mla else rank  # MLA KV is replicated over TP
        base = hs[None, :, None] + torch.arange(self.width)[None, None, :]
        offs = torch.tensor([31 * layer + 17 * k + 7 * r for k in range(kv_size)])[:, None, None]
        return ((base + offs) % 251).to(self.dtype)

    def next_token(self, tokens: list[int]) -> int:
        return prefix_hashes(tokens)[-1] % 30000 + 1

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        nb, bs, nh, hs = num_blocks, block_size, self.num_heads, self.head_size
        if self.mla:
            return (nb, bs, hs)
        if self.fused:
            return (nb, nh, bs, 2 * hs) if self.hnd else (nb, bs, nh, 2 * hs)
        return (2, nb, nh, bs, hs) if self.hnd else (2, nb, bs, nh, hs)

    def new_cache(self, num_blocks: int, block_size: int) -> dict[str, torch.Tensor]:
        """The per-layer tensors vLLM registers with the connector."""
        shape = self.layer_shape(num_blocks, block_size)
        names = [f"model.layers.{i}.attn" for i in range(self.num_layers)]
        if not self.fused:
            return {name: torch.zeros(shape, dtype=self.dtype) for name in names}
        per_layer = 1
        for d in shape:
            per_layer *= d
        # Whole pages of their own, as a large allocation gets from the C allocator.
        nbytes = per_layer * self.num_layers * self.dtype.itemsize
        pages = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        typed = torch.frombuffer(pages, dtype=torch.int8)[:nbytes].view(self.dtype)
        return {
            name: typed[i * per_layer : (i + 1) * per_layer].view(shape)
            for i, name in enumerate(names)
        }


def layer_views(cache: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The attention layers' own views of the registered caches (vLLM's ``bind_kv_cache``
    makes new tensor objects over the same memory): what the model reads and writes."""
    return [t.as_strided(t.shape, t.stride(), t.storage_offset()) for t in cache.values()]


def _slots(
    block_ids: list[int], start: int, end: int, bs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // bs]
    return blocks, pos % bs


def _kv_planes(model: ToyModel, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer's fused or split tensor, each indexed [block, token, head]
    (NHD order) so reads and writes need one code path."""
    nh, hs = model.num_heads, model.head_size
    if model.fused and model.hnd:  # CPU backend: [NB, NH, BS, 2HS] seen as [NB, NH, 2BS, HS]
        rows = t.view(t.shape[0], nh, -1, hs)
        bs = rows.shape[2] // 2
        return rows[:, :, :bs].transpose(1, 2), rows[:, :, bs:].transpose(1, 2)
    if model.fused:  # [NB, BS, NH, 2HS]: K then V per token
        return t[..., :hs], t[..., hs:]
    if model.hnd:
        return t[0].transpose(1, 2), t[1].transpose(1, 2)
    return t[0], t[1]


def write_kv(
    model: ToyModel,
    views: list[torch.Tensor],
    block_ids: list[int],
    bs: int,
    tokens: list[int],
    start: int,
    end: int,
    rank: int,
    offset: float = 0.0,
) -> None:
    if end <= start:
        return
    blk, off = _slots(block_ids, start, end, bs)
    for layer, t in enumerate(views):
        vals = model.kv(tokens, start, end, layer, rank) + offset
        if model.mla:
            t[blk, off] = vals[0]
            continue
        for plane, v in zip(_kv_planes(model, t), vals, strict=True):
            plane[blk, off] = v.view(-1, model.num_heads, model.head_size)


def read_kv(
    model: ToyModel,
    views: list[torch.Tensor],
    block_ids: list[int],
    bs: int,
    start: int,
    end: int,
) -> list[torch.Tensor]:
    blk, off = _slots(block_ids, start, end, bs)
    out = []
    for t in views:
        if model.mla:
            out.append(t[blk, off][None].clone())
            continue
        out.append(
            torch.stack([p[blk, off].reshape(end - start, -1) for p in _kv_planes(model, t)])
        )
    return out


def kv_matches(
    model: ToyModel,
    views: list[torch.Tensor],
    block_ids: list[int],
    bs: int,
    tokens: list[int],
    start: int,
    end: int,
    rank: int,
    offset: float = 0.0,
) -> bool:
    got = read_kv(model, views, block_ids, bs, start, end)
    return all(
        torch.equal(g, model.kv(tokens, start, end, layer, rank) + offset)
        for layer, g in enumerate(got)
    )


# ---------------------------------------------------------------------------
# The engine: one scheduler connector and N worker connectors, stepped in vLLM's order
# ---------------------------------------------------------------------------


class Engine:
    def __init__(
        self,
        *,
        port: int,
        tp: int = 1,
        mla: bool = False,
        block_size: int = 16,
        num_blocks: int = 256,
        num_layers: int = 2,
        extra: dict[str, Any] | None = None,
        model_name: str = "harness/toy-model",
        host: str = "tcp://127.0.0.1",
        register: bool = True,
        kv_layout: str = "HND",
        kv_shape: str = "fused",
    ) -> None:
        if kv_shape not in ("fused", "split"):
            raise ValueError(f"kv_shape {kv_shape!r}: expected 'fused' (vLLM >= 0.29) or 'split'")
        self.bs = block_size
        self.model = ToyModel(
            num_layers=num_layers, mla=mla, hnd=kv_layout == "HND", fused=kv_shape == "fused"
        )
        self.num_blocks = num_blocks
        self.tp = tp
        # what get_num_new_matched_tokens answers for a hit: vLLM's load_kv_async
        sync = str((extra or {}).get("lmcache.mp.sync_load", "true")).lower()
        self.load_async = sync in ("false", "0", "no", "off")

        def cfg(rank: int) -> VllmConfig:
            c = make_vllm_config(
                port=port,
                host=host,
                tp=tp,
                rank=rank,
                mla=mla,
                block_size=block_size,
                extra=extra,
                model=model_name,
            )
            c.cache_config.kv_cache_layout = kv_layout
            return c

        layer_names = [f"model.layers.{i}.attn" for i in range(num_layers)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_groups=[KVCacheGroupSpec(layer_names, KVCacheSpec(block_size))],
        )
        self.scheduler = LMCacheMPConnector(cfg(0), KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.workers = [
            LMCacheMPConnector(cfg(r), KVConnectorRole.WORKER, self.kv_cache_config)
            for r in range(tp)
        ]
        self.caches = [self.model.new_cache(num_blocks, block_size) for _ in range(tp)]
        # the attention layers bind their own views before vLLM registers the caches
        self.views = [layer_views(cache) for cache in self.caches]
        if register:
            self.register()
        self.free_blocks = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.requests: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.holding: dict[str, Request] = {}  # finished, blocks kept until finished_sending
        self._finished_since_last: set[str] = set()
        self._to_preempt: set[str] = set()
        self._send_counts: dict[str, int] = {}
        self._recv_counts: dict[str, int] = {}
        # observations for tests
        self.match_results: dict[str, list[tuple[int | None, bool]]] = {}
        self.finished_results: dict[str, bool] = {}
        self.loaded_ok: dict[str, int] = {}
        self.load_failed: set[str] = set()
        self.metas: list[Any] = []
        self.apc_marker: float | None = None
        self.apc_intact: dict[str, bool] = {}

    def register(self) -> None:
        for w, cache in zip(self.workers, self.caches, strict=True):
            w.register_kv_caches(cache)

    # -- requests -----------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        tokens: list[int],
        *,
        max_new_tokens: int = 2,
        apc_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        req = Request(
            rid,
            list(tokens),
            max_new_tokens=max_new_tokens,
            cache_salt=cache_salt,
            apc_tokens=apc_tokens,
        )
        self.requests[rid] = req
        self.waiting.append(rid)
        self.scheduler.on_new_request(req)
        return req

    def preempt(self, rid: str) -> None:
        self._to_preempt.add(rid)

    def abort(self, rid: str) -> bool:
        """Finish a request now (as vLLM does on a client abort)."""
        req = self.requests[rid]
        for q in (self.waiting, self.running):
            if rid in q:
                q.remove(rid)
        return self._finish(req)

    def _alloc(self, req: Request, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.bs) - len(req.block_ids)
        if need > len(self.free_blocks):
            raise RuntimeError("harness ran out of KV blocks")
        new = [self.free_blocks.pop(0) for _ in range(max(0, need))]
        req.block_ids.extend(new)
        return new

    def _free(self, req: Request) -> None:
        self.free_blocks.extend(req.block_ids)
        req.block_ids = []

    def _finish(self, req: Request) -> bool:
        req.status = "finished"
        held, _ = self.scheduler.request_finished(req, list(req.block_ids))
        self.finished_results[req.request_id] = held
        self._finished_since_last.add(req.request_id)
        if held:
            self.holding[req.request_id] = req
        else:
            self._free(req)
        return held

    # -- one engine step -------------------------------------------------------------------
    def step(self, before_workers: Any = None) -> SchedulerOutput:
        """One engine step; ``before_workers()`` (optional) runs between the scheduler's
        ``build_connector_meta`` and the workers' half (e.g. to stop the server there)."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_sched: dict[str, int] = {}

        preempted = {rid for rid in self._to_preempt if rid in self.running}
        self._to_preempt.clear()
        for rid in preempted:
            req = self.requests[rid]
            self.running.remove(rid)
            self._free(req)
            req.num_computed_tokens = 0
            req.status = "waiting"
            req.apc_tokens = 0
            self.waiting.insert(0, rid)

        for rid in list(self.running):
            req = self.requests[rid]
            n = (
                1
                if req.num_computed_tokens >= req.num_prompt_tokens
                else (req.num_prompt_tokens - req.num_computed_tokens)
            )
            new = self._alloc(req, req.num_computed_tokens + n)
            cached.req_ids.append(rid)
            cached.new_block_ids.append((new,) if new else None)
            cached.new_token_ids.append([])
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_sched[rid] = n

        sync_loads: list[str] = []
        for rid in [] if preempted else list(self.waiting):
            req = self.requests[rid]
            if req.status == "loading":
                continue
            if req.status == "loaded":
                n = req.num_tokens - req.num_computed_tokens
                self._alloc(req, req.num_tokens)
                self.scheduler.update_state_after_alloc(
                    req, KVCacheBlocks((list(req.block_ids),)), 0
                )
            else:
                ext, _async = self.scheduler.get_num_new_matched_tokens(req, req.apc_tokens)
                self.match_results.setdefault(rid, []).append((ext, _async))
                if ext is None:
                    continue
                self._alloc(req, req.num_tokens)
                if req.apc_tokens:
                    # vLLM's prefix cache already holds these tokens' KV.
                    for rank, views in enumerate(self.views):
                        write_kv(
                            self.model,
                            views,
                            req.block_ids,
                            self.bs,
                            req.all_token_ids,
                            0,
                            req.apc_tokens,
                            rank,
                            offset=self.apc_marker or 0.0,
                        )
                self.scheduler.update_state_after_alloc(
                    req, KVCacheBlocks((list(req.block_ids),)), ext
                )
                if ext > 0 and _async:
                    req.status = "loading"
                    req.external_tokens = ext
                    req.num_computed_tokens = req.apc_tokens + ext
                    continue
                # vLLM's synchronous external load: the workers copy the hit in this step's
                # start_load_kv, before the forward computes the rest of the prompt.
                req.external_tokens = ext
                req.num_computed_tokens = req.apc_tokens + ext
                if ext > 0:
                    sync_loads.append(rid)
                n = req.num_tokens - req.num_computed_tokens
            self.waiting.remove(rid)
            self.running.append(rid)
            req.status = "running"
            new_reqs.append(
                NewRequestData(
                    rid, list(req.prompt_token_ids), (list(req.block_ids),), req.num_computed_tokens
                )
            )
            num_sched[rid] = n

        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=set(self._finished_since_last),
            preempted_req_ids=preempted,
        )
        self._finished_since_last.clear()
        meta = self.scheduler.build_connector_meta(so)
        so.kv_connector_metadata = meta
        self.metas.append(meta)
        wire_meta = pickle.loads(pickle.dumps(meta))  # vLLM ships it to worker processes
        if before_workers is not None:
            before_workers()

        sending_all: set[str] = set()
        recving_all: set[str] = set()
        errors: set[int] = set()
        for rank, (w, cache) in enumerate(zip(self.workers, self.caches, strict=True)):
            w.bind_connector_metadata(wire_meta)
            w.handle_preemptions(wire_meta)
            w.start_load_kv(ForwardContext())
            for rid, n in num_sched.items():
                req = self.requests[rid]
                write_kv(
                    self.model,
                    self.views[rank],
                    req.block_ids,
                    self.bs,
                    req.all_token_ids,
                    req.num_computed_tokens,
                    req.num_computed_tokens + n,
                    rank,
                )
            for name, layer in cache.items():
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, layer, None)
            w.wait_for_save()
            # vLLM 0.32's kv_connector_model_runner_mixin: attributes of the result object
            results = w.get_transfer_results(so.finished_req_ids)
            sending, recving = results.finished_sending, results.finished_recving
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            for rid in sending or ():
                self._send_counts[rid] = self._send_counts.get(rid, 0) + 1
            for rid in recving or ():
                self._recv_counts[rid] = self._recv_counts.get(rid, 0) + 1
        for counts, out in ((self._send_counts, sending_all), (self._recv_counts, recving_all)):
            for rid, c in list(counts.items()):
                if c >= self.tp:
                    out.add(rid)
                    del counts[rid]
        self.scheduler.update_connector_output(
            KVConnectorOutput(sending_all or None, recving_all or None, errors)
        )

        for rid in sync_loads:
            req = self.requests[rid]
            if errors & set(req.block_ids):
                # vLLM drops this step's output and recomputes from the first bad block
                self.load_failed.add(rid)
                req.num_computed_tokens = req.apc_tokens
                del num_sched[rid]
            else:
                self._check_loaded(req)

        # model outputs: advance computed tokens, sample, finish
        for rid, n in num_sched.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.all_token_ids.append(self.model.next_token(req.all_token_ids))
                if req.num_tokens - req.num_prompt_tokens >= req.max_new_tokens:
                    self.running.remove(rid)
                    self._finish(req)

        for rid in recving_all:
            req = self.requests.get(rid)
            if req is None or req.status != "loading":
                continue
            if errors & set(req.block_ids):
                self.load_failed.add(rid)
                req.num_computed_tokens = req.apc_tokens  # recompute what failed to load
            else:
                self._check_loaded(req)
            req.status = "loaded"

        for rid in sending_all:
            req = self.holding.pop(rid, None)
            if req is not None:
                self._free(req)
        return so

    def _check_loaded(self, req: Request) -> None:
        """Record whether the loaded range [apc, apc + external) is byte-identical on every
        rank and (with ``apc_marker``) whether vLLM's own prefix-cache blocks stayed intact."""
        end = req.apc_tokens + req.external_tokens
        self.loaded_ok[req.request_id] = end if self._kv_is(req, req.apc_tokens, end) else -1
        if self.apc_marker is not None and req.apc_tokens:
            self.apc_intact[req.request_id] = self._kv_is(
                req, 0, req.apc_tokens, offset=self.apc_marker
            )

    def _kv_is(self, req: Request, start: int, end: int, offset: float = 0.0) -> bool:
        """Whether every rank holds the model's KV for tokens [start, end) of ``req``."""
        return all(
            kv_matches(
                self.model,
                views,
                req.block_ids,
                self.bs,
                req.all_token_ids,
                start,
                end,
                rank,
                offset=offset,
            )
            for rank, views in enumerate(self.views)
        )

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.holding)

    def run(self, max_steps: int = 400, sleep: float = 0.01) -> None:
        import time

        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
            time.sleep(sleep)
        raise AssertionError(
            f"engine did not drain in {max_steps} steps: waiting={self.waiting} "
            f"running={self.running} holding={list(self.holding)}"
        )

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for w in self.workers:
            w.shutdown()
        self.scheduler.shutdown()
