"""What a SpecCache deployment of vLLM configures (``Options``: ``kv_connector_extra_config``) and whether it
can blend at all (``unsupported_reason``). Read by the connector at start-up; no vLLM import here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from ..config import DEFAULT_STORE, METHODS, ReuseConfig
from ..hardware import dtype_name
from .plugin import ARCHITECTURES

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# The config model types of plugin.ARCHITECTURES (VllmLayers drives those)
VLLM_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")


ENV_PREFIX = "SPECCACHE_CONNECTOR_"      # SPECCACHE_CONNECTOR_<OPTION>, e.g. SPECCACHE_CONNECTOR_REQUIRE_SALT=1
CONFIG_ENV = ENV_PREFIX + "CONFIG"       # a YAML file of options


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
    # tenants: a request's cache_salt is part of every chunk key it reads or writes (kv.tenant_fingerprint)
    require_salt: bool = False           # refuse requests without a cache_salt (HTTP 400 from vllm/tenancy.py)
    client_precompute: bool = True       # clients may ask the server to store chunks (op="precompute")

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

    @classmethod
    def from_sources(cls, extra: dict | None, environ=os.environ) -> "Options":
        """The options from every source, each checked as ``from_extra`` checks them: ``kv_connector_extra_config``
        over ``SPECCACHE_CONNECTOR_<OPTION>`` variables over the YAML file ``$SPECCACHE_CONNECTOR_CONFIG`` over
        the defaults."""
        merged: dict = {}
        path = environ.get(CONFIG_ENV)
        if path:
            import yaml

            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} ({CONFIG_ENV}) must hold a mapping of SpecCache connector options")
            merged.update(loaded)
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                merged[f.name] = _env_value(f.name, raw, getattr(cls(), f.name))
        return cls.from_extra({**merged, **(extra or {})})

    def refusal(self, op: str | None, cache_salt: str | None) -> str | None:
        """Why the tenancy options refuse a request (``op``: the wire op, ``cache_salt``: its tenant), or None."""
        if self.require_salt and not cache_salt:
            return "this server requires a cache_salt on every request (tenant isolation)"
        if op == "precompute" and not self.client_precompute:
            return "this server does not let clients precompute chunks (client_precompute is off)"
        return None

    def reuse_config(self, method: str, ratio: float | str, overrides: dict) -> ReuseConfig:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        ratio = ratio if ratio == "auto" else float(ratio)
        fields = {**self.reuse, **(overrides or {}), "method": method, "recompute_ratio": ratio}
        return ReuseConfig(**fields)


def _env_value(name: str, raw: str, default):
    """An option's value from its environment variable, read as its default's type."""
    var = ENV_PREFIX + name.upper()
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true/false")
            return raw.lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return raw if raw == "auto" else float(raw)
        if isinstance(default, dict):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
    except ValueError as e:
        raise ValueError(f"{var}={raw!r}: {e}") from None
    return None if raw.lower() in ("", "none") else raw


def unsupported_reason(vllm_config: "VllmConfig") -> str | None:
    """Why this deployment cannot blend (then every request is a plain prefill), or None."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config if hasattr(mc, "hf_text_config") else mc.hf_config
    archs = list(getattr(mc, "architectures", None) or getattr(hf, "architectures", None) or [])
    model_type = getattr(hf, "model_type", None)
    if model_type not in VLLM_MODEL_TYPES or not set(archs) & set(ARCHITECTURES):
        return (f"architecture {model_type or archs} is not supported by the SpecCache connector "
                f"(supported: {', '.join(ARCHITECTURES)})")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        return "tensor/pipeline parallelism is not supported yet"
    if vllm_config.cache_config.cache_dtype not in ("auto", dtype_name(mc.dtype)):
        return f"quantized KV cache ({vllm_config.cache_config.cache_dtype}) is not supported"
    return None
