"""``SpecCacheConnector``: SpecCache as a vLLM v1 KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "SpecCacheConnector",
                           "kv_connector_module_path": "speccache_rag.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "./.speccache/kv", "draft": "smollm2-135m",
                                                        "method": "speccache", "recompute_ratio": 0.15}}'

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

Per-request ``kv_transfer_params={"speccache": {...}}`` keys: ``method``, ``recompute_ratio``,
``reuse`` (other ``ReuseConfig`` fields), ``spans`` ([[start, end], …] chunk token spans), ``chunks``
([key, …]: store keys of chunks in the prompt, placed where their tokens are — a key that is not
stored, not this model's, or whose tokens are not in the prompt is ignored with a warning), ``prompt``
({"system", "chunks", "question"}: lets the draft read the prompt exactly as the torch engine does),
``tag`` (a name for the statistics), ``op="precompute"`` + ``span`` (store one chunk's KV),
``op="info"`` (+ ``keys``: which of them are stored) — what remote clients need to know: the model
fingerprint, the sink tokens, the defaults.

The reused token count is what vLLM reports as the request's cached tokens
(``usage.prompt_tokens_details.cached_tokens`` with ``--enable-prompt-tokens-details``), not the
``n - 1`` tokens the connector claims (the scheduler's prefix-cache metrics still count those).
"""
from __future__ import annotations

import math
import threading
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

from ..config import DEFAULT_STORE, DRAFT_METHODS, METHODS, ReuseConfig
from ..hardware import dtype_name
from ..prompt import RAGPrompt, sink_token_ids
from . import PARAMS_KEY
from .blend import PagedBlender
from .layers import Unsupported, slot_mapping
from .lookup import StoredChunkIndex, fingerprint_for, shared_store
from .plugin import ARCHITECTURES

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

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# In-process readers (VllmSpecCacheEngine) find each blended request's statistics here by tag.
REPORTS: OrderedDict[str, dict] = OrderedDict()
_REPORTS_MAX = 4096
_REPORTS_LOCK = threading.Lock()


def _publish(tag: str, report: dict) -> None:
    with _REPORTS_LOCK:
        REPORTS[tag] = report
        while len(REPORTS) > _REPORTS_MAX:
            REPORTS.popitem(last=False)


def pop_report(tag: str) -> dict | None:
    with _REPORTS_LOCK:
        return REPORTS.pop(tag, None)


@dataclass
class Options:
    """``kv_connector_extra_config``: the deployment's defaults (requests may override method/ratio/reuse)."""

    store: str = DEFAULT_STORE
    draft: str | None = None             # None: the target scores itself (HF copy of the same weights)
    method: str = ReuseConfig.method
    recompute_ratio: float | str = ReuseConfig.recompute_ratio      # or "auto"
    reuse: dict = field(default_factory=dict)
    sink: str = "bos"
    fill_misses: bool = True             # store the KV of hinted chunks that missed, for the next request
    lookup: str = "auto"                 # "auto": hints, else token content against the store; "hints": hints only
    min_chunk_tokens: int = 8            # shortest chunk the content lookup finds
    max_blends_per_step: int = 0         # 0: every waiting request blends in the same engine step;
                                         # N: at most N per step (earlier first tokens, same work)
    gate: bool = True                    # the correctness gate at start-up (gate.py), verdict kept in the store

    @classmethod
    def from_extra(cls, extra: dict | None) -> "Options":
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown SpecCache connector options: {', '.join(sorted(unknown))}")
        opts = cls(**extra)
        if opts.lookup not in ("auto", "hints"):
            raise ValueError(f"lookup must be 'auto' or 'hints', got {opts.lookup!r}")
        if opts.max_blends_per_step < 0:
            raise ValueError(f"max_blends_per_step must be >= 0, got {opts.max_blends_per_step}")
        if opts.method != "full":
            opts.reuse_config(opts.method, opts.recompute_ratio, {})       # validates
        return opts

    def reuse_config(self, method: str, ratio: float | str, overrides: dict) -> ReuseConfig:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        ratio = ratio if ratio == "auto" else float(ratio)
        fields = {**self.reuse, **(overrides or {}), "method": method, "recompute_ratio": ratio}
        return ReuseConfig(**fields)


