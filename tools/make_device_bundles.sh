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
# Wheels the image already has (numpy, typing_extensions, fsspec, filelock for torch) are dropped
# so the carried copies never shadow torch's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
drop_image_wheels() { rm -f "$1"/numpy-* "$1"/typing_extensions-* "$1"/fsspec-*; }

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
