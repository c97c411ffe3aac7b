#!/usr/bin/env bash
# The token mixers' GPU checks in one call (issue 34), for a lent GPU with no internet: the carried wheels first
# (`pip download --no-deps -d wheels flash-linear-attention fla-core transformers==5.25.0` on a machine with
# internet, then carry `wheels`), then the GPU tests (the fused kernels' among them) and the mixers benchmark at
# 16K-64K tokens, sp 1-8, whatever kernels are installed (fla where carried). Results under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
if compgen -G "wheels/*.whl" > /dev/null; then
    python -m pip install --quiet --no-deps wheels/*.whl 2>&1 | tail -2
fi
python - <<'PY' | tee "$out/env.txt"
import importlib.util, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())
for name in ("fla", "causal_conv1d", "mamba_ssm", "triton"):
    print(name, "installed" if importlib.util.find_spec(name) else "missing")
PY
export HF_HUB_OFFLINE=1
python -m pytest -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee "$out/test_gpu.txt"
for mixer in qwen3_5 granite4; do
    timeout 240 python -m benchmarks.mixers --device cuda --dtype bf16 --mixer "$mixer" \
        --seq-lens 16384 32768 65536 --sp 1 2 4 8 --json "$out/mixers_${mixer}_cuda.json" 2>&1 | tail -40 \
        | tee "$out/mixers_${mixer}.txt"
done
