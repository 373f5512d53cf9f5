#!/usr/bin/env bash
# Train the EAGLE head further on one GPU, as the installed head's stage 8 was (docs/MODELS.md section 6):
# new chat requests, the target's answers, its features and the head's training in one process of about
# 8 minutes (build/distill_eagle_gpu.py), then the best held-out head installed into model_repository.
#
#   bash build/distill_eagle_gpu.sh        # after `make setup`, on a machine with a CUDA GPU
#
# Stage 8 ran this with SEED=2032 BUDGET=470 ANSWER=200 ANSWER_BATCH=384 on one H200 (the target converted
# there from the GGUF file by build/gguf_convert.py, as `make setup` does). Its answering was bound by
# Hugging Face generate's per-step overhead (6,100 tokens/s at 384 sequences), hence the larger default batch
# for the next stage: SEED 2033's new requests, and stage 8's (seed 2032) answered again and trained on.
# On a GPU with fewer than ~60 GB free, lower CAPACITY and ANSWER_BATCH.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DATA=${DATA:-data/gpu}
RUN=${RUN:-runs/eagle_gpu}
SEED=${SEED:-2033}                 # the new requests' seed (stages 1-8 used 2026-2032)
BUDGET=${BUDGET:-470}              # seconds for the whole run after the target's load
ANSWER=${ANSWER:-200}              # seconds of it for the target's answers
ANSWER_BATCH=${ANSWER_BATCH:-1024} # sequences generated together
# Answers made before, reused (not answered again): a previous run's answers.jsonl.gz or build/target_answers.py's,
# space-separated; by default the committed ones (build/answers/: seed 2033's greedy answers made on a CPU).
ANSWERS=${ANSWERS-$(ls build/answers/*.jsonl.gz 2>/dev/null || true)}
CAPACITY=${CAPACITY:-12000000}     # feature rows kept on the GPU (4.5 KiB each with the fused layers)
INSTALL=${INSTALL:-1}
EXTRA=${EXTRA:-}                   # more build/distill_eagle_gpu.py options, e.g. "--device cpu --tokens-per-batch 8192"

source build/distill_common.sh
DATA=data/chat REQUEST_SEED=2026 prepare_requests    # the corpora (and seed 2026's requests, as stage 1)
mkdir -p "$DATA/earlier"
# Every earlier stage's requests (their seeds and counts, docs/MODELS.md section 6): excluded from the new set.
GPU_COUNTS="code=4000,json=4000,prose=4000,raw=2000,open=12000,open_code=8000"
declare -A COUNTS=([2026]="" [2027]="" [2028]="" [2029]="" [2030]="code=0,json=0,prose=0,raw=0,open=3600"
                   [2031]="code=0,json=0,prose=0,raw=0,open=3000,open_code=1500" [2032]="$GPU_COUNTS")
exclude=()
for seed in $(seq 2026 $((SEED - 1))); do
    file="$DATA/earlier/chat$seed.jsonl"
    earlier=()  # the GPU stages' sets were built excluding every earlier one; stages 1-7's were not
    [ "$seed" -ge 2032 ] && earlier=("${exclude[@]}")
    [ -f "$file" ] || "$PY" build/chat_requests.py --corpora data/corpora --out "$file" --seed "$seed" \
        ${COUNTS[$seed]:+--counts "${COUNTS[$seed]}"} "${earlier[@]}"
    exclude+=(--exclude "$file")
done
[ -f "$DATA/chat$SEED.jsonl" ] || "$PY" build/chat_requests.py --corpora data/corpora --out "$DATA/chat$SEED.jsonl" \
    --seed "$SEED" --counts "$GPU_COUNTS" "${exclude[@]}"

# Greedy answers to the new requests first (10% held out), then the earlier GPU stage's requests and the open
# asks of stages 6-7 (trained on only), then sampled answers to the new requests, for as long as ANSWER allows.
train_requests=()
for seed in 2030 2031 2032; do
    [ "$seed" -lt "$SEED" ] && train_requests+=(--train-requests "$DATA/earlier/chat$seed.jsonl")
done
made_before=()
for file in $ANSWERS; do
    made_before+=(--answers "$file")
done
"$PY" build/distill_eagle_gpu.py --requests "$DATA/chat$SEED.jsonl" "${train_requests[@]}" "${made_before[@]}" \
    --out "$RUN" --budget-seconds "$BUDGET" --answer-seconds "$ANSWER" --answer-batch "$ANSWER_BATCH" \
    --capacity-tokens "$CAPACITY" --lr 4e-4 --seed "$SEED" $EXTRA

if [ "$INSTALL" = 1 ]; then
    cp "$RUN/eagle_layers.safetensors" model_repository/eagle_draft/1/
    "$PY" build/default_model.py            # completes the head with the target's embeddings again
    make onnx-exports
    echo "[eagle-gpu] installed $RUN's best held-out head: $(cat "$RUN/agreement.json")"
fi
