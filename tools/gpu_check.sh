#!/usr/bin/env bash
# One command on a machine with one or more NVIDIA GPUs:
#   1. the CUDA-marked tests (pytest -m cuda),
#   2. tools/benchmarks/step/mfu.py: a ~1.1B Llama in bf16, tokens/s and MFU beside a plain
#      PyTorch loop of the same model (one GPU), eager and with --compile (each transformer
#      layer compiled, in both loops alike), with compile time and peak memory; then the
#      largest micro-batch that steps, eager and compiled (1, 2, 4, ... $MBS_LIMIT, a fresh
#      process each), and whether the 8B shape (Llama-3-8B, seq 8192) starts and steps with
#      full recomputation on the card (MEMORY=0 skips these memory probes),
#   3. every synchronizer for 8 steps as 2 sites x 1 rank on one GPU, gloo between the
#      sites (--device cuda --distributed-backend gloo --inter-site-backend gloo), the ten
#      runs at once, eager and then with --compile (about 2 minutes for the whole script on an
#      H100 before --compile and the memory probes were added; their cost is not yet measured),
#   4. on 2+ GPUs: acco and dpu with NCCL inside the sites (a hang = the deadlock their
#      worker's gloo groups rule out),
#   5. a checkpoint saved on the GPU resumed on the GPU and on the CPU,
#   6. where torchft is importable: elastic sites on the GPU, one killed and rejoining; on 2+ GPUs
#      also NCCL between the sites with the outer state on the host (--lsgd-outer-offload),
#   7. what the device-synchronised clock costs a step (tools/benchmarks/step/clock_cost.py),
# then prints a table and writes docs/performance.md's GPU section (between its markers).
#
#   tools/gpu_check.sh                 # everything
#   MFU_PRESET=smoke tools/gpu_check.sh  # a quick pass (tiny model instead of ~1B; the 8B probe still runs)
#   MEMORY=0 tools/gpu_check.sh        # without the memory probes (micro-batch search, 8B shape)
#   MBS_LIMIT=16 tools/gpu_check.sh    # the micro-batch search's largest try (default 32)
#   OUT=/tmp/gpu_check tools/gpu_check.sh  # where logs and JSON go (default: a fresh temp dir)
#   PYTHON=python tools/gpu_check.sh       # the interpreter (default: python3)
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
MFU_PRESET=${MFU_PRESET:-1b}
MEMORY=${MEMORY:-1}
MBS_LIMIT=${MBS_LIMIT:-32}
PY=${PYTHON:-python3}  # GPU images often have python3 alone
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: tools/gpu_check.sh needs an NVIDIA GPU (nvidia-smi and torch.cuda.is_available())" >&2
    exit 2
fi
DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
DATE=$(date -u +%Y-%m-%d)
echo "gpu_check: $DEVICE, torch $("$PY" -c 'import torch; print(torch.__version__)'), logs in $OUT"
# The compiled extension (`pip install -e .` builds it; a bare checkout has none): step 6's real data needs it.
"$PY" setup.py build_ext --inplace >"$OUT/build_ext.log" 2>&1 ||
    echo "gpu_check: building megatron_lsgd._C failed ($OUT/build_ext.log); step 6 (real data) will fail" >&2

# 1. CUDA-marked tests
timeout 300 "$PY" -m pytest -q -m cuda tests >"$OUT/cuda_tests.log" 2>&1
TESTS_RC=$?
TESTS_LINE=$(tail -n 1 "$OUT/cuda_tests.log")

# 2. throughput and MFU, eager and compiled (both loops alike), then the memory probes
mfu() {  # name, flags...: one mfu.py run, its JSON in $OUT/mfu_<name>.json; the exit status
    local name=$1; shift
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 600 "$PY" tools/benchmarks/step/mfu.py "$@" \
        --json "$OUT/mfu_$name.json" >"$OUT/mfu_$name.log" 2>&1
}
mfu eager --preset "$MFU_PRESET"; MFU_RC=$?
mfu compiled --preset "$MFU_PRESET" --compile; MFU_COMPILED_RC=$?
if [ "$MEMORY" != 0 ]; then
    # their JSON is the answer ("does not fit" is fits: false), read by gpu_report.py; a missing one is a FAILED line
    mfu mbs_eager --preset "$MFU_PRESET" --largest-micro-batch "$MBS_LIMIT"
    mfu mbs_compiled --preset "$MFU_PRESET" --largest-micro-batch "$MBS_LIMIT" --compile
    mfu 8b_full --preset 8b --recompute full --no-plain
