#!/usr/bin/env bash
# GPU check of dckpt-collective's NCCL backend: runs its conformance tests on NCCL.
#
# Two halves, because the GPU machine (x86-64, CUDA 13 driver, PyTorch installed) has no Rust:
#
#   1. Here, on a machine with Rust (same architecture), build the test binary into the
#      git-ignored device-bin/ folder:
#
#        scripts/gpu-check.sh --build
#
#      which runs `cargo test -p dckpt-collective --features nccl --no-run --release` and
#      copies its integration-test binary (the conformance suite among its modules) to
#      device-bin/collective-conformance.
#
#   2. On the GPU machine, from the repository root (device-bin/ travels with the tree):
#
#        scripts/gpu-check.sh
#
#      It finds libnccl.so.2 in Python's site-packages (the nvidia-nccl wheel that PyTorch
#      depends on), symlinks it as libnccl.so (the name cudarc loads) in a temporary folder,
#      puts that on LD_LIBRARY_PATH and runs the NCCL tests: every call on a world of one
#      rank on GPU 0, and on two processes with one GPU each when there are 2 GPUs or more.
#
# Exit status: 0 when the tests pass; the tests' status otherwise; 2 when something needed
# (the binary, libnccl.so.2, a GPU) is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=device-bin/collective-conformance

if [[ "${1:-}" == "--build" ]]; then
    mkdir -p device-bin
    exe=$(cargo test -p dckpt-collective --features nccl --no-run --release --message-format=json \
        | grep -o '"executable":"[^"]*/it-[^"]*"' | tail -n 1 | sed 's/"executable":"\(.*\)"/\1/')
    [[ -n "$exe" && -x "$exe" ]] || { echo "gpu-check: could not find the built conformance binary" >&2; exit 2; }
    cp "$exe" "$BIN"
    echo "gpu-check: built $BIN from $exe"
    exit 0
fi

[[ -x "$BIN" ]] || { echo "gpu-check: $BIN missing; run 'scripts/gpu-check.sh --build' on a machine with Rust" >&2; exit 2; }

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "gpu-check: ${ngpu} GPU(s)"
nvidia-smi -L 2>/dev/null || true
(( ngpu >= 1 )) || { echo "gpu-check: no GPU visible" >&2; exit 2; }

# The nvidia-nccl wheel is a namespace package: nvidia/nccl/lib/libnccl.so.2.
nccl_so=$(python3 - <<'PY' 2>/dev/null || true
import os
try:
    import nvidia.nccl
    for p in nvidia.nccl.__path__:
        f = os.path.join(p, "lib", "libnccl.so.2")
        if os.path.exists(f):
            print(f)
            break
except ImportError:
    pass
PY
)
if [[ -z "$nccl_so" ]]; then
    for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
        nccl_so=$(find "$d" -name 'libnccl.so.2' 2>/dev/null | head -n 1)
        [[ -n "$nccl_so" ]] && break
    done
fi
[[ -n "$nccl_so" ]] || { echo "gpu-check: libnccl.so.2 not found in Python's site-packages" >&2; exit 2; }
echo "gpu-check: NCCL from $nccl_so"

libdir=$(mktemp -d)
trap 'rm -rf "$libdir"' EXIT
ln -s "$nccl_so" "$libdir/libnccl.so"
export LD_LIBRARY_PATH="$libdir:$(dirname "$nccl_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

world=1
(( ngpu >= 2 )) && world=2
export DCKPT_NCCL_TEST_WORLD=$world
echo "gpu-check: NCCL conformance at world size 1$( (( world >= 2 )) && echo ' and 2')"

# Only the NCCL tests: the thread and TCP ones run in CI already.
status=0
timeout 300 "$BIN" --test-threads=1 --nocapture conformance::nccl:: || status=$?
echo "gpu-check: exit status $status"
exit $status
