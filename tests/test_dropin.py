"""The drop-ins' one core (speccache_rag.dropin): both adapters take its defaults, checks and engine factory."""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from llama_index.llms.speccache import SpecCacheLLM  # noqa: E402

from langchain_speccache import ChatSpecCache  # noqa: E402
from speccache_rag.config import DEFAULT_STORE, ReuseConfig  # noqa: E402
from speccache_rag.dropin import DropInSettings  # noqa: E402
from speccache_rag.dropin import core  # noqa: E402

ADAPTERS = [ChatSpecCache, SpecCacheLLM]
URL = "http://127.0.0.1:9/v1"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapters_read_the_cores_settings_and_defaults(adapter):
    assert adapter()._settings() == DropInSettings()
    assert (DropInSettings.store, DropInSettings.recompute_ratio) == (DEFAULT_STORE, ReuseConfig.recompute_ratio)
    remote = adapter(base_url=URL, model="m", max_new_tokens=5)._settings()
    assert (remote.target, remote.store, remote.max_new_tokens, remote.remote) == ("m", None, 5, True)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("bad", [{"method": "telepathy"}, {"recompute_ratio": 2.0}, {"offload": "3 bits"},
                                 {"max_new_tokens": 0}, {"top_p": 0.0}, {"base_url": URL, "offload": "2bit"},
                                 {"base_url": URL, "timeout": 0}, {"base_url": URL, "max_retries": -1}])
def test_both_adapters_refuse_the_same_values(adapter, bad):
    with pytest.raises(ValueError):
        adapter(**bad)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_both_adapters_open_the_remote_engine_alike(adapter, monkeypatch):
    opened = []
    monkeypatch.setattr(core, "open_engine", lambda target, **kw: opened.append((target, kw)) or object())
    adapter(base_url=URL, model="m", api_key="k", timeout=5.0, max_retries=0).engine
    adapter(base_url=URL, model="m").engine
    assert opened[0] == ("m", dict(draft=None, store=None, backend=None, dtype="auto", device=None, base_url=URL, api_key="k",
                                   cache_salt=None, timeout=5.0, max_retries=0))
    assert "timeout" not in opened[1][1] and "max_retries" not in opened[1][1]     # open_engine's own defaults


def test_a_calls_kwargs_override_the_settings_and_are_checked():
    settings = DropInSettings(target="m", temperature=0.5)
    kw = settings.generate_kwargs(max_tokens=3, method="reuse", stop=None, seed=7)
    assert (kw["max_new_tokens"], kw["reuse"].method, kw["temperature"], kw["stop"], kw["seed"]) == \
        (3, "reuse", 0.5, None, 7)
    with pytest.raises(ValueError, match="one model"):
        settings.generate_kwargs(model="other")
    with pytest.raises(ValueError):
        settings.generate_kwargs(recompute_ratio=-1)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_no_argument_is_dropped_silently(adapter):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frequency_penalty"):
        adapter(model="m", frequency_penalty=0.5)                      # constructor: named in the error
    with pytest.raises(ValueError, match="logprobs"):
        DropInSettings(target="m").generate_kwargs(logprobs=True)     # a call: named in the error
    assert adapter(api_base=URL, model="m")._settings().base_url == URL    # OpenAILike's name for base_url


def test_server_fields_pass_through_in_remote_mode_and_are_refused_in_process():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    remote = DropInSettings(target="m", base_url=URL, store=None).generate_kwargs(tools=tools, tool_choice="auto",
                                                                                 frequency_penalty=0.2)
    assert remote["openai_params"] == {"tools": tools, "tool_choice": "auto", "frequency_penalty": 0.2}
    assert "openai_params" not in DropInSettings(target="m").generate_kwargs(max_tokens=2)
    with pytest.raises(ValueError, match="vLLM server"):
        DropInSettings(target="m").generate_kwargs(tools=tools)


def test_langchain_tools_and_structured_output_are_refused_at_bind_time_in_process():
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str

    local = ChatSpecCache(model="smollm2-135m")
    with pytest.raises(ValueError, match="vLLM server"):
        local.bind_tools([Answer])
    with pytest.raises(ValueError, match="vLLM server"):
        local.with_structured_output(Answer)
    bound = ChatSpecCache(base_url=URL, model="m").bind_tools([Answer], tool_choice="Answer")
    assert bound.kwargs["tools"][0]["function"]["name"] == "Answer"
    assert bound.kwargs["tool_choice"] == {"type": "function", "function": {"name": "Answer"}}