fi

# 3. every algorithm, 2 sites x 1 rank on one GPU, gloo between the sites
ALGOS="sync diloco dilocox streaming-diloco cocodc edit a-edit acco dpu dreamddp"
COMMON=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2
        --global-batch-size 8 --train-iters 8 --lr 1e-3 --mock-data --vocab-size 512 --log-interval 1
        --eval-iters 0 --num-sites 2 --bf16 --device cuda --distributed-backend gloo --inter-site-backend gloo)
declare -A PIDS
declare -A EXTRA=(
    [diloco]="--lsgd-interval 2" [dilocox]="--lsgd-interval 2 --lsgd-compression int8"
    [streaming-diloco]="--lsgd-interval 4 --lsgd-fragments 2" [cocodc]="--lsgd-interval 4 --lsgd-fragments 2"
    [edit]="--lsgd-interval 2" [a-edit]="" [acco]="" [dpu]="" [dreamddp]="--lsgd-interval 2"
)
# The runs are independent and tiny, so they share the GPU at once: one launch of 2 ranks per
# algorithm, each on its own port, one CPU thread per rank (the check is correctness, not speed).
# Eager first, then the same ten runs with --compile (their rows say how many graph breaks and
# recompilations the step after warm-up had: 0 is the mark).
ALGO_ROWS=""
for mode in eager compiled; do
    flag=$([ $mode = compiled ] && echo --compile || true)
    i=0
    for algo in $ALGOS; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} OMP_NUM_THREADS=1 timeout 600 "$PY" -m torch.distributed.run \
            --nproc-per-node 2 --master-port $((29500 + 10 * i)) pretrain_gpt.py "${COMMON[@]}" --lsgd-algorithm "$algo" \
            ${EXTRA[$algo]:-} $flag >"$OUT/algo_${algo}_$mode.log" 2>&1 &
        PIDS[$algo]=$!
        i=$((i + 1))
    done
    for algo in $ALGOS; do
        log="$OUT/algo_${algo}_$mode.log"
        wait "${PIDS[$algo]}"
        rc=$?
        loss=$(grep -o "lm loss: [0-9.E+-]*" "$log" | tail -n 1 | cut -d' ' -f3)
        mem=$(grep -o "peak CUDA memory (MB): [0-9]* allocated" "$log" | tail -n 1 | grep -o "[0-9]*" | head -n 1)
        counts=$(grep -o "the step after it: [0-9]* graph break(s), [0-9]* recompilation(s)" "$log" | head -n 1 \
                 | sed 's/the step after it: //')
        status=$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc, $log)")
        ALGO_ROWS+="| $algo | $mode | $status | ${loss:--} | ${mem:--} | ${counts:--} |"$'\n'
    done
done

# 4. acco and dpu with NCCL inside the sites (2+ GPUs, one rank per GPU; 4+ GPUs: TP 2 per site,
#    so the compute thread's NCCL all-reduces run while the worker thread communicates). The
#    worker's groups are gloo, so only the compute thread launches NCCL kernels: a hang here
#    (exit 124) is the cross-communicator deadlock that rules out (docs/algorithms/acco.md).
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
NCCL_ROWS=""
if [ "$NGPU" -ge 2 ]; then
    if [ "$NGPU" -ge 4 ]; then WORLD=4; LAYOUT=(--tensor-model-parallel-size 2); else WORLD=2; LAYOUT=(); fi
    for algo in acco dpu; do
        log="$OUT/nccl_$algo.log"
        timeout 300 "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
            --master-port $((30500 + RANDOM % 1000)) pretrain_gpt.py --num-layers 2 --hidden-size 256 \
            --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 16 --train-iters 30 \
            --lr 1e-3 --mock-data --vocab-size 512 --log-interval 5 --eval-iters 0 --num-sites 2 --bf16 \
            --device cuda --distributed-backend nccl "${LAYOUT[@]}" --lsgd-algorithm "$algo" >"$log" 2>&1
        rc=$?
        loss=$(grep -o "lm loss: [0-9.E+-]*" "$log" | tail -n 1 | cut -d' ' -f3)
        status=$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc, $log)")
        NCCL_ROWS+="| $algo | $WORLD GPUs${LAYOUT[*]:+, TP 2} | $status | ${loss:--} |"$'\n'
    done
