"""Tiny Hugging Face models built from configs: random weights, no downloads.

Example::

    transformers = pytest.importorskip("transformers")
    model = tiny_llama(num_key_value_heads=2)
"""

from __future__ import annotations

import torch


def tiny_llama(**config: object) -> torch.nn.Module:
    """A two-layer ``LlamaForCausalLM`` in training mode, eager attention, seeded weights.

    Keyword arguments override the config (vocabulary 32, hidden size 16, two heads, one
    key/value head, 16 positions).  Needs transformers: import-skip it in the calling test.
    """
    import transformers

    settings: dict[str, object] = {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 16,
        **config,
    }
    llama_config = transformers.LlamaConfig(**settings)
    llama_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config).train()


def word_tokenizer(vocab_size: int = 32) -> object:
    """A ``PreTrainedTokenizerFast`` built in memory (no hub): ``<pad>`` 0, ``<eos>`` 1,
    ``<bos>`` 2, then the words ``w0``, ``w1``, ... split on whitespace.

    Needs transformers and tokenizers: import-skip them in the calling test.
    """
    import tokenizers
    import transformers

    words = ["<pad>", "<eos>", "<bos>", *(f"w{i}" for i in range(vocab_size - 3))]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
