"""A random-weight Llama and a word-level tokenizer, built locally (no downloads).

For end-to-end runs of vLLM with the connector where no real checkpoint is at hand
(``nox -s vllm``, ``lmcache bench vllm``): vLLM loads the folder like any Hugging Face
model. Needs ``transformers`` and ``tokenizers`` (both come with vLLM).

The folder is reused when its ``lmcache-tiny-model.json`` matches the requested shape, so
repeated runs build it once.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP = "lmcache-tiny-model.json"


@dataclass(frozen=True)
class TinyLlama:
    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def word(token_id: int) -> str:
    """The tokenizer's word for an id (ids below 4 are special tokens)."""
    return f"w{token_id}"


def build_tiny_llama(folder: str | os.PathLike[str], spec: TinyLlama | None = None) -> Path:
    """Write the model and tokenizer into ``folder`` (kept if it already matches ``spec``)."""
    spec = spec or TinyLlama()
    path = Path(folder)
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return path
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"hidden_size {spec.hidden_size} must split into num_heads {spec.num_heads}, "
            f"which must split into num_kv_heads {spec.num_kv_heads}"
        )
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({word(i): i for i in range(len(specials), spec.vocab_size)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(path)

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(path)
    stamp.write_text(json.dumps(asdict(spec)))
    return path


def prompt_token_ids(num_tokens: int, seed: int, vocab_size: int = 1024) -> list[int]:
    """A deterministic prompt of ordinary (non-special) token ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab_size) for _ in range(num_tokens)]
