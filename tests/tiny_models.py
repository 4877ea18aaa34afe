"""Random-weight tiny models: for shape and exactness tests only, never for quality claims."""
import torch

from speccache_rag.models import load_tokenizer


def tiny_random_model(arch: str = "llama", seed: int = 0, *, num_layers: int = 4, hidden_size: int = 64,
                      num_heads: int = 4, num_kv_heads: int = 2, dtype: torch.dtype = torch.float32,
                      tokenizer=None):
    """A small random-weight ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``phi3`` or ``gemma3`` model with the real
    SmolLM2 tokenizer. ``gemma3`` has 16-token sliding windows on all but every third layer, so prompts cross them.

    For shape and exactness tests only (never quality claims).  Deterministic in ``seed``; the
    global RNG state is left untouched.  Pass ``tokenizer`` to skip loading SmolLM2's.
    """
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "phi3": Phi3Config, "gemma3": Gemma3TextConfig}
    if arch not in configs:
        raise ValueError(f"arch must be one of {', '.join(configs)}, got {arch!r}")
    if tokenizer is None:
        tokenizer = load_tokenizer("smollm2-135m")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch in ("mistral", "phi3"):
        common["sliding_window"] = None          # a window beyond the prompt: tested apart
    if arch == "phi3":
        common["rope_parameters"]["partial_rotary_factor"] = 0.5     # Phi-4-mini style: half the dims rotate
    if arch == "gemma3":
        common.update(sliding_window=16, query_pre_attn_scalar=hidden_size // num_heads,
                      layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    config = configs[arch](**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # transformers' init leaves norms at 1 and may zero biases; perturb everything a little so
        # that every parameter matters in exactness tests
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    model.eval()
    return model, tokenizer
