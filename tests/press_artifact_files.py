"""Random-initialised artifacts for presses that load learned weights, written for
``tiny:llama`` as an operator would supply them (``--press-option Class:path=DIR``)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["write_artifacts"]


def write_artifacts(root: Path, restore_tokens: int = 8) -> dict[str, dict[str, str]]:
    """RestoreKV (a PEFT LoRA adapter + restore embeddings), Q-filters and query
    statistics (ExpectedAttentionStats) for tiny:llama under ``root``; returns the press
    options that point at them."""
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats
    from kvpress.presses.qfilter_press import QFilters
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from gen_service.models.loading import tiny_model

    model = tiny_model("llama")
    config = model.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        # init_lora_weights=False: random A and B, so the adapter changes the restore pass
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          init_lora_weights=False)
        get_peft_model(model, lora).save_pretrained(root / "restorekv")
        save_file({"restore_embeddings": torch.randn(restore_tokens, config.hidden_size)},
                  str(root / "restorekv" / "restore_embeddings.safetensors"))
        head_dim = config.hidden_size // config.num_attention_heads
        QFilters(config.num_hidden_layers, config.num_key_value_heads, head_dim).save_pretrained(root / "qfilters")
        stats = ExpectedAttentionStats(config.num_hidden_layers, config.num_attention_heads, head_dim, "random",
                                       "tiny:llama", 1, 1, 4)
        a = torch.randn(config.num_hidden_layers, config.num_attention_heads, head_dim, head_dim) / head_dim**0.5
        stats.query_mean.data = torch.randn_like(stats.query_mean)
        stats.query_cov.data = a @ a.transpose(-1, -2)          # a covariance: symmetric, positive semi-definite
        stats.save_pretrained(root / "query_stats")
    return {"RestoreKVPress": {"path": str(root / "restorekv")}, "QFilterPress": {"path": str(root / "qfilters")},
            "ExpectedAttentionStatsPress": {"stats_folder": str(root / "query_stats")}}
