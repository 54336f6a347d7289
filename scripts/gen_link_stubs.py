#!/usr/bin/env python3
"""Generate link-time stub shared libraries for the CUDA libraries cudarc links with -l.

candle-core 0.11.1 forces cudarc's `dynamic-linking` feature, so a CUDA build links against
libcuda, libnvrtc, libcurand, libcublas, libcublasLt (and libcudnn with candle's `cudnn` feature).
None of these is installed on the build machine (no GPU, no toolkit). Each stub exports the function
names cudarc declares in `src/<module>/sys/mod.rs`, as empty functions, under the real library's
SONAME: the binary then records DT_NEEDED on the real names (the driver's libcuda.so.1, the wheels'
libcublas.so.13, ...), which the GPU machine resolves at run time. Rust binaries link with BIND_NOW,
so every symbol the program imports must exist in the real libraries there; the declared set of
cudarc is a superset of what candle calls, and the real libraries export all of it.

usage: gen_link_stubs.py <cudarc-src-dir> <out-lib-dir>
"""
import os
import re
import subprocess
import sys
import tempfile

# cudarc module -> (link name, SONAME of the CUDA 13 / cuDNN 9 library)
LIBS = {
    "driver": ("cuda", "libcuda.so.1"),
    "nvrtc": ("nvrtc", "libnvrtc.so.13"),
    "curand": ("curand", "libcurand.so.10"),
    "cublas": ("cublas", "libcublas.so.13"),
    "cublaslt": ("cublasLt", "libcublasLt.so.13"),
    "cudnn": ("cudnn", "libcudnn.so.9"),
    # The trainer's `nccl` feature (data-parallel training): the nvidia-nccl wheel's library on the GPU machine.
    "nccl": ("nccl", "libnccl.so.2"),
}

FN = re.compile(r"^\s*pub unsafe fn (\w+)\s*[(<]", re.M)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for mod, (name, soname) in LIBS.items():
        path = os.path.join(src, "src", mod, "sys", "mod.rs")
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            print(f"gen_link_stubs: cannot read {path}: {e}", file=sys.stderr)
            return 1
        fns = sorted(set(FN.findall(text)))
        if not fns:
            print(f"gen_link_stubs: no functions found in {path}", file=sys.stderr)
            return 1
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
            f.writelines(f"void {fn}(void) {{}}\n" for fn in fns)
            cfile = f.name
        so = os.path.join(out, f"lib{name}.so")
        try:
            subprocess.check_call(["gcc", "-shared", "-fPIC", "-o", so, cfile, f"-Wl,-soname,{soname}"])
        finally:
            os.unlink(cfile)
        print(f"{so}: {len(fns)} symbols, SONAME {soname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
