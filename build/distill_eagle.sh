#!/usr/bin/env bash
# Train the default EAGLE head for SmolLM2-135M-Instruct as the installed one was trained (docs/MODELS.md
# section 6). Every step is resumable: run it again after a stop and it goes on where it was.
#
#   bash build/distill_eagle.sh            # after `make setup` (the target converted, the draft assembled)
#
# 1. the corpora and chat requests (as build/distill_default_draft.sh; prose needs Debian packages);
# 2. in the background, two shards of build/target_answers.py answer requests for ANSWER_MINUTES;
# 3. build/eagle_features.py records the target's features of those answers and of text windows;
# 4. build/train_eagle.py trains the head from INIT_FROM (the standalone draft: the head starts as the draft and
#    learns to read the features; or a trained head, to train it further on more answers); the best held-out
#    checkpoint is installed into model_repository/eagle_draft/1 and completed with the target's embeddings
#    (build/default_model.py). The installed head took six runs (docs/MODELS.md section 6):
#
#      bash build/distill_eagle.sh                                         # stage 1: 70 min of answers, 300 steps
#      ANSWER_MINUTES=56 TEXT_PER_DOMAIN=200 FEATURES=data/eagle2 RUN=runs/eagle2 INIT_FROM=runs/eagle/best \
#          STEPS=400 WARMUP=20 SEED=4321 bash build/distill_eagle.sh        # stage 2: more answers, from stage 1
#      ANSWER_MINUTES=33 DATA=data/chat3 REQUEST_SEED=2027 REQUEST_EXCLUDE=data/chat/requests.jsonl \
#          TEXT_PER_DOMAIN=100 FEATURE_SEED=13 AUX_LAYERS=2,15,26 FEATURES=data/eagle3 RUN=runs/eagle3 \
#          INIT_FROM=runs/eagle2/best STEPS=200 WARMUP=20 SEED=777 VALID_FRAC=0.1 EVAL_EXAMPLES=0 THREADS=1 \
#          bash build/distill_eagle.sh                                      # stage 3: new requests, EAGLE-3 fusion
#      ANSWER_MINUTES=30 DATA=data/chat4 REQUEST_SEED=2028 \
#          REQUEST_EXCLUDE="data/chat/requests.jsonl data/chat3/requests.jsonl" TEXT_PER_DOMAIN=100 FEATURE_SEED=17 \
#          AUX_LAYERS=2,15,26 FEATURES=data/eagle4 EXTRA_FEATURES=data/eagle3 RUN=runs/eagle4 \
#          INIT_FROM=runs/eagle3/best STEPS=300 WARMUP=20 SEED=888 VALID_FRAC=0.1 EVAL_EXAMPLES=0 THREADS=2 \
#          bash build/distill_eagle.sh                                      # stage 4: more answers, both stages
#      ANSWER_MINUTES=58 DATA=data/chat5 REQUEST_SEED=2029 \
#          REQUEST_EXCLUDE="data/chat/requests.jsonl data/chat3/requests.jsonl data/chat4/requests.jsonl" \
#          TEXT_PER_DOMAIN=100 FEATURE_SEED=19 AUX_LAYERS=2,15,26 FEATURES=data/eagle5 \
#          EXTRA_FEATURES="data/eagle3 data/eagle4" RUN=runs/eagle5 INIT_FROM=runs/eagle4/best STEPS=300 WARMUP=20 \
#          SEED=999 VALID_FRAC=0.1 EVAL_EXAMPLES=0 THREADS=2 bash build/distill_eagle.sh   # stage 5: three stages
#      ANSWER_MINUTES=55 DATA=data/chat6 REQUEST_SEED=2030 REQUEST_COUNTS=code=0,json=0,prose=0,raw=0,open=3600 \
#          REQUEST_EXCLUDE="data/chat/requests.jsonl data/chat3/requests.jsonl data/chat4/requests.jsonl \
#          data/chat5/requests.jsonl" TEXT_PER_DOMAIN=50 FEATURE_SEED=23 AUX_LAYERS=2,15,26 FEATURES=data/eagle6 \
#          EXTRA_FEATURES="data/eagle3 data/eagle4 data/eagle5" RUN=runs/eagle6 INIT_FROM=runs/eagle5/best \
#          STEPS=300 WARMUP=20 SEED=1010 VALID_FRAC=0.1 EVAL_EXAMPLES=0 THREADS=2 bash build/distill_eagle.sh
#                                                      # stage 6: open-ended asks (build/open_requests.py)
#      ANSWER_MINUTES=48 DATA=data/chat7 REQUEST_SEED=2031 \
#          REQUEST_COUNTS=code=0,json=0,prose=0,raw=0,open=3000,open_code=1500 \
#          REQUEST_EXCLUDE="data/chat/requests.jsonl data/chat3/requests.jsonl data/chat4/requests.jsonl \
#          data/chat5/requests.jsonl data/chat6/requests.jsonl" TEXT_PER_DOMAIN=50 FEATURE_SEED=29 AUX_LAYERS=2,15,26 \
#          FEATURES=data/eagle7 EXTRA_FEATURES="data/eagle3 data/eagle4 data/eagle5 data/eagle6" RUN=runs/eagle7 \
#          INIT_FROM=runs/eagle6/best STEPS=320 WARMUP=20 SEED=1111 VALID_FRAC=0.1 EVAL_EXAMPLES=0 THREADS=2 \
#          bash build/distill_eagle.sh                          # stage 7: more Python asks (the open_code kind)
#
# (data/chat/requests.jsonl, seed 2026's requests, is rebuilt by `build/chat_requests.py --seed 2026` if gone.)
#
# AUX_LAYERS (EAGLE-3 fusion): record those target layers' outputs too and train the head to read them; setup
# then lists them in the target's config.json (build/default_model.py), so run `make onnx-exports` after.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-model_repository/target_model/1}
DATA=${DATA:-data/chat}
FEATURES=${FEATURES:-data/eagle}
EXTRA_FEATURES=${EXTRA_FEATURES:-}     # feature folders of earlier stages (space-separated), trained on too
RUN=${RUN:-runs/eagle}
ANSWER_MINUTES=${ANSWER_MINUTES:-70}   # how long the target writes answers (0: use what is there)
TEXT_PER_DOMAIN=${TEXT_PER_DOMAIN:-300}
STEPS=${STEPS:-300}
INIT_FROM=${INIT_FROM:-model_repository/draft_model/1}
WARMUP=${WARMUP:-30}
SEED=${SEED:-1234}
INSTALL=${INSTALL:-1}
AUX_LAYERS=${AUX_LAYERS:-}             # e.g. 2,15,26: EAGLE-3 fusion (empty: the final feature only)
FEATURE_SEED=${FEATURE_SEED:-11}       # which text windows are recorded
VALID_FRAC=${VALID_FRAC:-0.04}
EVAL_EXAMPLES=${EVAL_EXAMPLES:-160}
THREADS=${THREADS:-2}

