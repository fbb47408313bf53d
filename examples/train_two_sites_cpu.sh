#!/usr/bin/env bash
# Quick start: a small Llama-style GPT (about 6M parameters) trained on the bundled Python
# documentation corpus, data parallel across two sites (one rank each) on CPU, with the
# low-communication algorithm dilocox: the sites train alone for H = 50 steps, then
# exchange an int4-compressed outer gradient that is applied 5 steps into the next round
# while they keep computing. The run ends with a line comparing the bytes that crossed
# sites with what per-step synchronization (--lsgd-algorithm sync) would have sent.
# Any flag given to this script is passed on to pretrain_gpt.py (later flags win).
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=data/python-docs
RANKS_PER_SITE=${RANKS_PER_SITE:-1}
NUM_SITES=${NUM_SITES:-2}

MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --seq-length 128
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
)
TRAINING_ARGS=(
    --micro-batch-size 8 --global-batch-size 16 --train-iters 200
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
)
DATA_ARGS=(
    --data-path "$DATA/python_docs_text_document" --split 949,50,1
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/python_docs_sp8k.model"
)
SITE_ARGS=(
    --num-sites "$NUM_SITES" --use-distributed-optimizer
    --lsgd-algorithm dilocox --lsgd-interval 50 --lsgd-compression int4 --lsgd-dilocox-apply-step 5
    --lsgd-outer-lr 1.0 --lsgd-outer-momentum 0.0
)
LOGGING_ARGS=(--log-interval 10 --eval-interval 100 --eval-iters 5 --tensorboard-dir runs/two_sites_cpu)

# Said at once: loading torch in every process takes several seconds before the run's own first line.
echo "starting $NUM_SITES sites x $RANKS_PER_SITE rank(s), dilocox, 200 steps on $DATA (CPU): a line every 10 steps"

OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
    --nproc-per-node $((RANKS_PER_SITE * NUM_SITES)) pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${SITE_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
