#!/usr/bin/env bash
# lm-evaluation-harness against `parrot serve` on the default model, offline: one loglikelihood task
# (parrot_mc, multiple choice) and one generate_until task (parrot_gen) over the small data files shipped in
# tests/data/lm_eval. lm-eval's `local-completions` model talks to /v1/completions (token-id prompts, echo +
# logprobs for loglikelihood) and uses Parrot's /tokenize, /detokenize and /tokenizer_info as its tokenizer
# (tokenizer_backend=remote), so no tokenizer files are fetched. Steps: install the `eval` extra if lm_eval is
# missing (torch kept at its installed version), start the server on a free port, run both tasks with
# --limit, print lm-eval's results table, stop the server. Bounded: startup 240 s, evaluation 900 s.
#   usage: bash scripts/lm_eval_check.sh [LIMIT]   (default 16: every item)
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-16}
VPY=.venv/bin/python
if ! "$VPY" -c "import lm_eval, tenacity, aiohttp, requests" 2>/dev/null; then
  constraint=$(mktemp)
  "$VPY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraint"
  "$VPY" -m pip install -q --disable-pip-version-check -c "$constraint" -e ".[eval]"
  rm -f "$constraint"
fi
PORT=$("$VPY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
URL="http://127.0.0.1:$PORT"
LOG=$(mktemp)
PARROT_LOG_LEVEL=WARNING PARROT_ENGINE_KV_CACHE_TOKENS=16384 "$VPY" -m parrot.cli serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -f "$LOG"' EXIT
for _ in $(seq 480); do
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "parrot serve exited:"; cat "$LOG"; exit 1; fi
  if "$VPY" -c "import httpx, sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null; then
    break
  fi
  sleep 0.5
done
MODEL=$("$VPY" -c "import httpx; print(httpx.get('$URL/v1/models').json()['data'][0]['id'])")
echo "parrot serve on $URL, model $MODEL; lm-eval $("$VPY" -c 'import importlib.metadata as m; print(m.version("lm_eval"))'), limit $LIMIT"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 timeout 900 .venv/bin/lm-eval run \
  --model local-completions \
  --model_args "model=$MODEL" "base_url=$URL/v1/completions" tokenizer_backend=remote num_concurrent=1 max_retries=1 \
  --tasks parrot_mc parrot_gen --include_path tests/data/lm_eval --limit "$LIMIT" --seed 1234
