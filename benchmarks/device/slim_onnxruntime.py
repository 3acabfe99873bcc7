"""Pack onnxruntime-gpu for a one-GPU device call whose working tree may carry 64 MiB.

The cp312 wheel is 255 MB, 284 MB of it libonnxruntime_providers_cuda.so, whose `.nv_fatbin`
holds every kernel for sm_75, 80, 86, 89, 90 and 120. For one chip (an H100/H200: sm_90) this
keeps the sm_90 entries of the fatbin containers that also serve sm_80 (the standard ops'
kernels) and zeroes the payload of every other entry, of the containers built for sm_90 alone
(contrib kernels: flash attention, MoE) and of the cubins embedded in `.rodata` (the fused
attention kernels), drops libonnxruntime.so (the C API's; the Python module links its own),
the TensorRT provider and the Python subpackages the runtime does not import, and writes an
xz tarball of the package (~46 MB). Zeroed payloads are never loaded with
CUDA_MODULE_LOADING=LAZY (the default since CUDA 12.2) unless a kernel in them is launched:
an op of those contrib kernels would fail, the standard ONNX ops our graphs use do not.

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d /tmp/whl onnxruntime-gpu==1.31.1
    python benchmarks/device/slim_onnxruntime.py /tmp/whl/onnxruntime_gpu-1.31.1-*.whl .gpu
    # then .gpu/run.sh (benchmarks/device/run_h200.sh) in a device call carrying .gpu
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
import tarfile
import tempfile
import zipfile

FATBIN_MAGIC = 0xBA55ED50
EM_CUDA = 190
KEEP_SM = 90
# what the runtime never loads (libonnxruntime.so.*, the C API's, goes too)
DROP = ("capi/libonnxruntime_providers_tensorrt.so", "transformers", "quantization", "backend")


def sections(data: bytes) -> dict[str, tuple[int, int]]:
    """{name: (offset, size)} of an ELF64 little-endian file's sections."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    table = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strings = table[shstrndx][4]
    out = {}
    for name, _typ, _flags, _addr, offset, size in table:
        end = data.index(b"\0", strings + name)
        out[data[strings + name:end].decode()] = (offset, size)
    return out


def keep_one_arch(data: bytearray, sm: int = KEEP_SM) -> tuple[int, int]:
    """Zero every fatbin entry's payload but sm `sm`'s in containers that also hold sm 80;
    returns (bytes kept, bytes zeroed)."""
    off, size = sections(data)[".nv_fatbin"]
    pos, end, kept, zeroed = off, off + size, 0, 0
    while pos < end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # alignment padding between containers
            continue
        entries, e = [], pos + hsz
        while e < pos + hsz + fsz:
            _kind, _ever, ehsz, padded = struct.unpack_from("<HHII", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            entries.append((e + ehsz, padded, arch))
            e += ehsz + padded
        standard = any(arch == 80 for *_, arch in entries)
        for start, n, arch in entries:
            if arch == sm and standard:
                kept += n
            else:
                data[start:start + n] = bytes(n)
                zeroed += n
        pos += hsz + fsz
    return kept, zeroed


def zero_embedded_cubins(data: bytearray) -> int:
    """Zero the CUDA ELF images embedded in `.rodata`; returns the bytes zeroed."""
    off, size = sections(data)[".rodata"]
    pos, zeroed = off, 0
    while (i := data.find(b"\x7fELF", pos, off + size)) >= 0:
        machine, = struct.unpack_from("<H", data, i + 18)
        shoff, = struct.unpack_from("<Q", data, i + 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, i + 0x3A)
        length = shoff + shentsize * shnum
        if machine == EM_CUDA and 0 < length < 20_000_000:
            data[i:i + length] = bytes(length)
            zeroed += length
            pos = i + length
        else:
            pos = i + 4
    return zeroed


def main(wheel: str, out: str) -> int:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        pkg = os.path.join(tmp, "onnxruntime")
        for name in os.listdir(os.path.join(pkg, "capi")):
            if name.startswith("libonnxruntime.so"):
                os.remove(os.path.join(pkg, "capi", name))
        for d in DROP:
            p = os.path.join(pkg, d)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        lib = os.path.join(pkg, "capi", "libonnxruntime_providers_cuda.so")
        data = bytearray(open(lib, "rb").read())
        kept, zeroed = keep_one_arch(data)
        zeroed += zero_embedded_cubins(data)
        open(lib, "wb").write(data)
        print(f"sm_{KEEP_SM} kernels kept {kept / 1e6:.1f} MB, zeroed {zeroed / 1e6:.1f} MB")
        with tarfile.open(os.path.join(out, "onnxruntime.tar.xz"), "w:xz", preset=9) as tar:
            tar.add(pkg, arcname="onnxruntime")
            for d in os.listdir(tmp):
                if d.endswith(".dist-info"):
                    tar.add(os.path.join(tmp, d), arcname=d)
    print(f"wrote {os.path.join(out, 'onnxruntime.tar.xz')} "
          f"({os.path.getsize(os.path.join(out, 'onnxruntime.tar.xz')) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: slim_onnxruntime.py WHEEL OUT_DIR")
    sys.exit(main(sys.argv[1], sys.argv[2]))
