#!/usr/bin/env bash
# Quick start: a small Llama-style GPT (about 6M parameters) trained on the bundled Python
# documentation corpus, data parallel across two sites (one rank each) on CPU, with the
# low-communication algorithm dilocox: the sites train alone for H = 50 steps, then
# exchange an int4-compressed outer gradient that is applied 5 steps into the next round
# while they keep computing. The run ends with a line comparing the bytes that crossed
# sites with what per-step synchronization (--lsgd-algorithm sync) would have sent.
# Any flag given to this script is passed on to pretrain_gpt.py (later flags win).
#
# Elastic sites (docs/fault_tolerance.md): ELASTIC=1 runs each site as a torchrun job of
# its own (restarted up to 3 times when it fails) beside a torchft lighthouse: kill one
# site's process and watch the other go on, and the killed one rejoin (each site logs the
# job's lines).  ELASTIC=1 bash examples/train_two_sites_cpu.sh
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
# The algorithm and length as the run will have them: a flag given to this script wins.
ALGORITHM=${SITE_ARGS[4]} STEPS=200 ARGS=("$@")
for ((i = 0; i < ${#ARGS[@]}; i++)); do
    case ${ARGS[i]} in
        --lsgd-algorithm) ALGORITHM=${ARGS[i + 1]:-$ALGORITHM} ;;
        --lsgd-algorithm=*) ALGORITHM=${ARGS[i]#*=} ;;
        --train-iters) STEPS=${ARGS[i + 1]:-$STEPS} ;;
        --train-iters=*) STEPS=${ARGS[i]#*=} ;;
    esac
done
echo "starting $NUM_SITES sites x $RANKS_PER_SITE rank(s), ${ELASTIC:+elastic }$ALGORITHM, $STEPS steps on $DATA (CPU):" \
     "a line every 10 steps"

if [ -z "${ELASTIC:-}" ]; then
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
        --nproc-per-node $((RANKS_PER_SITE * NUM_SITES)) pretrain_gpt.py \
        "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${SITE_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
    exit
fi

# Elastic: a lighthouse, then one job per site; a site's failure does not stop the others.
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
torchft_lighthouse --min_replicas 1 --bind "[::]:$LIGHTHOUSE_PORT" --join_timeout_ms 10000 &
LIGHTHOUSE_PID=$!
SITE_PIDS=()
trap 'kill "${SITE_PIDS[@]}" "$LIGHTHOUSE_PID" 2>/dev/null || true' EXIT
for ((site = 0; site < NUM_SITES; site++)); do
    OMP_NUM_THREADS=1 python -m torch.distributed.run --nnodes 1 --nproc-per-node "$RANKS_PER_SITE" \
        --master-addr 127.0.0.1 --master-port $((29600 + site)) --max-restarts 3 pretrain_gpt.py \
        "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${SITE_ARGS[@]}" "${LOGGING_ARGS[@]}" \
        --lsgd-fault-tolerance torchft --lsgd-lighthouse "http://127.0.0.1:$LIGHTHOUSE_PORT" --lsgd-site "$site" \
        "$@" &
    SITE_PIDS+=($!)
done
status=0
for pid in "${SITE_PIDS[@]}"; do wait "$pid" || status=$?; done
exit $status
