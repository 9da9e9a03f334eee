"""Write our engine's weights as a llama.cpp GGUF (architecture ``qwen35``) through the sdist's own converter.

The converter class (``conversion.qwen.Qwen3_5TextModel``, what ``convert_hf_to_gguf.py`` runs for
``Qwen3_5ForCausalLM``) does every tensor transformation itself (names, ``1 + w`` norms in fp32, ``-exp(A_log)``, the
squeezed conv, the V-head reorder when K heads < V heads); we only feed it our tensors under their HF names straight
from memory (no safetensors round trip) and the tokenizer metadata of ``models/ggml-vocab-qwen35.gguf`` (padded or cut to
the preset's vocabulary). bf16 weights stay bf16 bit for bit; 1-D tensors are F32, as the converter writes them.
The MTP head is left out (``--no-mtp``): llama.cpp's qwen35 decode does not run it.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SRC = HERE / "llama.cpp"


def import_converter(src: Path = DEFAULT_SRC):
    """The sdist's gguf-py and conversion package (imported from the trimmed tree, never from site-packages)."""
    for path in (src / "gguf-py", src):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import gguf
    from conversion.qwen import Qwen3_5TextModel
    return gguf, Qwen3_5TextModel


def imrope_sections(rotary_dim: int) -> list[int]:
    """Interleaved-MRoPE sections covering every rotary pair with a text axis (t, h, w): [11, 11, 10, 0] for Qwen3.5's
    64 rotary dims (the converter's default), [1, 1, 0, 0] for the tiny preset's 4 (ggml asserts sum <= head_dim)."""
    pairs = rotary_dim // 2
    return [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0]


def hf_config(cfg) -> dict:
    """The ``config.json`` an HF Qwen3_5ForCausalLM checkpoint of this ModelConfig would carry, with the fields the
    converter reads beyond ours (the attention interval, the MRoPE sections)."""
    from flashrt_ros.tools.checkpoint_writer import hf_config as text_config

    config = text_config(cfg)
    config["full_attention_interval"] = 4
    config["rope_parameters"]["mrope_section"] = imrope_sections(cfg.rotary_dim)[:3]
    return config


_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}                                     # GGUF value types; 8 is a string, 9 an array


def read_metadata(path: Path) -> dict:
    """A GGUF's key/value metadata (no tensors). gguf-py's GGUFReader takes ~10 s on this 2-core CPU for the vocab
    file's 300k strings; this takes a fraction of a second."""
    data = memoryview(Path(path).read_bytes())
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 24                                             # magic, version u32, tensor count u64, kv count u64
    count = int(np.frombuffer(data, "<u8", 1, 16)[0])

    def string():
        nonlocal pos
        n = int(np.frombuffer(data, "<u8", 1, pos)[0])
        pos += 8 + n
        return bytes(data[pos - n:pos]).decode("utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            inner, n = int(np.frombuffer(data, "<u4", 1, pos)[0]), int(np.frombuffer(data, "<u8", 1, pos + 4)[0])
            pos += 12
            if inner in _SCALARS:
                out = np.frombuffer(data, _SCALARS[inner], n, pos).tolist()
                pos += n * np.dtype(_SCALARS[inner]).itemsize
                return out
            return [value(inner) for _ in range(n)]
        out = np.frombuffer(data, _SCALARS[kind], 1, pos)[0].item()
        pos += np.dtype(_SCALARS[kind]).itemsize
        return out

    fields = {}
    for _ in range(count):
        key = string()
        kind = int(np.frombuffer(data, "<u4", 1, pos)[0])
        pos += 4
        fields[key] = value(kind)
    return fields


def _vocab(gguf, path: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> dict:
    """Tokenizer fields of the vocab GGUF fitted to ``vocab_size``: padded with ``[PADi]`` (UNUSED), as the converter
    pads a Qwen vocab, or cut, keeping only the merges whose pieces all survive."""
    meta = read_metadata(path)
    field = lambda key: meta[key]   # noqa: E731
    tokens, types, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), \
        field("tokenizer.ggml.merges")
    if vocab_size >= len(tokens):
        pad = range(len(tokens), vocab_size)
        tokens = tokens + [f"[PAD{i}]" for i in pad]
        types = types + [int(gguf.TokenType.UNUSED)] * len(pad)
    else:
        tokens, types = tokens[:vocab_size], types[:vocab_size]
        kept = set(tokens)
        merges = [m for m in merges if (parts := m.split(" ")) and all(p in kept for p in parts)
                  and "".join(parts) in kept]
    special = {k: field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "bos", "padding")}
    if eos_ids or any(v >= vocab_size for v in special.values()):
        first = eos_ids[0] if eos_ids else vocab_size - 1
        special = {k: first for k in special}
    return {"model": field("tokenizer.ggml.model"), "pre": field("tokenizer.ggml.pre"), "tokens": tokens,
            "types": types, "merges": merges, **special}


