"""Train a small Qwen3.5-architecture language model on this CPU, so that the weight formats' fidelity figures mean
something without downloading a checkpoint.

    python bench/train_tiny_lm.py OUT_DIR [--steps 800] [--hidden 256] [--layers 8] [--vocab 1024] [--seed 0]

Seeded random weights give nearly flat logits, where any perturbation flips the argmax, so their greedy agreement
says little about a format. A trained model predicts confidently where its text is predictable, like a real
checkpoint, and its held-out perplexity is the figure quantization papers compare.

The corpus is the Python standard library's own top-level modules (present with every CPython, no download), in
name order; the last ``--heldout`` of its characters are held out. The tokenizer is a byte-level BPE trained on the
training part (``tokenizers``); the model is HF ``Qwen3_5ForCausalLM`` (transformers, a test-only dependency of
this project), trained in fp32 with AdamW, seeded, so the same machine gives the same weights.

OUT_DIR gets ``config.json`` + ``model.safetensors`` (``save_pretrained``), ``tokenizer.json`` (a folder the runtime
loads like a real checkpoint), ``heldout.txt`` (for ``flashrt-runtime bench-quant --fidelity-text``) and
``training.json`` (the settings and the loss curve).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

HELDOUT_FILE = "heldout.txt"


def stdlib_corpus(max_chars: int) -> str:
    """The standard library's top-level modules in name order, joined, cut at ``max_chars``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    parts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids (every byte is one, so any text encodes) trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainer=trainer)
    return tokenizer


def model_config(vocab_size: int, hidden: int, layers: int, heads: int, head_dim: int):
    """The hybrid layout of Qwen3.5 (three Gated DeltaNet layers, then full attention) at a small width."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, tie_word_embeddings=True, max_position_embeddings=4096)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, ids: torch.Tensor, steps: int, batch: int, seq_len: int, peak_lr: float, seed: int,
          log_every: int = 25) -> list[dict]:
    """Next-token training on random windows of ``ids``; returns the loss curve."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    curve, start = [], time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup=max(1, steps // 20))
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=generator)
        window = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        loss = model(window, labels=window).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": loss.item(), "seconds": time.perf_counter() - start})
            print(f"step {step}: loss {loss.item():.3f} ({curve[-1]['seconds']:.0f} s)", file=sys.stderr)
    return curve


@torch.no_grad()
def mean_nll(model, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over ``ids`` in consecutive windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start:start + seq_len + 1]
        if window.numel() < 2:
            break
        logits = model(window[None, :-1]).logits[0].float()
        total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
        count += window.numel() - 1
    return total / count


def build(out: Path, *, steps: int, hidden: int, layers: int, heads: int, head_dim: int, vocab: int, batch: int,
          seq_len: int, lr: float, corpus_chars: int, heldout: float, seed: int) -> dict:
    """Train and save the folder; returns what ``training.json`` records."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    text = stdlib_corpus(corpus_chars)
    cut = int(len(text) * (1 - heldout))
    tokenizer = train_tokenizer(text[:cut], vocab)
    ids = torch.tensor(tokenizer.encode(text[:cut]).ids)
    held_ids = torch.tensor(tokenizer.encode(text[cut:]).ids)
    model = Qwen3_5ForCausalLM(model_config(tokenizer.get_vocab_size(), hidden, layers, heads, head_dim)).float()
    curve = train(model, ids, steps, batch, seq_len, lr, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / HELDOUT_FILE).write_text(text[cut:], encoding="utf-8")
    record = {"steps": steps, "hidden": hidden, "layers": layers, "heads": heads, "head_dim": head_dim,
              "vocab": tokenizer.get_vocab_size(), "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed,
              "train_tokens": ids.numel(), "heldout_tokens": held_ids.numel(),
              "parameters": sum(p.numel() for p in model.parameters()), "curve": curve,
              "heldout_nll": mean_nll(model, held_ids[:8 * seq_len + 1], seq_len),
              "torch": torch.__version__, "python": sys.version.split()[0]}
    (out / "training.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--corpus-chars", type=int, default=6_000_000)
    parser.add_argument("--heldout", type=float, default=0.02, help="share of the corpus held out (its end)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    record = build(args.out, steps=args.steps, hidden=args.hidden, layers=args.layers, heads=args.heads,
                   head_dim=args.head_dim, vocab=args.vocab, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                   corpus_chars=args.corpus_chars, heldout=args.heldout, seed=args.seed)
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
