# shellcheck shell=bash
# Set up a CUDA 13.0 build environment on a machine without GPU or CUDA toolkit. Usage (from anywhere):
#   source scripts/setup-cuda.sh
# If nvcc is already on PATH it is used as is (only CUDA_COMPUTE_CAP/CUDARC_CUDA_VERSION defaults are set).
# Otherwise: installs the pinned CUDA 13.0 compiler wheels from PyPI into <repo>/.cuda/py (one pip call: a second
# `pip install --target` into the same folder would not merge the shared nvidia/ tree), builds link stubs for
# the libraries cudarc links (scripts/gen_link_stubs.py) into <repo>/.cuda/lib, links libcudart.so there, and
# exports CUDA_ROOT/CUDA_PATH/CUDA_HOME/PATH/CUDA_COMPUTE_CAP/CUDARC_CUDA_VERSION. Idempotent: a second run
# only checks stamps and exports. See docs/CUDA_BUILD.md.

_setup_cuda_main() {
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    # 90 = H200/H100. candle-kernels' build reads it (no nvidia-smi here); cudarc's reads CUDARC_CUDA_VERSION.
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"

    if command -v nvcc >/dev/null 2>&1 && [ -z "${_SETUP_CUDA_OURS:-}" ]; then
        echo "setup-cuda: using nvcc on PATH: $(command -v nvcc)"
        return 0
    fi

    local py="$repo/.cuda/py" lib="$repo/.cuda/lib"
    local root="$py/nvidia/cu13"
    # Pinned: nvcc 13.0.88 alone would pull 13.5 nvvm/crt, whose PTX the 13.0 driver cannot load.
    local pins="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96"
    if [ "$(cat "$repo/.cuda/py.stamp" 2>/dev/null)" != "$pins" ] || [ ! -x "$root/bin/nvcc" ]; then
        echo "setup-cuda: installing CUDA 13.0 compiler wheels into $py"
        rm -rf "$py" "$repo/.cuda/py.stamp"
        mkdir -p "$repo/.cuda"
        # shellcheck disable=SC2086
        python3 -m pip install -q --disable-pip-version-check --no-cache-dir --target "$py" $pins || {
            echo "setup-cuda: pip install failed" >&2; return 1; }
        echo "$pins" > "$repo/.cuda/py.stamp"
    fi

    export CUDA_ROOT="$root" CUDA_PATH="$root" PATH="$root/bin:$PATH"
    export _SETUP_CUDA_OURS=1
    "$root/bin/nvcc" --version >/dev/null || { echo "setup-cuda: nvcc does not run" >&2; return 1; }

    # Link stubs, generated from the cudarc sources that Cargo.lock resolves (the declared symbols per library).
    local cudarc_dir
    cudarc_dir="$(cd "$repo" && cargo metadata --format-version 1 --features trainer/cuda 2>/dev/null | python3 -c '
import json, sys, os
m = json.load(sys.stdin)
p = [p for p in m["packages"] if p["name"] == "cudarc"]
print(os.path.dirname(p[0]["manifest_path"]) if p else "")')"
    if [ -z "$cudarc_dir" ] || [ ! -d "$cudarc_dir/src" ]; then
        echo "setup-cuda: cudarc sources not found via cargo metadata" >&2; return 1
    fi
    if [ "$(cat "$lib/stubs.stamp" 2>/dev/null)" != "$cudarc_dir" ] || [ ! -e "$lib/libcuda.so" ] || [ ! -e "$lib/libnccl.so" ]; then
        echo "setup-cuda: generating link stubs from $cudarc_dir"
        rm -rf "$lib"
        python3 "$repo/scripts/gen_link_stubs.py" "$cudarc_dir" "$lib" >/dev/null || {
            echo "setup-cuda: stub generation failed" >&2; return 1; }
        echo "$cudarc_dir" > "$lib/stubs.stamp"
    fi
    # candle-kernels links -lcudart: the real one from the runtime wheel (libcudart.so.13 on the GPU machine too).
    ln -sfn "$root/lib/libcudart.so.13" "$lib/libcudart.so"
    # cudarc's build script searches $CUDA_HOME/lib (and CUDA_PATH, CUDA_ROOT) for the -l libraries.
    export CUDA_HOME="$repo/.cuda"
    echo "setup-cuda: nvcc $("$root/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUDA_HOME=$CUDA_HOME, compute cap $CUDA_COMPUTE_CAP"
}

_setup_cuda_main
_setup_cuda_rc=$?
unset -f _setup_cuda_main
# shellcheck disable=SC2317
return $_setup_cuda_rc 2>/dev/null || exit $_setup_cuda_rc
