#!/usr/bin/env bash
# Provision SGLang's real code for the SGLang adapter's tests (tests/engines/sglang) and
# bench/sglang_offline.py, in a folder of its own: SGLang pins torch 2.14.1 and the
# project's venv has torch 2.13.0 CPU, so nothing goes into the venv. The SGLang wheel and
# the light packages its EPLB code imports are installed with --no-deps (pinned) into
#   .ci/tools/sglang-site   (or $1)
# Not installed: triton (1 GB; GPU kernels) and torchvision (PyPI's wheels need CUDA
# torch): the tests and benches put stubs of both on their path (bench/cpu_shims).
#
#   scripts/sglang_env.sh            provision (skips when already there)
set -euo pipefail
cd "$(dirname "$0")/.."
site="${1:-$PWD/.ci/tools/sglang-site}"
# The tested version: the one pyproject.toml's `sglang` extra pins, the only place it is set.
SGLANG_VERSION=$(sed -n 's/^sglang = \["sglang==\([^"]*\)"\]$/\1/p' pyproject.toml)
[ -n "$SGLANG_VERSION" ] || { echo "sglang_env: pyproject.toml has no sglang extra pinned as sglang==VERSION" >&2; exit 1; }
PACKAGES=(
  "sglang==$SGLANG_VERSION" orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2
  urllib3==2.8.0 certifi==2026.10.19.post1 starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0
  ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 einops==0.8.2
  dill==0.4.1 sentencepiece==0.2.3 apache-tvm-ffi==0.1.11 compressed-tensors==0.20.1
  loguru==0.7.3 gguf==0.19.0
)
stamp="$site/.provisioned-$SGLANG_VERSION"
if [ -f "$stamp" ]; then exit 0; fi
python="${PYTHON:-$PWD/.venv/bin/python}"
[ -x "$python" ] || python=python3  # pip only: any Python 3.11 installs the same files
rm -rf "$site" && mkdir -p "$site"
"$python" -m pip install -q --no-deps --no-compile --target "$site" "${PACKAGES[@]}"
touch "$stamp"
