#!/usr/bin/env bash
# Open MPI: NODES nodes x PER_NODE ranks, the ranks of a node in one block (clairvoyant's local
# ranks are contiguous). Rank and world size come from Open MPI's variables; the nodes meet and
# share the job secret through MPI (pip install mpi4py). HOSTFILE lists the nodes (one line
# each, "host slots=PER_NODE"); without it every rank runs on this machine.
#
#   DATA=/pfs/imagenet NODES=2 PER_NODE=4 HOSTFILE=hosts examples/mpirun_train.sh --epochs 90
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
NODES=${NODES:-1}
PER_NODE=${PER_NODE:-4}
hosts=()
if [ -n "${HOSTFILE:-}" ]; then hosts=(--hostfile "$HOSTFILE"); fi
# As root (containers) Open MPI also needs --allow-run-as-root.
root=()
if [ "$(id -u)" = 0 ]; then root=(--allow-run-as-root --oversubscribe); fi
exec mpirun "${root[@]}" "${hosts[@]}" -np $((NODES * PER_NODE)) --map-by "ppr:${PER_NODE}:node" --bind-to none \
  -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x CLAIRVOYANT_CACHE_DIR \
  "${PYTHON:-python}" "$here/train_imagenet.py" --data "$DATA" "$@"
