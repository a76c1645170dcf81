#!/usr/bin/env bash
# Provision vLLM's real EPLB code for the vLLM adapter's tests (tests/engines/vllm), in a
# folder of its own: vLLM pins CUDA torch 2.14.0 (a plain `pip install vllm` pulls 9 GB),
# so nothing goes into the venv. The vLLM wheel and the light pure-Python packages its
# EPLB, config and plugin modules import are installed with --no-deps (pinned) into
#   .ci/tools/vllm-site   (or $1)
# and vLLM's compiled extensions (*.so, CUDA kernels) are deleted: the EPLB code is
# Python over torch.distributed, and the tests run it on CPU with gloo under the venv's
# torch (VLLM_TARGET_DEVICE=cpu). The wheel (336 MB) is cached in .ci/tools/vllm-wheel.
#
#   scripts/vllm_env.sh            provision (skips when already there); exits non-zero
#                                  when anything is missing afterwards
set -euo pipefail
cd "$(dirname "$0")/.."
site="${1:-$PWD/.ci/tools/vllm-site}"
wheels="$PWD/.ci/tools/vllm-wheel"
# The tested version: the one pyproject.toml's `vllm` extra pins, the only place it is set.
VLLM_VERSION=$(sed -n 's/^vllm = \["vllm==\([^"]*\)"\]$/\1/p' pyproject.toml)
[ -n "$VLLM_VERSION" ] || { echo "vllm_env: pyproject.toml has no vllm extra pinned as vllm==VERSION" >&2; exit 1; }
PACKAGES=(
  psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 cbor2==6.3.0 aiohttp==3.14.5 multidict==7.2.1
  yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
  requests==2.34.2 certifi==2026.10.19.post1 openai-harmony==0.0.8 openai==3.57.0
  sniffio==1.3.1 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3
  uvloop==0.23.0 py-cpuinfo==9.0.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.0
  starlette==1.10.0 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6
  einops==0.8.2  # the V2 model runner's eplb_utils imports vLLM's model layers, which need it
)
stamp="$site/.provisioned-$VLLM_VERSION"
# A folder provisioned with another package list gets the missing packages (and the
# check below) again: the list's digest names a stamp of its own.
packages_stamp="$site/.packages-$(printf '%s\n' "${PACKAGES[@]}" | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ -f "$packages_stamp" ]; then exit 0; fi
rm -f "$stamp"
python="${PYTHON:-$PWD/.venv/bin/python}"
[ -x "$python" ] || python=python3  # pip only: any Python 3.11 installs the same files
installed="$site/.installed-$VLLM_VERSION"
if [ ! -f "$installed" ]; then
  mkdir -p "$wheels"
  wheel=$(ls "$wheels"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    "$python" -m pip download -q --no-deps --dest "$wheels" "vllm==$VLLM_VERSION"
    wheel=$(ls "$wheels"/vllm-"$VLLM_VERSION"-*.whl | head -n1)
  fi
  rm -rf "$site" && mkdir -p "$site"
  "$python" -m pip install -q --no-deps --no-compile --target "$site" "$wheel"
  find "$site/vllm" -name '*.so' -delete
  "$python" -m pip install -q --no-deps --no-compile --target "$site" "${PACKAGES[@]}"
  touch "$installed"
  rm -f "$site"/.packages-* && touch "$packages_stamp"
fi
if [ ! -f "$packages_stamp" ]; then
  "$python" -m pip install -q --no-deps --no-compile --upgrade --target "$site" "${PACKAGES[@]}"
  rm -f "$site"/.packages-* && touch "$packages_stamp"
fi
# The check the tests rely on: vLLM's EPLB, its config and its plugin loader import. It
# needs torch: on a fresh machine `.ci/run` provides the tools before `./dev test` builds
# the venv, so the check (and the stamp the tests look for) waits for the next call,
# which `./dev test` makes once the venv exists.
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  echo "vllm_env: installed; the import check runs once $python has torch (./dev test)" >&2
  exit 0
fi
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$site" "$python" -c \
  "import vllm.distributed.eplb.eplb_state, vllm.distributed.eplb.async_worker, vllm.plugins, vllm.v1.worker.gpu.eplb_utils" \
  || { echo "vllm_env: vLLM's EPLB code does not import from $site" >&2; exit 1; }
touch "$stamp"
