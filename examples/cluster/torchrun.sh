#!/bin/bash
# SmolLM-360M with 2BW on 2 nodes x 4 GPUs under torchrun: run this on every node, with HEAD the first node's
# address (NODE_RANK is not needed: the c10d rendezvous assigns it). torchrun restarts all processes up to 3
# times when one dies; `--ckpt_path last` resumes from checkpoints/last.ckpt (the first time there is none and the
# run starts from scratch). Lightning's TorchElasticEnvironment reads the ranks torchrun sets.
set -euo pipefail
HEAD=${HEAD:?set HEAD to the first node's address}
torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id smollm-2bw \
    --max-restarts 3 -m lightning_async_pp.cli \
    fit --config examples/cluster/smollm_360m_2bw.yaml --trainer.num_nodes 2 --trainer.devices 4 --ckpt_path last
