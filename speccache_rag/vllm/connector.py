"""``SpecCacheConnector``: SpecCache as a vLLM v1 KV connector (``--kv-transfer-config`` as
``speccache_rag.vllm.kv_transfer_config(...)`` builds it; options: ``deployment.Options``, docs/vllm.md).

Scheduler side (one instance in the engine core):
  * ``on_new_request`` finds the request's chunks — ``kv_transfer_params["speccache"]["spans"]`` when
    the caller gives them, else stored chunks found by token content — and plans a blend. A blended
    request gets a unique ``cache_salt`` (block hashes recomputed), so its approximate KV can never
    be served to another request as an exact prefix-cache hit, nor can it hit exact blocks.
  * ``get_num_new_matched_tokens`` claims every prompt token but the last (that one vLLM computes,
    attending to the blended cache, and samples from); the rest of the plan rides in the metadata.
Worker side (one instance per worker): ``start_load_kv`` runs :class:`.blend.PagedBlender` for each
planned request before the forward pass; a failure marks the request's blocks invalid, and vLLM
recomputes them (``kv_load_failure_policy="recompute"``, which the connector sets) — plain prefill,
never wrong output. Per-request statistics are logged (``SpecCache: req=… reused=… hits=…``), sent
back to the scheduler, and returned as the finished request's ``kv_transfer_params["speccache"]``.

Per-request parameters and the reports that answer them are the wire protocol, ``speccache_rag/wire.py``;
one ``Tracked`` record holds what the scheduler knows of a request until its report is out. A request's
``cache_salt`` is its tenant: every chunk key it reads or writes is made under it (``kv.tenant_fingerprint``).

Clients read the reused tokens as cached tokens (``usage.prompt_tokens_details.cached_tokens``), not the ``n - 1``
the connector claims (vLLM's prefix-cache metrics count those); the connector's own series: ``metrics.py``.
"""
from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ..config import ReuseConfig
from ..hardware import dtype_name
from ..kv import tenant_fingerprint
from ..prompt import RAGPrompt, sink_token_ids
from .. import wire
from .blend import PagedBlender
from .layers import Unsupported, slot_mapping
from .lookup import StoredChunkIndex, fingerprint_for, holds, shared_store
from .metrics import SpecCacheProm, SpecCacheStats
from .deployment import Options, unsupported_reason
from .tracked import TRACKED_MAX, Tracked

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM configures handlers for the "vllm" logger tree only: log under it so INFO lines show.
logger = init_logger("vllm.speccache")



@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    plan: dict


@dataclass
class SpecCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class SpecCacheWorkerMetadata(KVConnectorWorkerMetadata):
    reports: dict[str, dict] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if isinstance(other, SpecCacheWorkerMetadata):
            return SpecCacheWorkerMetadata({**self.reports, **other.reports})
        return self


class SpecCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if role == KVConnectorRole.WORKER:
            # The entry point normally did this already; if the connector is built before the model,
            # this also covers an environment where the entry point is missing. Idempotent.
            from .plugin import register

            register()
        self.options = Options.from_sources(self._kv_transfer_config.kv_connector_extra_config)
        # A blend that fails must be recomputed by vLLM, never served: force the recompute policy
        # (the scheduler reads it right after building its connector).
        try:
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        except Exception:  # a frozen config: the user's setting stands (documented)
            pass
        mc = vllm_config.model_config
        self.model_dir = str(mc.model)
        self.dtype = dtype_name(mc.dtype)
        self.block_size = self._block_size(vllm_config, kv_cache_config)
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.unsupported = unsupported_reason(vllm_config)
        if self.unsupported and role == KVConnectorRole.SCHEDULER:
            logger.warning("SpecCache: %s; every request falls back to plain vLLM prefill", self.unsupported)
        self.store, self.store_url = shared_store(self.options.store)
        self._fingerprint: str | None = None
        self._sink_ids: list[int] | None = None
        # scheduler state: one record per request it planned or answered, until its report is out
        self._tracked: OrderedDict[str, Tracked] = OrderedDict()
        self._claimed: list[str] = []                     # blends claimed since the last connector metadata
        self._index: StoredChunkIndex | None = None      # this model's stored chunks, of every tenant
        self._warned: set[str] = set()
        # worker state
        self._blender: PagedBlender | None = None
        self._blender_error: str | None = None
        self._failed_blocks: set[int] = set()
        self._out_reports: dict[str, dict] = {}
        self._stats = SpecCacheStats()           # what this side did since vLLM last asked (metrics.py)
        self._step = 0                                    # worker steps that blended something

    @staticmethod
    def _block_size(vllm_config, kv_cache_config) -> int:
        try:
            return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        except (AttributeError, IndexError, TypeError):
            return int(vllm_config.cache_config.block_size)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint_for(self.model_dir, self.dtype, self.options.sink)
        return self._fingerprint

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning("SpecCache: %s", msg)

    # ==== scheduler side ==========================================================================
    def _track(self, req_id: str) -> Tracked:
        rec = self._tracked.setdefault(req_id, Tracked())
        if len(self._tracked) > TRACKED_MAX:        # forget the oldest finished ones whose report never came
            for old in [k for k, r in self._tracked.items() if r.finished][: len(self._tracked) - TRACKED_MAX]:
                del self._tracked[old]
        return rec

    def on_new_request(self, request: "Request") -> None:
        try:
            query = wire.parse(wire.read(request.kv_transfer_params), len(request.prompt_token_ids or []))
        except Exception as e:  # a bad hint or option never fails the request: plain prefill
            self._warn_once(f"request {request.request_id}: {e}; plain prefill")
            self._stats.count("plain")
            return
        salt = request.cache_salt or None           # the tenant, as the client sent it (before we salt below)
        refused = self.options.refusal(query.op, salt)
        if refused:                                 # tenancy.py answers HTTP requests with it; here: no reuse
            self._warn_once(f"request {request.request_id}: {refused}")
            self._track(request.request_id).notes = {"error": refused}
            self._stats.count("refused")
            return
        if query.op == "info":
            try:
                self._track(request.request_id).notes = self._info(query.keys, salt)
            except Exception as e:  # answered, never fatal: the client names the error
                self._track(request.request_id).notes = {"error": f"{type(e).__name__}: {e}"}
            return
        if self.unsupported:
            return
        try:
            plan = self._plan(request, query, salt)
        except Exception as e:
            self._warn_once(f"request {request.request_id}: {e}; plain prefill")
            self._stats.count("plain")
            return
        if plan is None:
            return
        self._track(request.request_id).plan = plan
        if self.prefix_caching:
            # Blended KV is approximate: a unique salt keeps its blocks out of every other request's
            # prefix-cache lookups (and keeps this request from adopting exact blocks it will rewrite).
            request.cache_salt = f"{request.cache_salt or ''}|speccache:{uuid.uuid4().hex}"
            request.block_hashes = []
            request.update_block_hashes()

    def _plan(self, request: "Request", query: wire.Query, salt: str | None = None) -> dict | None:
        """What the worker does for this request (it travels in the connector metadata), or None: plain prefill.
        ``salt``: the request's tenant; every key it reads or writes is the tenant's."""
        ids = list(request.prompt_token_ids or [])
        if len(ids) < 2:
            return None
        if query.op == "precompute":
            reuse = ReuseConfig(method="reuse", recompute_ratio=0.0)
            return {"op": "precompute", "spans": query.spans, "reuse": asdict(reuse), "tag": query.tag, "salt": salt}
        method = query.method or self.options.method
        if method == "full":
            return None
        ratio = self.options.recompute_ratio if query.recompute_ratio is None else query.recompute_ratio
        reuse = self.options.reuse_config(method, ratio, query.reuse)
        if query.spans is not None:
            spans = query.spans
        elif query.chunks is not None:
            spans = self._place(request.request_id, ids, query.chunks, salt)
        elif self.options.lookup == "auto":
            found = self._stored_index().find(ids, tenant_fingerprint(self.fingerprint, salt))
            spans = [[s, e, key] for s, e, key in found]
        else:
            spans = []
        if not spans:
            return None
        prompt = asdict(query.prompt) if query.prompt is not None else None
        ignored = len(self._track(request.request_id).notes.get("ignored", ()))      # counted by the worker
        return {"op": "blend", "spans": spans, "reuse": asdict(reuse), "prompt": prompt, "tag": query.tag,
                "salt": salt, "ignored": ignored}

    def _stored_index(self) -> StoredChunkIndex:
        """This model's stored chunks, brought up to date (what was stored since the last request)."""
        if self._index is None:
            self._index = StoredChunkIndex(self.store, self.fingerprint, head=self.options.min_chunk_tokens)
        self._index.refresh()
        return self._index

    def _place(self, req_id: str, ids: list[int], keys, salt: str | None = None) -> list[list]:
        """Spans of the chunks a client named by key; every key that cannot be placed is reported."""
        placed, ignored = self._stored_index().place(ids, keys, tenant_fingerprint(self.fingerprint, salt))
        for key, reason in ignored:
            logger.warning("SpecCache: request %s: chunk id %s ignored: %s", req_id, key[:16], reason)
        if ignored:
            self._track(req_id).notes = {"ignored": [{"key": k, "reason": r} for k, r in ignored]}
        return [[s, e, key] for s, e, key in placed]

    def _info(self, keys, salt: str | None = None) -> dict:
        from ..models import load_tokenizer

        if self._sink_ids is None:
            self._sink_ids = sink_token_ids(load_tokenizer(self.model_dir), self.options.sink)
        info = {"fingerprint": self.fingerprint, "dtype": self.dtype, "sink": self.options.sink,
                "sink_ids": self._sink_ids,
                "method": self.options.method, "recompute_ratio": self.options.recompute_ratio,
                "stored": [k for k in keys if holds(self.store, tenant_fingerprint(self.fingerprint, salt), k)]}
        if self.unsupported:
            info["unsupported"] = self.unsupported
        return info

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        rec = self._tracked.get(request.request_id)
        if rec is None or rec.plan is None or rec.claimed:
            return 0, False
        n = request.num_prompt_tokens
        if num_computed_tokens != 0 or request.num_tokens != n:
            # resumed after preemption, or a local hit we did not plan for: let vLLM compute it exactly
            rec.plan = None
            return 0, False
        limit = self.options.max_blends_per_step
        if limit and len(self._claimed) >= limit:
            return None, False                            # this step's blends are taken: ask again next step
        return n - 1, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        rec = self._tracked.get(request.request_id)
        if rec is not None and rec.plan is not None and num_external_tokens > 0:
            rec.claimed = True
            rec.prefill_stats = request.prefill_stats
            self._claimed.append(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SpecCacheMetadata()
        claimed, self._claimed = set(self._claimed), []
        for new_req in scheduler_output.scheduled_new_reqs:
            rec = self._tracked.get(new_req.req_id)
            if new_req.req_id in claimed and rec is not None and rec.plan is not None:
                meta.loads.append(LoadSpec(new_req.req_id, list(new_req.prompt_token_ids or []),
                                           list(new_req.block_ids[0]), rec.plan))
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, SpecCacheWorkerMetadata):
            for req_id, report in worker_meta.reports.items():
                rec = self._tracked.get(req_id)
                if rec is None:
                    continue
                rec.correct_cached_tokens(report)
                if rec.finished:                          # nothing left to tell the client
                    self._tracked.pop(req_id, None)
                else:
                    rec.report = report

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rec = self._tracked.get(request.request_id)
        if rec is None:
            return False, None
        body = {**rec.notes, **(rec.report or {})}
        if rec.claimed and rec.report is None:            # its report may still come: keep the record for it
            rec.finished, rec.plan = True, None
        else:
            self._tracked.pop(request.request_id, None)
        return False, ({wire.PARAMS_KEY: body} if body else None)

    # ==== worker side =============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._ensure_blender()                            # model is loaded by now: fail/warn at startup

    def _ensure_blender(self) -> PagedBlender | None:
        if self._blender is not None or self._blender_error is not None or self.unsupported:
            return self._blender
        try:
            from .models import current_model

            model = current_model()
            if model is None:
                raise Unsupported("the model was not built through speccache_rag's vLLM plugin "
                                  "(is speccache-rag installed in vLLM's environment?)")
            blender = PagedBlender.start(model, self.model_dir, self.dtype, self.store, self.fingerprint, self.options,
                                         logger)
            self._blender = blender
            if self.options.gate:
                self._stats.count("gate_failed" if blender.core.gate_failed else "gate_passed")
            logger.info("SpecCache connector ready: store=%s draft=%s method=%s ratio=%s", self.store_url,
                        self.options.draft or "(target)", self.options.method, self.options.recompute_ratio)
        except Exception as e:
            self._blender_error = f"{type(e).__name__}: {e}"
            logger.warning("SpecCache: cannot blend (%s); requests fall back to plain vLLM prefill",
                           self._blender_error)
        return self._blender

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpecCacheMetadata) or not meta.loads:
            return
        blender = self._ensure_blender()
        self._step += 1
        for spec in meta.loads:
            n = len(spec.token_ids)
            claimed_blocks = spec.block_ids[: math.ceil((n - 1) / self.block_size)]
            plan, start = spec.plan, time.perf_counter()
            if blender is None:
                self._failed_blocks.update(claimed_blocks)
                self._stats.record(None, 0.0, failed=True)
                continue
            try:
                prompt = RAGPrompt(**plan["prompt"]) if plan.get("prompt") else None
                report = blender.blend(spec.token_ids, plan["spans"],
                                       ReuseConfig(**plan["reuse"]),
                                       slot_mapping(spec.block_ids, self.block_size, n - 1, blender.ops.device),
                                       prompt=prompt, precompute=plan["op"] == "precompute",
                                       cache_salt=plan.get("salt"))
            except Exception:
                logger.exception("SpecCache: blending request %s failed; vLLM recomputes it", spec.req_id)
                self._failed_blocks.update(claimed_blocks)
                self._stats.record(None, 0.0, failed=True)
                continue
            logger.info("SpecCache: req=%s %s", spec.req_id, report.line())
            out = {**report.to_dict(), "step": self._step, "batch": len(meta.loads)}
            self._stats.record(out, time.perf_counter() - start, ignored=plan.get("ignored", 0))
            self._out_reports[spec.req_id] = out
            if plan.get("tag"):
                wire.REPORTS.publish(plan["tag"], out)

    def get_kv_connector_stats(self) -> SpecCacheStats | None:
        stats, self._stats = self._stats, SpecCacheStats()
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SpecCacheStats:
        return SpecCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> SpecCacheProm:
        return SpecCacheProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._out_reports:
            return None
        reports, self._out_reports = self._out_reports, {}
        return SpecCacheWorkerMetadata(reports)
