# Shared by build/distill_default_draft.sh and build/distill_eagle.sh (sourced; PY, TARGET and DATA set).

# The corpora (build/corpora.py; its prose reads Debian packages) and the chat requests built from them.
prepare_requests() {
    if ! command -v mod2imp >/dev/null; then
        local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
        $sudo apt-get install -y -qq sword-text-web libsword-utils fortunes dict-devil python3.11-doc
    fi
    [ -f data/corpora/manifest.json ] || "$PY" build/corpora.py --out data/corpora
    local exclude=() file  # REQUEST_EXCLUDE: requests files (space-separated) whose requests are left out
    for file in ${REQUEST_EXCLUDE:-}; do
        exclude+=(--exclude "$file")
    done
    [ -f "$DATA/requests.jsonl" ] || "$PY" build/chat_requests.py --corpora data/corpora \
        --out "$DATA/requests.jsonl" --seed "${REQUEST_SEED:-2026}" \
        --counts "${REQUEST_COUNTS:-code=3000,json=3000,prose=3000,raw=3000}" "${exclude[@]}"
}

# Start the target answering the requests in two background shards (one core each); their pids go to ANSWER_PIDS.
start_answers() {
    ANSWER_PIDS=()
    for shard in 0 1; do
        "$PY" build/target_answers.py --target "$TARGET" --requests "$DATA/requests.jsonl" \
            --out "$DATA/answers_$shard.jsonl" --slots 32 --threads 1 --shard "$shard/2" --seed 7 \
            > "$DATA/answers_$shard.log" 2>&1 &
        ANSWER_PIDS+=("$!")
    done
}

# Let background jobs run for $1 minutes, then stop them (they resume where they were on the next run).
run_for_minutes() {
    local minutes=$1; shift
    sleep "$((minutes * 60))"
    kill "$@" 2>/dev/null || true
    wait "$@" 2>/dev/null || true
}