fi

# 5. checkpoints on the GPU: diloco (model, fused AdamW, outer state) saved at step 4 and
#    resumed to 8 on the GPU, and on the CPU; each beside the uninterrupted GPU run's last loss
#    (GPU kernels need not be bit-reproducible, so the table gives the difference).
CKPT=(--lsgd-algorithm diloco --lsgd-interval 2)
ckpt_run() {  # name, port, extra flags...
    local name=$1 port=$2; shift 2
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 300 "$PY" -m torch.distributed.run --nproc-per-node 2 \
        --master-port "$port" pretrain_gpt.py "${COMMON[@]}" "${CKPT[@]}" "$@" >"$OUT/ckpt_$name.log" 2>&1
}
last_loss() { grep -o "lm loss: [0-9.E+-]*" "$1" | tail -n 1 | cut -d' ' -f3; }
rm -rf "$OUT/ckpt"
ckpt_run whole 29650 & WHOLE_PID=$!
ckpt_run save 29660 --save "$OUT/ckpt" --save-interval 4 --exit-interval 4
SAVE_RC=$?
CKPT_ROWS=""
wait $WHOLE_PID
WHOLE=$(last_loss "$OUT/ckpt_whole.log")
for where in gpu cpu; do
    log="$OUT/ckpt_resume_$where.log"
    if [ $SAVE_RC -ne 0 ]; then rc=$SAVE_RC; log="$OUT/ckpt_save.log"
    elif [ $where = gpu ]; then ckpt_run resume_gpu 29670 --load "$OUT/ckpt"; rc=$?
    else ckpt_run resume_cpu 29680 --load "$OUT/ckpt" --device cpu; rc=$?; fi
    loss=$(last_loss "$log")
    diff=$("$PY" -c "import sys; a, b = sys.argv[1:]; print(f'{abs(float(a) - float(b)) / float(b):.1e}')" \
        "${loss:-nan}" "${WHOLE:-nan}" 2>/dev/null || echo -)
    loaded=$(grep -c "loaded checkpoint" "$log")
    status=$([ $rc -eq 0 ] && [ "$loaded" -ge 1 ] && echo ok || echo "FAILED (exit $rc, $log)")
    CKPT_ROWS+="| saved on the GPU at step 4, resumed on the ${where^^} | $status | ${loss:--} | ${WHOLE:--} | $diff |"$'\n'
done

