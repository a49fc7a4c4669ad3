"""Zoo families from Hugging Face transformers' model code, built from a config with random weights.

Nothing is downloaded: each model is ``XForY(config)``. Dropout is off in
every config so that a step is a deterministic function of the weights and
the batch (the analyzer's baseline and the monitor's histories compare runs).
"""

from __future__ import annotations

import importlib
from typing import Dict

from .model import (ZooModel, causal_lm_batches, cross_entropy_loss, image_batches, masked_lm_batches,
                    next_token_loss, seq2seq_batches)


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError("the zoo's transformers models (gpt2, llama, bert, t5, vit) need the transformers "
                          f"package ({exc}); install it with `pip install transformers` or "
                          "`pip install -e '.[test]'` in the clone. The zoo's resnet needs only torch.") from None


def _size(size: str, table: Dict[str, dict], family: str) -> dict:
    if size not in table:
        raise ValueError(f"size {size!r} is not one of the {family} sizes: {', '.join(table)}")
    return dict(table[size])


#: GPT-2: "small" (124M) and "medium" (355M) are the released configurations.
GPT2_SIZES = {
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, seq_len=16),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, seq_len=512),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024, seq_len=512),
    "large": dict(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, n_positions=1024, seq_len=512),  # 774M
}


def gpt2(size: str = "tiny") -> ZooModel:
    """transformers' GPT2LMHeadModel: its linear layers are transformers' Conv1D, not nn.Linear."""
    tf = _transformers()
    cfg = _size(size, GPT2_SIZES, "gpt2")
    seq_len = cfg.pop("seq_len")
    end = cfg["vocab_size"] - 1  # GPT-2's <|endoftext|> is its last token (50256 in the released vocabulary)
    config = tf.GPT2Config(**cfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=end, eos_token_id=end)
    return ZooModel("gpt2", size, tf.GPT2LMHeadModel(config), causal_lm_batches(config.vocab_size, seq_len),
                    ("input_ids",), next_token_loss, seq_len, config)


#: Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention (fewer key/value heads than heads).
#: "small" has 125M parameters, "medium" 245M.
LLAMA_SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, seq_len=16),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, seq_len=512),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, seq_len=512),
    # TinyLlama's shape, 1.1B parameters (the llama-1b of python -m adaptive_amp bench tune and e2e).
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, seq_len=1024),
}


def llama(size: str = "tiny") -> ZooModel:
    tf = _transformers()
    cfg = _size(size, LLAMA_SIZES, "llama")
    seq_len = cfg.pop("seq_len")
    config = tf.LlamaConfig(**cfg, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    return ZooModel("llama", size, tf.LlamaForCausalLM(config), causal_lm_batches(config.vocab_size, seq_len),
                    ("input_ids",), next_token_loss, seq_len, config)


#: BERT: "small" is BERT-base (110M), "medium" BERT-large (335M).
BERT_SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=128,
                 max_position_embeddings=64, seq_len=16),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                  vocab_size=30522, max_position_embeddings=512, seq_len=256),
    "medium": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                   vocab_size=30522, max_position_embeddings=512, seq_len=256),
}


def bert(size: str = "tiny") -> ZooModel:
    """BertForMaskedLM trained on masked tokens (the last token id is the mask)."""
    tf = _transformers()
    cfg = _size(size, BERT_SIZES, "bert")
    seq_len = cfg.pop("seq_len")
    config = tf.BertConfig(**cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batches = masked_lm_batches(config.vocab_size, config.vocab_size - 1, seq_len)
    return ZooModel("bert", size, tf.BertForMaskedLM(config), batches, ("input_ids",), cross_entropy_loss,
                    seq_len, config)


#: T5: "small" is t5-small (60M), "medium" t5-base (220M).
T5_SIZES = {
    "tiny": dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=128,
                 seq_len=16),
    "small": dict(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_decoder_layers=6, num_heads=8,
                  vocab_size=32128, seq_len=256),
    "medium": dict(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_decoder_layers=12, num_heads=12,
                   vocab_size=32128, seq_len=256),
}


def t5(size: str = "tiny") -> ZooModel:
    """T5ForConditionalGeneration (encoder-decoder): the decoder continues the encoder's sequence."""
    tf = _transformers()
    cfg = _size(size, T5_SIZES, "t5")
    seq_len = cfg.pop("seq_len")
    config = tf.T5Config(**cfg, dropout_rate=0.0, use_cache=False)
    start = getattr(config, "decoder_start_token_id", None)
    batches = seq2seq_batches(config.vocab_size, config.pad_token_id if start is None else start, seq_len)
    return ZooModel("t5", size, tf.T5ForConditionalGeneration(config), batches,
                    ("input_ids", "decoder_input_ids"), cross_entropy_loss, seq_len, config)


#: ViT: "small" is ViT-B/16 at 224 pixels (86M), "medium" ViT-L/16 (304M).
VIT_SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                 patch_size=8, num_labels=10),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                  image_size=224, patch_size=16, num_labels=1000),
    "medium": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                   image_size=224, patch_size=16, num_labels=1000),
}


def vit(size: str = "tiny") -> ZooModel:
    tf = _transformers()
    cfg = _size(size, VIT_SIZES, "vit")
    config = tf.ViTConfig(**cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batches = image_batches(config.num_labels, config.num_channels, config.image_size)
    return ZooModel("vit", size, tf.ViTForImageClassification(config), batches, ("pixel_values",),
                    cross_entropy_loss, config.image_size, config)
