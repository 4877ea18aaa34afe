"""Device discipline without a GPU: every tensor the pipeline makes must follow the model's device.

Inside ``torch.device("meta")`` a tensor made without naming its device lands on the meta device, and the first
operation that meets the model's CPU tensors fails; so a blend that runs clean here names its device everywhere
(or keeps host-side bookkeeping on the CPU on purpose), and on CUDA would not mix devices either."""
import pytest
import torch
from tiny_models import tiny_random_model

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.config import METHODS

CHUNKS = ["The lighthouse on Varrow Point was built in 1887; its keeper kept a log of every ship.",
          "The ferry leaves twice a day; in winter the afternoon crossing is cancelled when fog sets in."]
QUESTION = "When was the lighthouse built?"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request):
    """gemma3 as well: its sliding-window masks and per-layer-type rope are made per pass too."""
    model, tok = tiny_random_model(request.param, num_layers=3)
    with torch.device("meta"):                       # the gate's check and ingestion are under the same rule
        eng = SpecCacheEngine(model, tok, store="memory://")
        eng.precompute(CHUNKS)
    assert eng.load_stats.gate_methods and not eng.load_stats.gate_failed
    return eng


@pytest.mark.parametrize("method", METHODS)
def test_every_method_allocates_on_the_models_device(engine, method):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    with torch.device("meta"):
        out = engine.generate(prompt, max_new_tokens=3, reuse=ReuseConfig(method=method, recompute_ratio=0.5),
                              return_first_logits=True)
    assert out.first_logits.device.type == "cpu" and len(out.token_ids) >= 1
    if method not in ("full",):
        assert out.stats.reused_tokens > 0


def test_the_check_can_fail():
    """A position tensor made without its device — what the blend did before — is refused inside the rule."""
    from speccache_rag.layers import HFLayers
    from speccache_rag.runner import KVCache, prefill

    model, _ = tiny_random_model("llama", num_layers=1, tokenizer=_Tok())
    ops = HFLayers(model)
    ids = torch.tensor([1, 2, 3], device="cpu")
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        cache = KVCache.empty(ops, 3)
        prefill(ops, cache, ids, torch.arange(3))


def test_from_pretrained_places_the_models(monkeypatch):
    from speccache_rag import models

    target, tok = tiny_random_model("llama", num_layers=1)
    monkeypatch.setattr(models, "load", lambda name, dtype=None: (target, tok))
    engine = SpecCacheEngine.from_pretrained("tiny", store="memory://", device="cpu", gate=False, warm_up=False)
    assert engine.ops.device.type == "cpu" and engine.dtype == "float32"
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    with pytest.raises(ValueError, match="is not available here"):       # before any weights load
        SpecCacheEngine.from_pretrained("tiny", store="memory://", device=missing, gate=False, warm_up=False)


class _Tok:
    bos_token_id = eos_token_id = pad_token_id = 0

    def __len__(self):
        return 1000


def test_gpu_check_says_so_without_cuda_and_runs_its_checks_on_the_cpu(smollm2, monkeypatch, capsys):
    from speccache_rag import models
    from speccache_rag.bench import gpu_check

    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0 and "no CUDA device here" in capsys.readouterr().out
    monkeypatch.setattr(models, "load", lambda name, dtype=None: smollm2)
    assert gpu_check.main(["--device", "cpu", "--target", "smollm2-135m", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "exactness: 8 methods × 3 prompts, 0 failed" in out and "| qattn |" in out


def test_offloaded_decoding_allocates_on_the_models_device(engine):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    with torch.device("meta"):
        out = engine.generate(prompt, max_new_tokens=4, offload="2bit")
    assert out.stats.offload is not None and out.stats.offload.steps >= 1


def test_device_is_refused_for_a_backend_that_places_its_own_models():
    with pytest.raises(ValueError, match="places its own"):
        SpecCacheEngine.from_pretrained("tiny", backend="vllm", device="cpu")
