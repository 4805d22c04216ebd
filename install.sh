#!/usr/bin/env bash
# Installs speedrun and everything it needs into ./.venv.
#   ./install.sh            # torch 2.13.0 (CPU build where there is no NVIDIA GPU), speedrun, test tools
# Environment: PYTHON (interpreter to build the venv from, default python3),
#              TORCH_INDEX_URL (an index to take torch from, e.g. https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${pip[@]}" install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
    else
        # Where there is no GPU this must be installed before anything that depends on torch,
        # or pip pulls the CUDA build and gigabytes of CUDA packages.
        "${pip[@]}" install "torch==2.13.0"
    fi
fi
"${pip[@]}" install -e ".[test]"
echo "speedrun installed: $(.venv/bin/speedrun --version)"
