"""Trim llama.cpp out of the llama-cpp-python 0.3.36 sdist: what the CPU/CUDA build, gguf-py and the HF converter
need, plus the Qwen3.5 vocab GGUF. The sdist is 76 MB (mostly a git pack and vocab files); the result is ~25 MB, small
enough to travel to the GPU machine as a `carry` path.

    python3 bench/peer_llamacpp/prepare_source.py [--sdist FILE.tar.gz] [--dest bench/peer_llamacpp/llama.cpp]

Without --sdist it runs `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36` into a temp dir.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST_VERSION = "0.3.36"
# The llama.cpp submodule commit of llama-cpp-python 0.3.36 (`git ls-tree HEAD vendor/llama.cpp` in the sdist).
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
VENDOR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
# Paths under vendor/llama.cpp that are kept (a trailing / keeps the folder).
KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "common/", "vendor/", "licenses/",
        "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/", "ggml/src/ggml-cpu/", "ggml/src/ggml-cuda/",
        "tools/llama-bench/", "gguf-py/gguf/", "gguf-py/LICENSE", "convert_hf_to_gguf.py", "conversion/",
        "models/ggml-vocab-qwen35.gguf")


def kept(rel: str) -> bool:
    if rel.startswith("ggml/src/") and "/" not in rel[len("ggml/src/"):]:
        return True                                    # ggml's core sources (the backend folders are chosen above)
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP)


def download(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(where),
                    f"llama-cpp-python=={SDIST_VERSION}"], check=True)
    return next(where.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))


def extract(sdist: Path, dest: Path) -> int:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    total = 0
    with tarfile.open(sdist) as tar:
        for member in tar:
            if not member.name.startswith(VENDOR) or not member.isfile():
                continue
            rel = member.name[len(VENDOR):]
            if not kept(rel):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(member.mode & 0o755 | 0o644)
            total += member.size
    (dest / "PEER_VERSION.json").write_text(json.dumps(
        {"llama_cpp_commit": LLAMA_CPP_COMMIT, "source": f"llama-cpp-python {SDIST_VERSION} sdist, vendor/llama.cpp",
         "trimmed_by": "bench/peer_llamacpp/prepare_source.py"}, indent=2) + "\n")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, help="llama_cpp_python-0.3.36.tar.gz (downloaded when omitted)")
    parser.add_argument("--dest", type=Path, default=HERE / "llama.cpp")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download(Path(tmp))
        total = extract(sdist, args.dest)
    print(f"{args.dest}: {total / 2**20:.1f} MiB (llama.cpp {LLAMA_CPP_COMMIT[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
