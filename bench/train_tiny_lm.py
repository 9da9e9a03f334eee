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

With ``--mtp`` (the default) the multi-token-prediction head (``mtp.*``, as Qwen3.5 checkpoints carry it) is trained
beside the model: at position t it sees the model's final hidden state at t-1 and the embedding of token t, and
predicts token t+1 (the way ``runtime/model.py`` feeds it; its draft is the token after the model's own next one).
Its loss reaches neither the model nor the shared embedding (they enter detached, and the head has its own optimiser
and clipping), so the model's weights are those of a run without it, bit for bit.

OUT_DIR gets ``config.json`` + ``model.safetensors`` (``save_pretrained``, plus ``mtp.*`` and
``mtp_num_hidden_layers`` when the head is trained), ``tokenizer.json`` (a folder the runtime loads like a real
checkpoint), ``heldout.txt`` (for ``flashrt-runtime bench-quant --fidelity-text``) and
``training.json`` (the settings and the loss curve).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
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


class MTPHead(torch.nn.Module):
    """Qwen3.5's MTP head in HF modules, named as checkpoints name ``mtp.*``: fc(cat(norm(embed(t)), norm(h_{t-1})))
    through one full-attention decoder layer and a final norm; the logits come from the (tied) LM head."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        layer_config = copy.deepcopy(config)
        layer_config.layer_types, layer_config.num_hidden_layers = ["full_attention"], 1
        layer_config._attn_implementation = "sdpa"          # causal without a mask
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = torch.nn.ModuleList([hf.Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = hf.Qwen3_5RMSNorm(hidden, eps=eps)
        self.rotary = hf.Qwen3_5TextRotaryEmbedding(layer_config)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds: [B, T, H] of tokens t; previous: [B, T, H] final hidden states at t-1; positions: [B, T] = t.
        Returns the head's final hidden states [B, T, H] (logits through the LM head predict token t+1)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous)], dim=-1))
        # the ids of its 3 rope sections: transformers 5.24 broadcasts [B, T] itself, 5.17 (the GPU machine's) does not
        rope = self.rotary(x, positions.expand(3, -1, -1))
        for layer in self.layers:
            x = layer(x, position_embeddings=rope, position_ids=positions)
        return self.norm(x)


def mtp_loss(model, head: MTPHead, window: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's prediction of token t+1 from (hidden at t-1, token t), t = 1 .. T-2, with the
    model and the embedding detached."""
    embed = model.get_input_embeddings().weight.detach()
    positions = torch.arange(1, window.shape[1] - 1)[None].expand(window.shape[0], -1)
    out = head(torch.nn.functional.embedding(window[:, 1:-1], embed), hidden[:, :-2].detach(), positions)
    logits = torch.nn.functional.linear(out, embed).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 2:].flatten())


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def torch_delta_rule():
    """transformers binds Qwen3.5's Gated DeltaNet functions to fla's Triton kernels when fla imports, whatever the
    tensors' device (the GPU machine has fla beside the runtime); this model trains on the CPU, so while it does,
    they are the torch functions those wrap."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    bound = {name: getattr(hf, name) for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
    for name, function in bound.items():
        setattr(hf, name, inspect.unwrap(function))
    try:
        yield
    finally:
        for name, function in bound.items():
            setattr(hf, name, function)


def train(model, ids: torch.Tensor, steps: int, batch: int, seq_len: int, peak_lr: float, seed: int,
          head: MTPHead | None = None, log_every: int = 25) -> list[dict]:
    """Next-token training on random windows of ``ids`` (and the MTP ``head``'s, on the same windows); returns the
    loss curve."""
    generator = torch.Generator().manual_seed(seed)
    parts = [model] + ([head] if head is not None else [])
    optimizers = [torch.optim.AdamW(part.parameters(), lr=peak_lr, weight_decay=0.1, betas=(0.9, 0.95))
                  for part in parts]
    final_hidden = []
    if head is not None:     # the final norm's output, caught on the way (the model's own forward is unchanged)
        model.model.norm.register_forward_hook(lambda module, args, out: final_hidden.append(out))
    model.train()
    curve, start = [], time.perf_counter()
    for step in range(steps):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, peak_lr, warmup=max(1, steps // 20))
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=generator)
        window = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        final_hidden.clear()
        losses = [model(window, labels=window).loss]
        if head is not None:
            losses.append(mtp_loss(model, head, window, final_hidden[-1]))
        for loss in losses:          # all before any step: the head's loss reads the embedding the model updates
            loss.backward()
        for part, optimizer in zip(parts, optimizers):
            torch.nn.utils.clip_grad_norm_(part.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": losses[0].item(), "seconds": time.perf_counter() - start,
                          **({"mtp_loss": losses[1].item()} if head is not None else {})})
            print(f"step {step}: loss {losses[0].item():.3f} ({curve[-1]['seconds']:.0f} s)", file=sys.stderr)
    return curve


def save_mtp(out: Path, head: MTPHead) -> None:
    """Add the head's tensors (``mtp.*``) to the saved checkpoint and ``mtp_num_hidden_layers`` to its config."""
    from safetensors.torch import load_file, save_file

    weights = load_file(out / "model.safetensors")
    weights.update({f"mtp.{name}": tensor.detach().contiguous() for name, tensor in head.state_dict().items()
                    if not name.startswith("rotary.")})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


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
          seq_len: int, lr: float, corpus_chars: int, heldout: float, seed: int, mtp: bool = True) -> dict:
    """Train and save the folder; returns what ``training.json`` records."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    text = stdlib_corpus(corpus_chars)
    cut = int(len(text) * (1 - heldout))
    tokenizer = train_tokenizer(text[:cut], vocab)
    ids = torch.tensor(tokenizer.encode(text[:cut]).ids)
    held_ids = torch.tensor(tokenizer.encode(text[cut:]).ids)
    model = Qwen3_5ForCausalLM(model_config(tokenizer.get_vocab_size(), hidden, layers, heads, head_dim)).float()
    head = MTPHead(model.config).float() if mtp else None
    with torch_delta_rule():
        curve = train(model, ids, steps, batch, seq_len, lr, seed, head)
        heldout_nll = mean_nll(model, held_ids[:8 * seq_len + 1], seq_len)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    if head is not None:
        save_mtp(out, head.eval())
    tokenizer.save(str(out / "tokenizer.json"))
    (out / HELDOUT_FILE).write_text(text[cut:], encoding="utf-8")
    record = {"steps": steps, "hidden": hidden, "layers": layers, "heads": heads, "head_dim": head_dim,
              "vocab": tokenizer.get_vocab_size(), "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed, "mtp": mtp,
              "train_tokens": ids.numel(), "heldout_tokens": held_ids.numel(),
              "parameters": sum(p.numel() for p in model.parameters()), "curve": curve,
              "heldout_nll": heldout_nll,
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
    parser.add_argument("--no-mtp", dest="mtp", action="store_false", help="do not train the MTP head")
    args = parser.parse_args(argv)
    record = build(args.out, steps=args.steps, hidden=args.hidden, layers=args.layers, heads=args.heads,
                   head_dim=args.head_dim, vocab=args.vocab, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                   corpus_chars=args.corpus_chars, heldout=args.heldout, seed=args.seed,
                   mtp=args.mtp)
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
