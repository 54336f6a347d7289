# shellcheck shell=bash
# Shared by the scripts that run ON the GPU machine (source it): the CUDA libraries' path and the unpacking of the
# binaries that scripts/prepare-gpurun.sh (or package-gpu.sh) compressed.
#   source scripts/gpu-env.sh; gpu_libs; unpack_bin DIST BIN trainer gpu-tests

# gpu_libs: puts the CUDA 13 libraries of the machine's PyTorch wheels (cuBLAS, cuDNN, NCCL, cudart) on
# LD_LIBRARY_PATH; libcuda.so.1 is the driver's. GPU_SITE is that wheels' folder (ktrace builds against its CUPTI).
GPU_SITE=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
gpu_libs() {
    local site=$GPU_SITE
    export LD_LIBRARY_PATH="$site/cu13/lib:$site/cudnn/lib:$site/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# unpack_bin DIST BIN NAME...: each DIST/NAME.xz (GPURUN_XZ=1) or DIST/NAME.gz into BIN/NAME, executable; a
# missing one is named and the call fails.
unpack_bin() {
    local dist="$1" bin="$2" f
    shift 2
    for f in "$@"; do
        if [ -f "$dist/$f.xz" ]; then
            xz -dc "$dist/$f.xz" > "$bin/$f"
        elif [ -f "$dist/$f.gz" ]; then
            gunzip -c "$dist/$f.gz" > "$bin/$f"
        else
            echo "unpack_bin: missing $dist/$f.xz (or .gz)" >&2
            return 2
        fi && chmod +x "$bin/$f" || return 2
    done
}

# ktrace_lib KTRACE_DIR SO: builds the kernel-timeline injection library (KTRACE_DIR/ktrace.c, against the wheels'
# CUPTI and the CUDA headers under /usr/local) into SO; fails (gcc's status) where it cannot.
ktrace_lib() {
    local inc
    inc="$(dirname "$(dirname "$(find /usr/local -name host_defines.h -path '*crt*' 2>/dev/null | head -1)")")"
    gcc -O2 -shared -fPIC "$1/ktrace.c" -o "$2" -I"$GPU_SITE/cu13/include" -I"$inc" -L"$GPU_SITE/cu13/lib" \
        -l:libcupti.so.13 -lpthread
}

# devbench_hashes LOG: the hash words of a dev harness log (kernels/dev/batchnorm/bnbench.cu,
# kernels/dev/gemm/tmabench.cu): on every shape line (l1 .. l4) its first four words and every 16-digit hex word,
# so that two builds' logs compare bit for bit with diff.
devbench_hashes() {
    awk '/^l[1-4] /{s = $1 " " $2 " " $3 " " $4
        for (i = 5; i <= NF; i++) if (length($i) == 16 && $i ~ /^[0-9a-f]+$/) s = s " " $i
        print s}' "$1"
}
