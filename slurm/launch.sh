#!/usr/bin/env bash
# One launcher per node: torchrun starts this node's NPROC_PER_NODE ranks and joins them to the other nodes' ranks
# through a static rendezvous on MASTER_ADDR:MASTER_PORT (node rank 0 hosts it). Arguments are Hydra overrides.
#
# Under Slurm (slurm/train.sbatch runs this with srun, one task per node) every variable comes from the job:
#   MASTER_ADDR  the job's first node (scontrol show hostnames "$SLURM_JOB_NODELIST")
#   MASTER_PORT  20000 + job id mod 20000: the same on every node, different for jobs that share a head node
#   NNODES, NODE_RANK, NPROC_PER_NODE  SLURM_NNODES, SLURM_NODEID, SLURM_GPUS_ON_NODE (1 without GPUs)
# Without Slurm, set them on every node yourself and start one launcher per node:
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 slurm/launch.sh distributed=zero2 …
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 slurm/launch.sh distributed=zero2 …
# MOE_BIN is the bin/ of the environment with moe-train and torchrun (default: where moe-train is on PATH).
set -euo pipefail

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  : "${MASTER_ADDR:=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
  : "${MASTER_PORT:=$((20000 + SLURM_JOB_ID % 20000))}"
  : "${NNODES:=$SLURM_NNODES}"
  : "${NODE_RANK:=$SLURM_NODEID}"
  : "${NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0}"
: "${MASTER_PORT:?set MASTER_PORT to a free port on node rank 0, the same on every node}"
: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to the rank of this node, 0 to NNODES-1}"
: "${NPROC_PER_NODE:=1}"
: "${MOE_BIN:=$(dirname "$(command -v moe-train)")}"

echo "launch: node ${NODE_RANK}/${NNODES} on $(hostname) (${SLURMD_NODENAME:-no slurmd}), ${NPROC_PER_NODE} rank(s)," \
  "rendezvous ${MASTER_ADDR}:${MASTER_PORT}" >&2
exec "$MOE_BIN/torchrun" --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --no-python "$MOE_BIN/moe-train" "$@"
