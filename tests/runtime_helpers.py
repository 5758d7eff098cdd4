"""Helpers for tests that start the real runtime: a tiny model with the real tokenizer, and
reference greedy outputs from transformers."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from radixserve.models.resolve import resolve_model

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja",  # where transformers 5 keeps the chat template
)


def make_tiny_chat_model(path: Path, seed: int = 0, max_position_embeddings: int = 2048, **config_overrides: int) -> Path:
    """A 2-layer random Llama that uses the default model's real tokenizer (49,152 tokens).
    `config_overrides`: LlamaConfig fields to change (a smaller `vocab_size` keeps only the
    tokenizer's first ids: prompts are then given as token ids)."""
    default = resolve_model("default", weights=False)  # its tokenizer
    config = LlamaConfig(**{
        "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, **config_overrides,
    })
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.2).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (default / name).exists():
            shutil.copy(default / name, path / name)
    return path


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, eos: int | None = 2) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=0)
            new = gen[0, len(p):].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos) + 1]
            outs.append(new)
    return outs


def children_of(pid: int) -> list[int]:
    """Live child pids of a process (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            if ppid == pid and state != "Z":
                out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


__all__ = ["children_of", "hf_greedy", "make_tiny_chat_model", "pid_alive", "signal"]
