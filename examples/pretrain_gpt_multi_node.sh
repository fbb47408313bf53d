#!/usr/bin/env bash
# Several nodes, one site (ordinary synchronous Megatron). Run once per node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 address> bash examples/pretrain_gpt_multi_node.sh <data> <tok.model>
set -euo pipefail

DATA_PATH=${1:?data prefix}
TOKENIZER_MODEL=${2:?sentencepiece model}
shift 2
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:?number of nodes}
NODE_RANK=${NODE_RANK:?this node\'s rank}
MASTER_ADDR=${MASTER_ADDR:?address of node 0}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size "$NNODES"
    --use-distributed-optimizer --overlap-grad-reduce --sequence-parallel
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 100000
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16
)
DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 "$@"