def unsupported_reason(vllm_config: "VllmConfig") -> str | None:
    """Why this deployment cannot blend (then every request is a plain prefill), or None."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config if hasattr(mc, "hf_text_config") else mc.hf_config
    archs = list(getattr(mc, "architectures", None) or getattr(hf, "architectures", None) or [])
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not set(archs) & set(ARCHITECTURES):
        return (f"architecture {model_type or archs} is not supported by the SpecCache connector "
                f"(supported: {', '.join(ARCHITECTURES)})")
    if getattr(hf, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        return "tensor/pipeline parallelism is not supported yet"
    if vllm_config.cache_config.cache_dtype not in ("auto", dtype_name(mc.dtype)):
        return f"quantized KV cache ({vllm_config.cache_config.cache_dtype}) is not supported"
    return None


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
        self.options = Options.from_extra(self._kv_transfer_config.kv_connector_extra_config)
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
        # scheduler state
        self._plans: dict[str, dict] = {}
        self._pending: dict[str, dict] = {}
        self._reports: dict[str, dict] = {}
        self._notes: dict[str, dict] = {}                 # per request: what the response tells the client
        # per blended request, until its worker report arrives (which may be after it finished)
        self._prefill_stats: OrderedDict[str, Any] = OrderedDict()
        self._index: StoredChunkIndex | None = None
        self._warned: set[str] = set()
        # worker state
        self._blender: PagedBlender | None = None
        self._blender_error: str | None = None
        self._failed_blocks: set[int] = set()
        self._out_reports: dict[str, dict] = {}
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
    def on_new_request(self, request: "Request") -> None:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY) or {}
        if isinstance(params, dict) and params.get("op") == "info":
            try:
                self._notes[request.request_id] = self._info(params.get("keys") or [])
            except Exception as e:  # answered, never fatal: the client names the error
                self._notes[request.request_id] = {"error": f"{type(e).__name__}: {e}"}
            return
        if self.unsupported:
            return
        try:
            plan = self._plan(request, params)
        except Exception as e:  # a bad hint or option never fails the request: plain prefill
            self._warn_once(f"request {request.request_id}: {e}; plain prefill")
            return
        if plan is None:
            return
        self._plans[request.request_id] = plan
        if self.prefix_caching:
            # Blended KV is approximate: a unique salt keeps its blocks out of every other request's
            # prefix-cache lookups (and keeps this request from adopting exact blocks it will rewrite).
            request.cache_salt = f"{request.cache_salt or ''}|speccache:{uuid.uuid4().hex}"
            request.block_hashes = []
            request.update_block_hashes()

    def _plan(self, request: "Request", params) -> dict | None:
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        ids = list(request.prompt_token_ids or [])
        n = len(ids)
        if n < 2:
            return None
        if params.get("op") == "precompute":
            s, e = (int(x) for x in params["span"])
            if not 0 <= s < e <= n - 1:
                raise ValueError(f"precompute span {[s, e]} outside the prompt's first {n - 1} tokens")
            reuse = ReuseConfig(method="reuse", recompute_ratio=0.0)
            return {"op": "precompute", "spans": [[s, e]], "reuse": asdict(reuse), "tag": params.get("tag")}
        method = params.get("method", self.options.method)
        if method == "full":
            return None
        reuse = self.options.reuse_config(method, params.get("recompute_ratio", self.options.recompute_ratio),
                                          params.get("reuse") or {})
        if "spans" in params:
            spans = _valid_spans(params["spans"], n)
        elif "chunks" in params:
            spans = self._place(request.request_id, ids, params["chunks"])
        elif self.options.lookup == "auto":
            spans = [[s, e, key] for s, e, key in self._find(ids)]
        else:
            spans = []
        if not spans:
            return None
        prompt = params.get("prompt")
        if prompt is not None and not isinstance(prompt, dict):
            raise ValueError("'prompt' must be an object with system, chunks, question")
        return {"op": "blend", "spans": spans, "reuse": asdict(reuse), "prompt": prompt, "tag": params.get("tag")}

    def _stored_index(self) -> StoredChunkIndex:
        if self._index is None:
            self._index = StoredChunkIndex(self.store, self.fingerprint, head=self.options.min_chunk_tokens)
        self._index.refresh()
        return self._index

    def _find(self, ids: list[int]) -> list[tuple[int, int, str]]:
        return self._stored_index().find(ids)

    def _place(self, req_id: str, ids: list[int], keys) -> list[list]:
        """Spans of the chunks a client named by key; every key that cannot be placed is reported."""
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("'chunks' must be a list of store keys")
        placed, ignored = self._stored_index().place(ids, keys)
        for key, reason in ignored:
            logger.warning("SpecCache: request %s: chunk id %s ignored: %s", req_id, key[:16], reason)
        if ignored:
            self._notes[req_id] = {"ignored": [{"key": k, "reason": r} for k, r in ignored]}
        return [[s, e, key] for s, e, key in placed]

    def _info(self, keys) -> dict:
        from ..models import load_tokenizer

        if self._sink_ids is None:
            self._sink_ids = sink_token_ids(load_tokenizer(self.model_dir), self.options.sink)
        keys = [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []
        info = {"fingerprint": self.fingerprint, "dtype": self.dtype, "sink": self.options.sink,
                "sink_ids": self._sink_ids,
                "method": self.options.method, "recompute_ratio": self.options.recompute_ratio,
                "stored": [k for k in keys if self.store.contains(k)]}
        if self.unsupported:
            info["unsupported"] = self.unsupported
        return info

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._plans.get(request.request_id)
        if plan is None or plan.get("claimed"):
            return 0, False
        n = request.num_prompt_tokens
        if num_computed_tokens != 0 or request.num_tokens != n:
            # resumed after preemption, or a local hit we did not plan for: let vLLM compute it exactly
            self._plans.pop(request.request_id, None)
            return 0, False
        limit = self.options.max_blends_per_step
        if limit and len(self._pending) >= limit:
            return None, False                            # this step's blends are taken: ask again next step
        return n - 1, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        plan = self._plans.get(request.request_id)
        if plan is not None and num_external_tokens > 0:
            plan["claimed"] = True
            self._pending[request.request_id] = plan
            if request.prefill_stats is not None:
                self._prefill_stats[request.request_id] = request.prefill_stats
                while len(self._prefill_stats) > _REPORTS_MAX:          # blends that failed never report
                    self._prefill_stats.popitem(last=False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SpecCacheMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            plan = self._pending.pop(new_req.req_id, None)
            if plan is not None:
                body = {k: v for k, v in plan.items() if k != "claimed"}
                meta.loads.append(LoadSpec(new_req.req_id, list(new_req.prompt_token_ids or []),
                                           list(new_req.block_ids[0]), body))
        self._pending.clear()
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, SpecCacheWorkerMetadata):
            for req_id, report in worker_meta.reports.items():
                if req_id in self._plans:                # finished requests have no use for it
                    self._reports[req_id] = report
                self._correct_cached_tokens(req_id, report)

    def _correct_cached_tokens(self, req_id: str, report: dict) -> None:
        """vLLM counts every claimed token as cached; make it the tokens actually reused.

        The request's ``PrefillStats`` was handed to its first output earlier in this same
        ``update_from_output`` call (which then asks the connector for its output), and outputs are
        serialized only after it returns, so correcting the object now corrects what clients see.
        """
        stats = self._prefill_stats.pop(req_id, None)
        if stats is None:
            return
        reused = min(int(report.get("reused_tokens", 0)), stats.num_prompt_tokens)
        stats.num_cached_tokens = stats.num_external_cached_tokens = reused
        stats.num_computed_tokens = stats.num_prompt_tokens - reused

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        body = {**self._notes.pop(request.request_id, {}), **self._reports.pop(request.request_id, {})}
        return False, ({PARAMS_KEY: body} if body else None)

    # ==== worker side =============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._ensure_blender()                            # model is loaded by now: fail/warn at startup

    def _ensure_blender(self) -> PagedBlender | None:
        if self._blender is not None or self._blender_error is not None or self.unsupported:
            return self._blender
        try:
            from ..models import load, load_tokenizer
            from .models import current_model

            model = current_model()
            if model is None:
                raise Unsupported("the model was not built through speccache_rag's vLLM plugin "
                                  "(is speccache-rag installed in vLLM's environment?)")
            tokenizer = load_tokenizer(self.model_dir)
            draft_name = self.options.draft or self.model_dir
            dtype = self.dtype

            def load_draft():
                logger.info("SpecCache: loading draft model %s", draft_name)
                return load(draft_name, dtype=dtype)

            blender = PagedBlender(model, tokenizer, self.store, self.fingerprint,
                                   sink_token_ids(tokenizer, self.options.sink), load_draft,
                                   fill_misses=self.options.fill_misses, sink=self.options.sink)
            if self.options.gate and blender.check_gate(self.model_dir):
                logger.warning("SpecCache: methods %s do not reproduce full prefill at recompute_ratio=1 on the "
                               "built-in check with this model; every request is served by full prefill",
                               ", ".join(blender.gate_failed))
            if self.options.method in DRAFT_METHODS and not blender.gate_failed:
                blender.draft()    # at start-up, so that the first request does not pay for loading it
            self._blender = blender
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
            if blender is None:
                self._failed_blocks.update(claimed_blocks)
                continue
            plan = spec.plan
            try:
                prompt = RAGPrompt(**plan["prompt"]) if plan.get("prompt") else None
                report = blender.blend(spec.token_ids, plan["spans"],
                                       ReuseConfig(**plan["reuse"]),
                                       slot_mapping(spec.block_ids, self.block_size, n - 1),
                                       prompt=prompt, precompute=plan["op"] == "precompute")
            except Exception:
                logger.exception("SpecCache: blending request %s failed; vLLM recomputes it", spec.req_id)
                self._failed_blocks.update(claimed_blocks)
                continue
            logger.info("SpecCache: req=%s %s", spec.req_id, report.line())
            out = {**report.to_dict(), "step": self._step, "batch": len(meta.loads)}
            self._out_reports[spec.req_id] = out
            if plan.get("tag"):
                _publish(plan["tag"], out)

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


def _valid_spans(spans, n: int) -> list[list[int]]:
    out, prev = [], 0
    for span in spans:
        s, e = (int(x) for x in span)
        if not prev <= s < e <= n:
            raise ValueError(f"chunk spans must be sorted, non-overlapping and inside the prompt; got {spans}")
        out.append([s, e])
        prev = e
    return out
