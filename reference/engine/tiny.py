"""A tiny Llama folder with a tokenizer and a chat template, made offline, to serve or test with.

Nothing is downloaded: the model is built from a config with random weights (``transformers``),
the tokenizer is byte-level BPE with no merges (every text encodes, one id per byte; ``tokenizers``),
and the chat template is a small Jinja string. Adapters are random PEFT LoRA folders. The outputs
are meaningless text; the point is a real folder that ``python -m reference.engine.server`` and
PEFT both load, so the server can be tried and checked against PEFT on any machine.

Run::

    python -m reference.engine.tiny /tmp/tiny --adapter sql --adapter chat
    python -m reference.engine.server --model /tmp/tiny/model --lora-modules sql=/tmp/tiny/sql chat=/tmp/tiny/chat
"""
from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["CHAT_TEMPLATE", "TINY_CONFIG", "byte_tokenizer", "tiny_llama", "save_tiny"]

#: A Llama small enough for the CPU: 2 layers, hidden 64, GQA 4 query heads on 2 KV heads, the
#: byte vocabulary (256 ids) plus two special tokens.
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, vocab_size=258, max_position_embeddings=256,
                   bos_token_id=256, eos_token_id=257)

#: Roles in brackets, then the assistant's turn opened (``add_generation_prompt``).
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def byte_tokenizer(chat_template: Optional[str] = CHAT_TEMPLATE):
    """A byte-level ``PreTrainedTokenizerFast``: ids 0-255 are bytes, 256 ``<s>`` and 257 ``</s>``
    (eos). ``chat_template`` None leaves it without one (the server then refuses chat with a 400)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def tiny_llama(seed: int = 0, **overrides):
    """A random ``LlamaForCausalLM`` of :data:`TINY_CONFIG` (``overrides`` change fields), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_CONFIG, **overrides})).eval()


def save_tiny(folder, adapters: Optional[dict] = None, seed: int = 0,
              chat_template: Optional[str] = CHAT_TEMPLATE) -> dict:
    """Save ``folder/model`` (model + tokenizer) and one PEFT folder ``folder/NAME`` per adapter.

    ``adapters``: name -> ``peft.LoraConfig`` keyword arguments (``init_lora_weights`` defaults to
    False: random B, so the adapter changes the output); None: no adapter. Returns {"model": path, NAME: path, ...}.
    """
    import peft
    import torch

    folder = Path(folder)
    base = tiny_llama(seed)
    paths = {"model": folder / "model"}
    base.save_pretrained(paths["model"])
    byte_tokenizer(chat_template).save_pretrained(paths["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (name, kw) in enumerate((adapters or {}).items()):
            torch.manual_seed(1000 * (seed + 1) + k)
            cfg = peft.LoraConfig(**{"init_lora_weights": False, **kw})
            peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(folder / name)
            paths[name] = folder / name
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME",
                    help="a random rank-8 LoRA on every linear layer, saved as FOLDER/NAME")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = save_tiny(args.folder, {n: dict(r=8, lora_alpha=16, target_modules="all-linear") for n in args.adapter},
                      args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
