"""A model the SpecCache connector cannot blend (OLMo 2: norms after attention and MLP, q/k norms over all heads)
must run as plain vLLM, with a warning.

Usage: python unsupported_arch.py WORKDIR  → prints {"plain": [...], "hinted": [...]} as its last line.
Builds a tiny random-weight OLMo 2 checkpoint (shape test only) with SmolLM2's tokenizer.
"""
import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoModelForCausalLM, Olmo2Config

    from speccache_rag.models import load_tokenizer
    from speccache_rag.prompt import RAGPrompt, render
    from speccache_rag.vllm import kv_transfer_config

    work = sys.argv[1]
    model_dir = os.path.join(work, "tiny-olmo2")
    tok = load_tokenizer("smollm2-135m")
    cfg = Olmo2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    config = kv_transfer_config(os.path.join(work, "kv"), method="speccache", recompute_ratio=0.15)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_transfer_config=KVTransferConfig(**config))
    tokens = render(RAGPrompt(chunks=["The ferry leaves at 6:40 every morning in summer.",
                                      "The lighthouse on Tallis Isle was built in 1871."],
                              question="When was the lighthouse built?"), tok)
    spans = [[s.start, s.end] for s in tokens.chunk_segments()]
    result = {}
    for name, extra in (("plain", {}), ("hinted", {"kv_transfer_params": {"speccache": {"spans": spans}}})):
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args=extra or None)
        out = llm.generate([{"prompt_token_ids": tokens.token_ids}], sp, use_tqdm=False)
        result[name] = list(out[0].outputs[0].token_ids)
    print(json.dumps(result), flush=True)
