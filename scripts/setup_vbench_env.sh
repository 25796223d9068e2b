#!/usr/bin/env bash
# Build VBench's own virtual environment (its pins cannot live beside current diffusers):
#   bash scripts/setup_vbench_env.sh [VENV_DIR]        (default .vbench-venv; needs network for PyPI)
# then: fp4video eval --reference REF --candidate CAND --vbench --vbench-python VENV_DIR/bin/python
# Weights are separate: `fp4video vbench-weights` lists them and where they go.
set -euo pipefail
venv="${1:-.vbench-venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
"$py" -c 'import sys; assert sys.version_info < (3, 12), "VBench needs Python <= 3.11 (tokenizers wheels)"'
"$py" -m venv "$venv"
"$venv/bin/pip" install -q "setuptools<70" wheel
# torch and torchvision must be a matching pair (VBench imports torchvision): PyPI's torchvision
# fails to import beside a torch CPU build from elsewhere ("operator torchvision::nms does not
# exist", seen on this project's CPU machine with torch 2.13.0+cpu). Override with TORCH_SPEC.
"$venv/bin/pip" install -q ${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1} "vbench==0.1.5" "transformers==4.33.2" \
    "numpy<2" "timm<=1.0.12"
"$venv/bin/python" -c "import vbench; print('vbench', vbench.__file__)"
