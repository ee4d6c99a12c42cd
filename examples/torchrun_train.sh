#!/usr/bin/env bash
# torchrun over NODES nodes x PER_NODE processes: run this on every node with the same HEAD (a
# host name or address of the first node, which hosts the rendezvous) and JOB_ID.
#
#   DATA=/pfs/imagenet NODES=2 PER_NODE=8 HEAD=node001 JOB_ID=imagenet-1 examples/torchrun_train.sh --epochs 90
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "${NODES:-1}" --nproc-per-node "${PER_NODE:-4}" \
  --rdzv-backend c10d --rdzv-endpoint "${HEAD:-127.0.0.1}:${PORT:-29500}" --rdzv-id "${JOB_ID:-clairvoyant-example}" \
  "$here/train_imagenet.py" --data "$DATA" "$@"
