"""``DropInFields``: the settings both framework drop-ins declare, as pydantic fields declared once, so that
the two cannot drift apart. Their defaults are ``DropInSettings``'s and the core checks them; each drop-in
adds its framework's own fields. Imported by the drop-ins only: pydantic comes with either framework.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from ..config import OffloadConfig
from .core import DropInSettings, store_name


class DropInFields(BaseModel):
    """A base of ``ChatSpecCache`` and ``SpecCacheLLM`` (beside their framework's model class)."""

    # extra="forbid": an argument this drop-in does not know (tools=, frequency_penalty=, …) is an error naming it,
    # never silently dropped
    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, extra="forbid")
    # setting → the field that holds it, where a framework names it otherwise
    _renamed: ClassVar[dict[str, str]] = {}

    target: Optional[str] = Field(default=DropInSettings.target, alias="model",
                                  description="Target model: a packaged name, a Hugging Face id or directory, or a .gguf file "
                                  "(remote mode: the served model name; None: the server's first).")
    draft: Optional[str] = Field(default=None, description="Draft model that scores tokens; None: the target.")
    store: Any = Field(default=DropInSettings.store,
                       description="KV store: a directory, 'memory://', 'redis://host:port/db' or a KVStore.")
    backend: Optional[str] = Field(default=None, description="Engine backend: 'torch' (None) or 'vllm'; base_url "
                                   "implies 'remote'.")
    dtype: str = Field(default=DropInSettings.dtype, description="Compute dtype: auto (bfloat16 where the hardware "
                       "computes it natively, else float32), bfloat16 or float32.")
    device: Optional[str] = Field(default=None, description="Where the models compute (torch backend): cpu, cuda, "
                                  "cuda:1 …; None: CUDA where there is one, else the CPU.")
    method: str = Field(default=DropInSettings.method,
                        description="Reuse method: qattn, speccache, norm, cacheblend, epic, reuse, full …")
    recompute_ratio: Union[float, Literal["auto"]] = Field(
        default=DropInSettings.recompute_ratio,
        description="Share of reused chunk tokens recomputed; 'auto': chosen per prompt (ReuseConfig.auto_range).")
    offload: Union[str, OffloadConfig, None] = Field(
        default=None, description="Offloaded decoding (SpeCache), torch backend: '2bit', '1bit' or an OffloadConfig — "
        "a low-bit KV copy stays resident and the top-k rows are fetched each step.")
    temperature: float = Field(default=DropInSettings.temperature, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=DropInSettings.top_p, description="Nucleus sampling threshold.")
    stop: Optional[list[str]] = Field(default=None, alias="stop_sequences", description="Stop strings.")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    base_url: Optional[str] = Field(default=None, description="Remote mode: a SpecCache `vllm serve` "
                                    "(http://host:8000/v1; `api_base=` too, as OpenAILike spells it: "
                                    "init_arguments); `target` is then the served model name.")
    api_key: Optional[str] = Field(default=None, description="Remote mode: the server's API key.")
    timeout: Optional[float] = Field(default=None, description="Remote mode: seconds to wait for a response "
                                     "(None: 600).")
    max_retries: Optional[int] = Field(default=None, description="Remote mode: retries of a failed connection "
                                       "(None: 2).")
    cache_salt: Optional[str] = Field(default=None, description="The tenant (vLLM's request field): chunks are "
                                      "stored and reused within one salt, never across; a call may pass its own.")

    @model_validator(mode="after")
    def _check(self) -> DropInFields:
        self._settings()            # the core's checks, at construction
        return self

    @field_serializer("store")
    def _store_name(self, store: Any) -> Optional[str]:
        return store_name(store)

    def _settings(self) -> DropInSettings:
        return DropInSettings.of(self, **self._renamed)