def write_gguf(model, out: Path, outtype: str = "bf16", vocab_gguf: Path | None = None, src: Path = DEFAULT_SRC) -> dict:
    """Write ``model`` (our Qwen35, any device) to ``out`` as a GGUF of ``outtype`` (``bf16``: bf16 weights stay bit for
    bit; ``f32``: for an fp32 engine, so both sides hold the same fp32 weights); returns a summary."""
    gguf, Qwen3_5TextModel = import_converter(src)
    import torch

    cfg = model.cfg
    ours = {k: v for k, v in model.hf_state_dict().items() if not k.startswith("mtp.")}
    vocab = _vocab(gguf, vocab_gguf or src / "models" / "ggml-vocab-qwen35.gguf", cfg.vocab_size, cfg.eos_token_ids)

    class FromEngine(Qwen3_5TextModel):
        model_arch = gguf.MODEL_ARCH.QWEN35
        no_mtp = True

        def index_tensors(self, remote_hf_model_id=None):
            type(self)._original_block_count = self.hparams["num_hidden_layers"]
            type(self).opt_num_mtp_layers = 0
            items = (self.filter_tensors((name, lambda t=t: t.detach().to("cpu"))) for name, t in ours.items())
            return dict(item for item in items if item is not None)

        def set_vocab(self):
            w = self.gguf_writer
            w.add_tokenizer_model(vocab["model"])
            w.add_tokenizer_pre(vocab["pre"])
            w.add_token_list(vocab["tokens"])
            w.add_token_types(vocab["types"])
            w.add_token_merges(vocab["merges"])
            w.add_eos_token_id(vocab["eos"])
            w.add_bos_token_id(vocab["bos"])
            w.add_pad_token_id(vocab["padding"])

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as card, torch.inference_mode():
        (Path(card) / "config.json").write_text(json.dumps(hf_config(cfg)))
        ftype = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32}[outtype]
        writer = FromEngine(Path(card), ftype, out, eager=True, hparams=hf_config(cfg),
                            model_name="flashrt-preset")
        writer.write()
    return {"path": str(out), "bytes": out.stat().st_size, "tensors": len(ours), "vocab_tokens": len(vocab["tokens"])}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import logging
    import time

    sys.path.insert(0, str(HERE.parents[1]))
    from flashrt_ros.runtime.engine import _DTYPES
    from flashrt_ros.runtime import weights
    import torch

    parser = argparse.ArgumentParser(description="write a preset's seeded weights as a qwen35 GGUF")
    parser.add_argument("--model", default="qwen3.5-0.8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the weights' dtype, also the GGUF's (bf16 or f32)")
    parser.add_argument("--device", default="cpu", help="where the seeded weights are generated (cuda is faster)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    with torch.no_grad():
        model, _ = weights.load(args.model, torch.device(args.device), _DTYPES[args.dtype], args.seed)
    summary = write_gguf(model, args.out, "bf16" if args.dtype == "bfloat16" else "f32")
    summary["seconds"] = time.perf_counter() - started
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
