#!/bin/bash
# usage: ab_steps.sh "1 4 8 ..." CELLS("64:192:greedy 16:64:greedy") ROUND
cd "$(dirname "$0")/../../.."
for v in $1; do
  sed -i "s/^  plain_steps: .*/  plain_steps: $v/" model_repository/speculative_decoding/1/profiles.yaml
  pkill -f specdec_client.server; sleep 8; pkill -9 -f tritonserver; rm -f /dev/shm/triton_python_backend_shm_region_*
  (nohup .venv/bin/python -m specdec_client.server --model-repository model_repository --lean > /tmp/serve_$v.log 2>&1 &)
  for i in $(seq 100); do curl -sf localhost:9000/v1/models >/dev/null && break; sleep 3; done
  sleep 5
  for cell in $2; do
    IFS=: read c n m <<< "$cell"
    .venv/bin/python docs/bench/s36-plain-steps/load.py $c $n $m "k${v}r$3" 2>&1 | tail -1
  done
done
pkill -f specdec_client.server; sleep 8; pkill -9 -f tritonserver
git checkout model_repository/speculative_decoding/1/profiles.yaml