source build/distill_common.sh
prepare_requests

if [ "$ANSWER_MINUTES" -gt 0 ]; then
    start_answers
    echo "[eagle] the target writes answers for $ANSWER_MINUTES min (logs in $DATA/)"
    run_for_minutes "$ANSWER_MINUTES" "${ANSWER_PIDS[@]}"
fi

answers=()
for file in "$DATA"/answers*.jsonl; do
    [ -f "$file" ] && answers+=(--answers "$file")
done
mkdir -p "$FEATURES"
echo "[eagle] recording the target's features -> $FEATURES"
fusion=()
[ -n "$AUX_LAYERS" ] && fusion=(--aux-layers "$AUX_LAYERS")
"$PY" build/eagle_features.py --target "$TARGET" "${answers[@]}" --text-per-domain "$TEXT_PER_DOMAIN" \
    --out "$FEATURES" --threads 2 --seed "$FEATURE_SEED" "${fusion[@]}" > "$FEATURES/features.log" 2>&1

extra=()  # --resume after a stop; --aux for a fused head
vocab=()  # a head trained further keeps its proposal vocabulary; from the draft, one is chosen from the answers
[ -f "$INIT_FROM/eagle_layers.safetensors" ] && vocab=(--proposal-vocab-file "$INIT_FROM/proposal_vocab.json")
[ -f "$RUN/state.pt" ] && extra=(--resume)
[ -n "$AUX_LAYERS" ] && extra+=(--aux)
echo "[eagle] training $STEPS steps -> $RUN (log $RUN.log)"
for folder in $EXTRA_FEATURES; do
    extra+=(--features "$folder")
done
"$PY" build/train_eagle.py --target "$TARGET" --features "$FEATURES" --out "$RUN" \
    --init-from "$INIT_FROM" "${vocab[@]}" --fc-init embedding \
    --fc-lr-scale 1.0 --lr 3e-4 --warmup "$WARMUP" --steps "$STEPS" --tokens-per-batch 8192 --eval-every 50 \
    --ckpt-every 50 --threads "$THREADS" --seed "$SEED" --valid-frac "$VALID_FRAC" --eval-examples "$EVAL_EXAMPLES" \
    --no-progress "${extra[@]}" 2> "$RUN.log"
if [ "$INSTALL" = 1 ]; then
    cp "$RUN/best/config.json" "$RUN/best/eagle_layers.safetensors" "$RUN/best/proposal_vocab.json" \
        model_repository/eagle_draft/1/
    "$PY" build/default_model.py
    echo "[eagle] installed $RUN/best ($(cat "$RUN/best/agreement.json")); now: make onnx-exports"
fi
