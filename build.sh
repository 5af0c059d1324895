#!/usr/bin/env bash
# Installs deepinfer into .venv with the extras for this machine's accelerator.
#   DEEPINFER_ACCELERATOR=nvidia|cpu bash build.sh   (default: detect; ascend: not available yet)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
allowed="nvidia ascend cpu"
accel=${DEEPINFER_ACCELERATOR:-}
npu_missing="the engine's NPU path is not available yet (no torch_npu support)"
if [ -z "$accel" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then accel=nvidia
  elif command -v npu-smi >/dev/null 2>&1; then
    echo "build.sh: detected an Ascend NPU, but $npu_missing: installing the CPU build" >&2
    accel=cpu
  else accel=cpu; fi
  echo "build.sh: DEEPINFER_ACCELERATOR not set; using '$accel'"
fi
case "$accel" in
  nvidia) extras=(--extra nvidia) ;;
  ascend)
    echo "build.sh: DEEPINFER_ACCELERATOR=ascend: $npu_missing; use nvidia or cpu" >&2
    exit 2 ;;
  cpu) extras=() ;;
  *) echo "build.sh: DEEPINFER_ACCELERATOR='$accel' is not one of: $allowed" >&2; exit 2 ;;
esac
if ! command -v uv >/dev/null 2>&1; then
  echo "build.sh: uv not found; installing it with pip"
  python3 -m pip install --quiet uv
fi
uv sync "${extras[@]}"
echo "build.sh: installed for '$accel' into .venv"
