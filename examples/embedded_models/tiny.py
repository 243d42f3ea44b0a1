"""The embedded tiny Qwen2's architecture and tokenizer, from which the policy recipe starts.

Everything here is deterministic: the tokenizer's vocabulary is a fixed list and the model's
weights come from a seed, so every machine builds the same files without any hub access.

The tokenizer is Qwen2's byte-level BPE with *no merges* and a 256-byte base vocabulary, so it
is character-level for ASCII (token id == ``ord(char)``) and still encodes any UTF-8 text. It is
deliberately the exact structure Qwen2's tokenizer class rebuilds from ``tokenizer.json``:
transformers v5 ``AutoTokenizer`` (and so vLLM) always instantiates ``Qwen2Tokenizer`` for a
``model_type: qwen2`` directory and swaps in Qwen2's pre-tokenizer and byte-level decoder, which
would mangle any other design (a plain character vocabulary loses its spaces).

Special tokens follow Qwen2.5's names. ``<|endoftext|>`` pads, ``<|im_end|>`` ends a response
(eos) and ``<|im_start|>`` is the bos token. Nothing is added automatically when text is encoded,
as with Qwen2, so HF training and vLLM rollouts see the same ids for the same raw prompt. pad and
eos are deliberately different ids: masking a batch by ``input_ids == pad_token_id`` must never
hide the eos the policy has to learn to emit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
VOCAB_MULTIPLE = 8


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by the byte (so id == byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _special_tokens() -> list[str]:
    """pad/bos/eos, then unused ``<|reserved_i|>`` tokens up to a multiple of ``VOCAB_MULTIPLE``.

    With the padding the model's vocab rows and the tokenizer's ids coincide, so every id a
    sampler can draw decodes (to nothing, as a special token) instead of falling outside it.
    """
    n = 256 + len(SPECIAL_TOKENS)
    return [*SPECIAL_TOKENS, *(f"<|reserved_{i}|>" for i in range(-n % VOCAB_MULTIPLE))]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer described in the module docstring, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _special_tokens()
    # Specials live in the model vocab too, so a loader that re-adds them keeps their ids.
    vocab = {tok: i for i, tok in enumerate([*_byte_symbols(), *specials])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    # No merges: every byte is one token whatever the word split, so Qwen2's split regex (which
    # its tokenizer class adds on load) changes nothing.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=specials[len(SPECIAL_TOKENS) :],
        model_max_length=256,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str) -> None:
    """``save_pretrained`` plus ``tokenizer_class: Qwen2Tokenizer``, which names the class that
    transformers v4 and v5 both resolve to a fast Qwen2 tokenizer reading ``tokenizer.json``."""
    tokenizer.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "Qwen2Tokenizer"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


@dataclass(frozen=True, kw_only=True)
class TinyQwen2Spec:
    """Shape of the tiny model. head_dim = hidden_size / num_attention_heads must be >= 32 for
    vLLM's CPU attention."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.hidden_size // self.num_attention_heads < 32:
            raise ValueError(
                "head_dim (hidden_size / num_attention_heads) must be >= 32 for vLLM CPU"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")


def build_config(tokenizer: PreTrainedTokenizerFast, spec: TinyQwen2Spec) -> Qwen2Config:
    from transformers import Qwen2Config

    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )


def init_model(
    tokenizer: PreTrainedTokenizerFast, spec: TinyQwen2Spec, seed: int
) -> Qwen2ForCausalLM:
    """A freshly initialised float32 model; the same seed gives the same weights."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    config = build_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model
