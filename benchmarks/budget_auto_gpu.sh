#!/usr/bin/env bash
# `--budget auto` in the embedded engine on a GPU against budgets 15 and 64 and DFLASH, one
# interleaved `ddtree bench` (the trained pair, held-out stdlib prompts, 128 new tokens,
# 5 trials, concurrency 1 and 8). Repository root; torch on the machine.
#   benchmarks/budget_auto_gpu.sh OUT_DIR
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
serve() {  # name port flags...
  local name=$1 port=$2; shift 2
  python3 -m ddtree_cli.engine --device cuda --port "$port" "$@" >"$out/$name.log" 2>&1 &
  pids+=($!)
}
serve ddtree-b15 31101 --algo ddtree --budget 15
serve ddtree-b64 31102 --algo ddtree --budget 64
serve ddtree-auto 31103 --algo ddtree --budget auto
serve dflash 31104 --algo dflash
for port in 31101 31102 31103 31104; do
  for _ in $(seq 120); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null && break
    sleep 1
  done
done
python3 -m ddtree_cli bench --algo ddtree --baseline dflash \
  --url ddtree-b15=http://127.0.0.1:31101 --url ddtree-b64=http://127.0.0.1:31102 \
  --url ddtree-auto=http://127.0.0.1:31103 --url dflash=http://127.0.0.1:31104 \
  --dataset stdlib --num-prompts 16,40 --concurrency 1,8 --max-new-tokens 128 --trials 5 \
  --output "$out/bench" --json >"$out/summary.json"
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:31103/server_info').read().decode())" \
  >"$out/auto_server_info.json"
