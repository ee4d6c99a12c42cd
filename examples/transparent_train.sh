#!/usr/bin/env bash
# Transparent mode: the script keeps torch's own DataLoader (--loader torch); `clairvoyant run`
# caches the files it opens under DATA on this node, with no change to the program. Under a
# launcher, put it after the launcher: `srun clairvoyant run ...`, or
# `torchrun --no-python ... clairvoyant run ...` (one agent per node either way).
#
#   DATA=/pfs/imagenet examples/transparent_train.sh --epochs 90
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "${CLAIRVOYANT:-clairvoyant}" run --dataset "$DATA/train" -- \
  "${PYTHON:-python}" "$here/train_imagenet.py" --loader torch --data "$DATA" "$@"
