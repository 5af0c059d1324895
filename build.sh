#!/usr/bin/env bash
# Installs deepinfer into .venv with the extras for this machine's accelerator.
#   DEEPINFER_ACCELERATOR=nvidia|ascend|cpu bash build.sh   (default: detect)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
allowed="nvidia ascend cpu"
accel=${DEEPINFER_ACCELERATOR:-}
if [ -z "$accel" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then accel=nvidia
  elif command -v npu-smi >/dev/null 2>&1; then accel=ascend
  else accel=cpu; fi
  echo "build.sh: DEEPINFER_ACCELERATOR not set; detected '$accel'"
fi
case "$accel" in
  nvidia) extras=(--extra nvidia) ;;
  ascend) extras=(--extra ascend) ;;
  cpu) extras=() ;;
  *) echo "build.sh: DEEPINFER_ACCELERATOR='$accel' is not one of: $allowed" >&2; exit 2 ;;
esac
if ! command -v uv >/dev/null 2>&1; then
  echo "build.sh: uv not found; installing it with pip"
  python3 -m pip install --quiet uv
fi
uv sync "${extras[@]}"
echo "build.sh: installed for '$accel' into .venv"
