#!/usr/bin/env bash
# Train the default draft for SmolLM2-135M-Instruct from scratch, as the installed one was trained
# (docs/MODELS.md section 3). Every step is resumable: run it again after a stop and it goes on where it was.
#
#   bash build/distill_default_draft.sh            # after `make setup` (the target must be converted)
#
# 1. the corpora (build/corpora.py) and chat requests built from their training split (build/chat_requests.py);
# 2. in the background, in parallel: the target answers the requests (two shards of build/target_answers.py)
#    and scores windows of training text (build/target_labels.py), each on one core, for DATA_MINUTES;
# 3. build/train_draft.py trains the draft on all of it; the best held-out checkpoint is installed into
#    model_repository/draft_model/1 and completed with the target's embeddings (build/default_model.py).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-model_repository/target_model/1}
DATA=${DATA:-data/chat}
RUN=${RUN:-runs/default_draft}
DATA_MINUTES=${DATA_MINUTES:-60}   # how long the target writes data before training starts (0: use what is there)
STEPS=${STEPS:-1500}
LAYERS=${LAYERS:-1}
PROPOSAL_VOCAB=${PROPOSAL_VOCAB:-4096}
INSTALL=${INSTALL:-1}

source build/distill_common.sh
prepare_requests

if [ "$DATA_MINUTES" -gt 0 ]; then
    start_answers
    pids=("${ANSWER_PIDS[@]}")
    "$PY" build/target_labels.py --target "$TARGET" --corpora data/corpora --out "$DATA/labels.jsonl" \
        --per-domain 3000 --batch 4 --bf16 --seed 11 > "$DATA/labels.log" 2>&1 &
    pids+=("$!")
    echo "[draft] the target writes answers and labels for $DATA_MINUTES min (logs in $DATA/)"
    run_for_minutes "$DATA_MINUTES" "${pids[@]}"
fi

answers=()
for file in "$DATA"/answers*.jsonl "$DATA/labels.jsonl"; do
    [ -f "$file" ] && answers+=(--answers "$file")
done
resume=()
[ -f "$RUN/state.pt" ] && resume=(--resume)
echo "[draft] training $STEPS steps on ${#answers[@]} files -> $RUN (log $RUN.log)"
"$PY" build/train_draft.py --target "$TARGET" "${answers[@]}" --out "$RUN" --layers "$LAYERS" --init-layers 0 \
    --proposal-vocab "$PROPOSAL_VOCAB" --steps "$STEPS" --warmup 50 --lr 1e-3 --tokens-per-batch 8192 \
    --eval-every 100 --ckpt-every 50 --eval-examples 160 --threads 2 --bf16 --seed 1234 "${resume[@]}" \
    2> "$RUN.log"
if [ "$INSTALL" = 1 ]; then
    cp "$RUN/best/config.json" "$RUN/best/draft_layers.safetensors" "$RUN/best/proposal_vocab.json" \
        model_repository/draft_model/1/
    "$PY" build/default_model.py
    echo "[draft] installed $RUN/best ($(cat "$RUN/best/agreement.json"))"
fi
