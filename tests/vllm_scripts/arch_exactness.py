"""The exactness guard through the vLLM connector on a tiny random-weight model of one architecture.

Usage: python arch_exactness.py ARCH WORKDIR → prints a JSON report as its last line: the layers' windows as the
connector reads them, how far vLLM's own full prefill is from transformers'; per method at r = 1, whether the
greedy tokens equal vLLM's full prefill and the largest first-token log-probability difference; and, at r = 0.15,
the store hits and recomputed tokens. Shape and exactness only (random weights), never quality.
"""
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # tests/: tiny_models, test_exactness data
    import torch
    from tiny_models import tiny_random_model

    from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
    from speccache_rag.config import METHODS

    arch, work = sys.argv[1], Path(sys.argv[2])
    model, tok = tiny_random_model(arch, num_layers=3, hidden_size=128, num_heads=4)   # head_dim 32: CPU kernels
    model.save_pretrained(work / arch)
    tok.save_pretrained(work / arch)
    chunks = ["Zorblat Industries was founded in 1987 by Mira Quell in the town of Vessendorf; it makes copper "
              "kettles and exports most of them to Denmark.",
              "Mira Quell was born in 1950 in Ostrava. She studied metallurgy and later moved to Vessendorf.",
              "Vessendorf is a small town on the river Lenne, known for its kettle festival every August."]
    prompt = RAGPrompt(chunks=chunks, question="In which year was the founder of Zorblat Industries born?")
    engine = SpecCacheEngine.from_pretrained(str(work / arch), store=str(work / "kv"), backend="vllm",
                                             dtype="float32", max_model_len=1024, kv_cache_gib=1)
    engine.precompute(chunks)
    full = engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="full"), return_first_logits=True)
    from speccache_rag.prompt import render
    from speccache_rag.vllm.layers import VllmLayers
    from speccache_rag.vllm.models import current_model

    with torch.no_grad():                    # vLLM's own prefill against transformers' (windows included)
        hf = model(torch.tensor([render(prompt, tok).token_ids])).logits[0, -1].log_softmax(-1)
    report = {"prompt_tokens": full.stats.prompt_tokens, "windows": VllmLayers(current_model()).windows,
              "hf_diff": float((full.first_logits.log_softmax(-1) - hf).abs().max()), "methods": {}}
    for method in [m for m in METHODS if m not in ("full", "reuse")]:
        out = engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method=method, recompute_ratio=1.0),
                              return_first_logits=True)
        report["methods"][method] = {"same_tokens": out.token_ids == full.token_ids,
                                     "recomputed_all": out.stats.recomputed_tokens == out.stats.prompt_tokens,
                                     "max_diff": float((out.first_logits - full.first_logits).abs().max())}
    part = engine.generate(prompt, max_new_tokens=2, reuse=ReuseConfig(method="qattn", recompute_ratio=0.15))
    report["partial"] = {"cache_hits": part.stats.cache_hits, "recomputed": part.stats.recomputed_tokens,
                         "reused": part.stats.reused_tokens}
    engine.close()
    print(json.dumps(report), flush=True)
