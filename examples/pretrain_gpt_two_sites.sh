#!/usr/bin/env bash
# Two sites (e.g. two clusters joined by a WAN), NODES_PER_SITE nodes each. Ranks are
# placed node-major, so with --num-sites 2 the first half of the nodes is site 0 and the
# second half site 1. Run once per node:
#   NODES_PER_SITE=2 SITE=<0|1> LOCAL_NODE=<0..> MASTER_ADDR=<site 0, node 0> \
#       bash examples/pretrain_gpt_two_sites.sh <data> <tok.model> [--lsgd-algorithm ...]
#
# Elastic sites (docs/fault_tolerance.md): with LIGHTHOUSE=http://<host>:<port> (a
# `torchft_lighthouse --min_replicas 1` running where every site's node 0 reaches it) each
# site is a job of its own that survives the other's failures and rejoins after its own:
# MASTER_ADDR is then the site's own node 0, which the other site must reach too. E.g.
#   LIGHTHOUSE=http://lh:29510 SITE=1 LOCAL_NODE=0 MASTER_ADDR=<site 1, node 0> \
#       bash examples/pretrain_gpt_two_sites.sh <data> <tok.model> --lsgd-algorithm diloco
set -euo pipefail

DATA_PATH=${1:?data prefix}
TOKENIZER_MODEL=${2:?sentencepiece model}
shift 2
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODES_PER_SITE=${NODES_PER_SITE:-1}
SITE=${SITE:?0 or 1}
LOCAL_NODE=${LOCAL_NODE:-0}
MASTER_ADDR=${MASTER_ADDR:?address of site 0 node 0}
NNODES=$((2 * NODES_PER_SITE))
NODE_RANK=$((SITE * NODES_PER_SITE + LOCAL_NODE))
ELASTIC=()
if [ -n "${LIGHTHOUSE:-}" ]; then  # one job per site, restarted by torchrun when it fails
    NNODES=$NODES_PER_SITE
    NODE_RANK=$LOCAL_NODE
    ELASTIC=(--lsgd-fault-tolerance torchft --lsgd-lighthouse "$LIGHTHOUSE" --lsgd-site "$SITE"
             --lsgd-ft-host "$MASTER_ADDR")
    RESTARTS=(--max-restarts "${MAX_RESTARTS:-3}")
fi

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-6000}" ${RESTARTS[@]+"${RESTARTS[@]}"} \
    pretrain_gpt.py ${ELASTIC[@]+"${ELASTIC[@]}"} \
    --num-sites 2 --lsgd-algorithm sync \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
    --tensor-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --bf16 \
    --micro-batch-size 4 --global-batch-size 512 --train-iters 20000 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --distributed-timeout-minutes 30 "$@"
