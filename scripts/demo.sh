#!/usr/bin/env bash
# Set up (idempotent), start `parrot serve` on the default model (SmolLM2-135M-Instruct, CPU), run the paper's
# apps against it (Fig. 7 snake game, a two-output template, chain and map-reduce summaries, a structured-output
# pipeline, a LangChain LCEL map-reduce compiled to semantic functions, a tool-using agent), and stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PARROT_PORT:-8000}
export PARROT_URL="http://127.0.0.1:${PORT}"
.venv/bin/parrot serve --port "$PORT" &
SERVER=$!
stop_server() { kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; }
trap stop_server EXIT
for _ in $(seq 1 300); do
  .venv/bin/python -c "import httpx, os, sys; sys.exit(httpx.get(os.environ['PARROT_URL'] + '/health', timeout=2).status_code != 200)" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "parrot serve exited" >&2; exit 1; }
  sleep 1
done
for app in snake_game multi_output chain_summary map_reduce_summary structured_pipeline langchain_chain agent react_agent refine_until_valid; do
  echo "=== examples/${app}.py"
  .venv/bin/python "examples/${app}.py"
done
stop_server
trap - EXIT
echo "demo finished"