# 6. elastic sites on torchft with CUDA tensors (where torchft is importable): the quick
#    start's ELASTIC mode (dilocox) for 300 steps on the GPU, one log for both sites; once a
#    line of step 25 appears, site 1's rank is SIGKILLed, its torchrun restarts it (fresh), it
#    must rejoin with state received from site 0, and both sites must finish. --lsgd-min-sites 2:
#    on a GPU a site's start-up (seconds) outlasts such a run, and with the default floor of one
#    site the first site up trains alone, so the two need never meet (seen on an H100).
#    --inter-site-backend gloo: both sites share GPU 0, and NCCL refuses two ranks of one
#    group on one device (every round failed with "invalid usage" on an H200).
FT_ROW=""
if "$PY" -c "import torchft" 2>/dev/null; then
    FT_LOG="$OUT/ft_sites.log"
    PATH="$(dirname "$(command -v "$PY")"):$PATH" ELASTIC=1 timeout 300 bash examples/train_two_sites_cpu.sh \
        --device ${FT_DEVICE:-cuda} --bf16 --distributed-backend gloo --inter-site-backend gloo --lsgd-interval 10 --train-iters 300 \
        --lsgd-min-sites 2 --lr-warmup-iters 5 --log-interval 1 --eval-interval 1000 --eval-iters 0 \
        --tensorboard-dir "$OUT/ft_tb" >"$FT_LOG" 2>&1 &
    FT_PID=$!
    KILLED=0
    for _ in $(seq 600); do  # up to 5 min
        if [ $KILLED -eq 0 ] && grep -q "iteration *2[5-9]/" "$FT_LOG"; then
            for p in $(pgrep -f -- "--lsgd-site 1"); do  # the rank, not its launcher
                tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q "distributed.run" || kill -9 "$p"
            done
            KILLED=1
        fi
        kill -0 $FT_PID 2>/dev/null || break
        sleep 0.5
    done
    wait $FT_PID
    rc=$?
    rejoined=$(grep -c "site 1 rejoined" "$FT_LOG")
    finished=$(grep -c "done: 300 iterations" "$FT_LOG")
    status=$([ $rc -eq 0 ] && [ $KILLED -eq 1 ] && [ "$rejoined" -ge 1 ] && [ "$finished" -ge 2 ] && echo ok \
             || echo "FAILED (exit $rc, killed $KILLED, rejoined $rejoined, finished $finished, $FT_LOG)")
    FT_ROW="| dilocox H 10, 2 sites x 1 rank, site 1 SIGKILLed at step 25 and restarted fresh | $status |"
    # 6b. NCCL between the sites with the outer state on the host (--lsgd-outer-offload): ElasticComm
    #     stages the host payloads onto the GPU for torchft's NCCL group and back (checked on CPU by
    #     tests/unit_tests/lsgd/test_elastic_comm.py, on one GPU by step 1's test_cuda.py). NCCL
    #     refuses two sites on one GPU, so each site gets a GPU of its own: 2+ GPUs. Both sites must
    #     finish with every round committed.
    NCCL_FT="diloco H 5, 2 sites x 1 rank on GPUs of their own, NCCL between them, --lsgd-outer-offload"
    if [ "$NGPU" -ge 2 ]; then
        VISIBLE=${CUDA_VISIBLE_DEVICES:-}; VISIBLE=(${VISIBLE//,/ })  # site k on the k-th visible GPU
        LH_PORT=$((29520 + RANDOM % 50))
        PATH="$(dirname "$(command -v "$PY")"):$PATH" timeout 330 torchft_lighthouse --min_replicas 2 \
            --bind "[::]:$LH_PORT" --join_timeout_ms 10000 >"$OUT/ft_nccl_lighthouse.log" 2>&1 &
        LH_PID=$!
        SITE_PIDS=()
        for site in 0 1; do
            CUDA_VISIBLE_DEVICES=${VISIBLE[$site]:-$site} timeout 300 "$PY" -m torch.distributed.run --nnodes 1 \
                --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $((29620 + site)) pretrain_gpt.py \
                "${COMMON[@]}" --distributed-backend nccl --inter-site-backend nccl --train-iters 40 \
                --lsgd-algorithm diloco --lsgd-interval 5 --lsgd-outer-offload --lsgd-outer-lr 0.7 \
                --lsgd-outer-momentum 0.9 --lsgd-fault-tolerance torchft --lsgd-min-sites 2 \
                --lsgd-lighthouse "http://127.0.0.1:$LH_PORT" --lsgd-site $site >"$OUT/ft_nccl_site$site.log" 2>&1 &
            SITE_PIDS+=($!)
        done
        rc=0
        for p in "${SITE_PIDS[@]}"; do wait "$p" || rc=$?; done
        kill "$LH_PID" 2>/dev/null
        finished=$(cat "$OUT"/ft_nccl_site[01].log | grep -c "done: 40 iterations")
        lost=$(cat "$OUT"/ft_nccl_site[01].log | grep -c "was not committed")
        status=$([ $rc -eq 0 ] && [ "$finished" -ge 2 ] && [ "$lost" -eq 0 ] && echo ok \
                 || echo "FAILED (exit $rc, finished $finished, rounds not committed $lost, $OUT/ft_nccl_site*.log)")
    else
        status="not run (needs 2 GPUs: NCCL refuses two sites on one)"
    fi
    FT_ROW+=$'\n'"| $NCCL_FT | $status |"
fi

# 7. what the device-synchronised clock costs a step (tools/benchmarks/step/clock_cost.py, a ~125M Llama)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$((31500 + RANDOM % 1000)) timeout 300 "$PY" tools/benchmarks/step/clock_cost.py >"$OUT/clock_cost.log" 2>&1
CLOCK_RC=$?
CLOCK_ROWS=$(grep "^| \(none\|per step\|per layer\) |" "$OUT/clock_cost.log")

# the table, printed and written into docs/performance.md
SECTION=$("$PY" - "$OUT" "$MFU_RC,$MFU_COMPILED_RC,$MEMORY" "$TESTS_RC" "$TESTS_LINE" "$DEVICE" "$DATE" "$ALGO_ROWS" "$NCCL_ROWS" "$CKPT_ROWS" "$FT_ROW" "$CLOCK_RC" "$CLOCK_ROWS" <<'EOF'
import sys
(out, mfu_rcs, tests_rc, tests_line, device, date, algo_rows, nccl_rows, ckpt_rows, ft_row, clock_rc,
 clock_rows) = sys.argv[1:]
mfu_rc, compiled_rc, memory = mfu_rcs.split(",")
from tools.benchmarks.step.gpu_report import throughput_and_memory

lines = [f"Measured {date} on {device} by `tools/gpu_check.sh` (one run; figures are that run's).", ""]
lines.append(f"- CUDA-marked tests: {'passed' if tests_rc == '0' else 'FAILED'} ({tests_line.strip()})")
lines += throughput_and_memory(out, mfu_rc, compiled_rc, memory)
lines += ["", "- Every synchronizer, 2 sites x 1 rank on one GPU, gloo between sites, bf16, 8 steps:", "",
          "| algorithm | layers (eager/compiled) | run | last loss | peak CUDA MB | the step after warm-up (compiled) |", "|---|---|---|---|---|---|",
          algo_rows.rstrip()]
if nccl_rows.strip():
    lines += ["", "- acco and dpu with NCCL inside the sites (the worker thread on gloo groups), 2 sites, 30 steps:", "",
              "| algorithm | layout | run | last loss |", "|---|---|---|---|", nccl_rows.rstrip()]
else:
    lines += ["", "- acco and dpu with NCCL inside the sites: not run (needs 2 or more GPUs)"]
lines += ["", "- A checkpoint on the GPU: diloco, 2 sites x 1 rank, bf16, saved at step 4 of 8 and resumed; "
          "the last loss beside the uninterrupted GPU run's:", "",
          "| run | status | last loss | uninterrupted | relative difference |", "|---|---|---|---|---|",
          ckpt_rows.rstrip()]
if ft_row:
    lines += ["", "- Elastic sites on torchft with CUDA tensors (--lsgd-min-sites 2; the first row is the quick "
              "start's ELASTIC mode, 300 steps):", "", "| run | status |", "|---|---|", ft_row]
else:
    lines += ["", "- Elastic sites on torchft: not run (torchft is not importable)"]
if clock_rc == "0" and clock_rows.strip():
    lines += ["", "- The device-synchronised clock's cost (`tools/benchmarks/step/clock_cost.py`, ~125M Llama, bf16, "
              "medians of 7 rounds x 50 steps):", "", "| readings | ms per step | / none |", "|---|---|---|",
              clock_rows.rstrip()]
else:
    lines += ["", f"- tools/benchmarks/step/clock_cost.py FAILED (exit {clock_rc}); see its log"]
print("\n".join(lines))
EOF
)
echo "$SECTION"
"$PY" - "$REPO/docs/performance.md" "$SECTION" <<'EOF'
import sys
path, section = sys.argv[1], sys.argv[2]
text = open(path).read()
start, end = "<!-- gpu_check:start -->", "<!-- gpu_check:end -->"
head, rest = text.split(start, 1)
_, tail = rest.split(end, 1)
open(path, "w").write(f"{head}{start}\n{section}\n{end}{tail}")
EOF
echo "wrote the GPU section of docs/performance.md; logs in $OUT"
[ $TESTS_RC -eq 0 ] && [ $MFU_RC -eq 0 ] && [ $MFU_COMPILED_RC -eq 0 ] && [ $MEM_RC -eq 0 ] && [ $CLOCK_RC -eq 0 ] && ! grep -q FAILED <<<"$ALGO_ROWS$NCCL_ROWS$CKPT_ROWS$FT_ROW"
