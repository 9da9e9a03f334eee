"""Benchmark: capsule file export and import against their floors, for a payload of a given size.

    python -m flashrt_ros.tools.bench_files --mib 243 --device cuda --dir /tmp/capsules [--key]

243 MiB is the 0.8B shape's capsule at 16k, 1240 MiB the 27B shape's. Export = ``write_capsule_file`` (device to
host in chunks, SHA-256 or HMAC, write, fsync, rename); import = ``read_capsule_file`` (header checks, chunked read
into one device tensor while hashing, digest and device checksum checks). Their floors, measured in the same run
on the same bytes: the plain write + fsync of the host bytes, the plain read of the file into a preallocated host
tensor (the page cache is warm: the file was just written), hashlib over the bytes, and the device checksum.
Medians of ``--repeats`` runs, host wall-clock around synchronised device work.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
from pathlib import Path

import torch

from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule.capsule import Capsule, CapsuleInfo
from flashrt_ros.runtime.checksum import checksum

from . import provenance
from .timing import timed


def _median_ms(device: torch.device, fn, repeats: int) -> float:
    return statistics.median(timed(device, fn)[1] for _ in range(repeats))


def file_figures(nbytes: int, device: torch.device, folder: Path, key: bytes | None, repeats: int) -> dict:
    data = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    info = CapsuleInfo(id="bench", parent="", label="", position=0, nbytes=nbytes, tier=device.type,
                       checksum=checksum(data), created=0.0)
    capsule = Capsule(info, "0" * 64, data)
    path = capsule_file.capsule_path(folder, "bench")
    host = data.cpu()
    plain = folder / ".bench.plain"

    def plain_write():
        with open(plain, "wb") as f:
            f.write(memoryview(host.numpy()))
            f.flush()
            os.fsync(f.fileno())

    def plain_read():
        target = torch.empty(nbytes, dtype=torch.uint8)
        with open(plain, "rb") as f:
            f.readinto(memoryview(target.numpy()))

    def digest():
        mac = hmac.new(key, digestmod=hashlib.sha256) if key else hashlib.sha256()
        mac.update(memoryview(host.numpy()))

    figures = {
        "payload_mib": nbytes / 2**20, "device": str(device), "keyed": key is not None,
        "export_ms": _median_ms(device, lambda: capsule_file.write_capsule_file(capsule, path, key), repeats),
        "import_ms": _median_ms(device, lambda: capsule_file.read_capsule_file(path, device, key=key,
                                                                               expect=lambda i, f: None), repeats),
        "write_fsync_floor_ms": _median_ms(device, plain_write, repeats),
        "read_floor_ms": _median_ms(device, plain_read, repeats),
        "digest_ms": _median_ms(device, digest, repeats),
        "device_checksum_ms": _median_ms(device, lambda: checksum(data), repeats),
        "device_to_host_ms": _median_ms(device, data.cpu, repeats),
    }
    path.unlink()
    plain.unlink()
    figures["export_gib_per_s"] = nbytes / 2**30 / (figures["export_ms"] / 1000)
    figures["import_gib_per_s"] = nbytes / 2**30 / (figures["import_ms"] / 1000)
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="payload size, MiB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", required=True, help="folder for the files (on the disk to measure)")
    parser.add_argument("--key", action="store_true", help="sign with an HMAC key (else plain SHA-256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    folder = capsule_file.prepare_capsule_dir(args.dir)
    figures = file_figures(int(args.mib * 2**20), torch.device(args.device), folder,
                           os.urandom(32) if args.key else None, args.repeats)
    print(json.dumps(figures, indent=2))
    if args.json:
        provenance.write_result(args.json, figures, args.device)


if __name__ == "__main__":
    main()
