#!/usr/bin/env bash
# Rebuild the git-ignored folders the device scripts carry to the H200 (its image has torch,
# Triton, nvcc, ninja and jinja2, but none of these), from a machine with network access to PyPI:
#   .whl      nvidia-cutlass (our kernels' headers), filelock, optuna and its wheels      (~13 MB)
#   .whl-bench .whl without optuna's storage wheels (sqlalchemy, alembic), for the calls
#             that carry .anchors too: the benchmarks and GPU tests never tune      (~8 MB)
#   .whl-hf   transformers and its wheels, for the model prefill and calibration runs      (~28 MB)
#   .anchors  FLA + FlashQLA (../shared/tools/anchor-bundle.sh)                           (~45 MB)
#   .fla      FLA alone, cut from the anchor bundle (the dispatch target)                  (~0.6 MB)
# A device call carries at most 64 MiB with the checkout (~9 MB): [.whl-bench, .anchors] or
# [.whl, .whl-hf, .fla].
#   bash tools/make_device_bundles.sh flashinfer   builds only the FlashInfer peer's bundle instead:
#   .whl-fi-a, .whl-fi-b   one site tree (flashinfer-python 0.7.2.post1 with its GDN prefill's
#             runtime imports, cuDNN frontend 1.32 for the cuDNN probe) installed here for the
#             device's Python 3.12, trimmed, xz-compressed and cut in parts of at most 50 MiB, one
#             part a call (benchmarks/h200_steps.sh flashinfer-stage, then flashinfer-rows).
#             benchmarks/README.md lists the packages and their sizes.
# Wheels the image already has (numpy, typing_extensions, fsspec, filelock for torch) are dropped
# so the carried copies never shadow torch's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
drop_image_wheels() { rm -f "$1"/numpy-* "$1"/typing_extensions-* "$1"/fsspec-*; }

if [ "${1:-}" = flashinfer ]; then
  # What flashinfer.gdn_prefill and its SM90 CuTe-DSL kernels import (the import chain, checked
  # module by module): FlashInfer, the CuTe DSL (its Python, MLIR bindings and CUDA 13 runtime
  # libraries), tvm-ffi (the DSL's call path), cuda-bindings (+ pathfinder, which loads the CUDA
  # libraries), pynvml (flashinfer.utils). cuDNN frontend and cuda-tile are for the cuDNN probe.
  # Not carried (the path imports none of them): cuda-python (a meta package), cuda-core, einops,
  # click, tabulate, nccl4py, nccl-extensions, protobuf, nvidia-cutlass-dsl-libs-cu12.
  # tvm-ffi at the version the anchor bundle carries: one process imports FlashQLA's TileLang
  # (apache-tvm-ffi >= 0.1.11, < 0.1.13) and FlashInfer (>= 0.1.11, < 0.2), and one copy serves both.
  FI_PKGS=(flashinfer-python==0.7.2.post1 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
           nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.12
           cuda-bindings==13.4.4 cuda-pathfinder==1.9.1 nvidia-ml-py==13.615.71
           nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0)
  build=.fi-build letters=(a b c d)
  for f in "/$build/" /.whl-fi-{a,b,c,d}/; do grep -qxF "$f" .git/info/exclude || echo "$f" >> .git/info/exclude; done
  rm -rf "$build" .whl-fi-* && mkdir -p "$build/wheels"
  pip download -q "${PLAT[@]}" --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --no-deps \
    -d "$build/wheels" "${FI_PKGS[@]}"
  # One pip run: the DSL's wheels share the nvidia_cutlass_dsl folder, which a second --target
  # run would replace rather than merge.
  pip install -q "${PLAT[@]}" --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --no-index \
    --no-deps --no-compile --target "$build/site" "$build"/wheels/*.whl
  # Trimmed: FlashInfer's JIT sources and headers (data/: csrc, CUTLASS, CCCL, spdlog; the CuTe-DSL
  # GDN path compiles none of them), console scripts written for this machine's Python, the DSL's
  # aarch64/QNX stubs. Everything the import chain reads stays.
  rm -rf "$build/site/flashinfer/data" "$build/site/bin" "$build/site/nvidia_cutlass_dsl/cu13/lib/stubs"
  find "$build/site" -name __pycache__ -prune -exec rm -rf {} +
  (cd "$build/wheels" && ls -l --block-size=K *.whl | awk '{print $5, $9}') > "$build/packages.txt"
  (cd "$build/site" && du -s --block-size=K -- */ | sort -rn) > "$build/site-folders.txt"
  tar -C "$build/site" -cf - . | xz -T2 -6 > "$build/fi-site.tar.xz"
  (cd "$build" && sha256sum fi-site.tar.xz > fi-site.sha256 && split -b 50M -d -a 1 fi-site.tar.xz fi-site.tar.xz.part &&
   ls fi-site.tar.xz.part* | wc -l > fi-site.parts)
  for part in "$build"/fi-site.tar.xz.part*; do
    i=${part##*part}
    dir=.whl-fi-${letters[$i]}
    mkdir -p "$dir" && mv "$part" "$dir/" && cp "$build"/fi-site.{sha256,parts} "$build/packages.txt" "$dir/"
  done
  cat "$build/packages.txt"
  du -sh .whl-fi-*
  exit 0
fi

rm -rf .whl .whl-hf .whl-bench  # a stale wheel beside a new one (two huggingface_hub) breaks the install
mkdir -p .whl .whl-hf .whl-bench
# nvidia-cutlass only for its headers: without its Python dependencies (cuda-python, scipy, ...)
pip download -q "${PLAT[@]}" --no-deps -d .whl nvidia-cutlass==4.2.0.0 filelock
pip download -q "${PLAT[@]}" -d .whl optuna
drop_image_wheels .whl
pip download -q "${PLAT[@]}" -d .whl-hf "transformers==$(python3 -c 'import transformers; print(transformers.__version__)')"
drop_image_wheels .whl-hf
for w in .whl/*.whl; do rm -f ".whl-hf/$(basename "$w")"; done  # carried in .whl already
cp .whl/*.whl .whl-bench/ && rm -f .whl-bench/sqlalchemy-* .whl-bench/alembic-*

if [ ! -f .anchors/anchors.tar.xz ]; then bash ../shared/tools/anchor-bundle.sh .anchors; fi
tmp=$(mktemp -d) && tar -C "$tmp" -xJf .anchors/anchors.tar.xz
mkdir -p .fla && tar -C "$tmp" -cJf .fla/fla.tar.xz fla $(cd "$tmp" && ls -d fla_core-*.dist-info flash_linear_attention-*.dist-info)
rm -rf "$tmp"
for f in /.whl/ /.whl-bench/ /.whl-hf/ /.anchors/ /.fla/; do grep -qxF "$f" .git/info/exclude || echo "$f" >> .git/info/exclude; done
du -sh .whl .whl-bench .whl-hf .anchors .fla
