"""Small random-init models of the transformers architectures the installed version ships
(no download), each built from its config class's defaults with only the sizes made small:
the cache, the attention implementation, dropout, rotary and normalisation settings as the
config ships them. Shared by the architecture tests and ``benchmarks/``-style sweeps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

ARCHITECTURES = (
    # decoders
    "gpt2", "gpt_neo", "gptj", "gpt_neox", "codegen", "bloom", "opt", "falcon", "llama",
    "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "olmo", "olmo2", "stablelm", "starcoder2", "granite", "cohere",
    # encoder-decoders
    "t5", "bart", "mbart",
    # encoders (masked or causal LM heads)
    "bert", "roberta", "electra", "deberta-v2", "distilbert",
)
"""Model types of ``transformers.CONFIG_MAPPING``; one missing from the installed version is
skipped."""

VOCAB = 128
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, decoder_start_token_id=0)
"""Set on every config (through its ``attribute_map`` where it names them otherwise)."""
SIZES_WHERE_PRESENT = dict(
    num_key_value_heads=2, head_dim=16, d_ff=128, d_kv=16, ffn_dim=128, encoder_ffn_dim=128,
    decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2, num_decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4, num_local_experts=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts_per_tok=2,
    sliding_window=64, n_inner=128, rotary_dim=8, dim=64, hidden_dim=128, n_layers=2, n_heads=4)
"""Set where the config has the attribute (experts, rotary, encoder-decoder sizes)."""


def available(model_type: str) -> bool:
    import transformers

    return model_type in transformers.CONFIG_MAPPING


def build(model_type: str, batch: int = 4, length: int = 32) -> tuple[nn.Module, dict[str, Any]]:
    """A random-init model of ``model_type`` with the LM head its family trains with
    (sequence-to-sequence, else causal, else masked) and a padded batch: an
    ``attention_mask`` with the first row's last quarter padding, ``labels`` -100 there."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    config = transformers.AutoConfig.for_model(model_type)
    for key, value in SIZES.items():
        setattr(config, key, value)
    for key, value in SIZES_WHERE_PRESENT.items():
        try:
            if hasattr(config, key):
                setattr(config, key, value)
        except AttributeError:
            pass  # derived from the sizes above (Falcon's head_dim)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    for mapping in (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        if model_type in mapping:
            model = getattr(transformers, mapping[model_type])(config)
            break
    else:
        raise KeyError(f"{model_type} has no language-model head")
    ids = torch.randint(3, VOCAB, (batch, length))
    mask = torch.ones_like(ids)
    mask[0, -length // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """CPU reductions on one thread (a test module imports this fixture): a multi-threaded
    reduction splits its work by the threads the OS gives it, which on a loaded machine
    changes from call to call, so an op run again could differ from its forward in the last
    bit whatever the plan."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
