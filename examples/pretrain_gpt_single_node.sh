#!/usr/bin/env bash
# One node, GPUS_PER_NODE ranks: TP x PP x DP inside the node, one site.
# Usage: bash examples/pretrain_gpt_single_node.sh <data-prefix> <tokenizer.model> [extra flags...]
set -euo pipefail

DATA_PATH=${1:?data prefix (…_text_document)}
TOKENIZER_MODEL=${2:?sentencepiece model}
shift 2
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

DISTRIBUTED_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes 1 --master-addr localhost --master-port 6000)

MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --group-query-attention --num-query-groups 4
    --seq-length 2048 --max-position-embeddings 2048
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --sequence-parallel
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 256 --train-iters 20000
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 949,50,1
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
LOGGING_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir runs/single_node)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
