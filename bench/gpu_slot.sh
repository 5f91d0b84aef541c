#!/usr/bin/env bash
# The GPU comparison of issue 42 in one call of about 8 minutes on one H100 or H200: where a training update and a
# beam-search call spend the GPU's time (profile_gpu.py), then the training levers beside the default update
# (autocast instead of the bf16 copy, the grouped Adam instead of the fused one;
# train.fused_output_loss, a memory lever, is in the results ledger's L28) and the decoding searches (dynamic,
# static with CUDA graphs, CTranslate2) side by side (bench_gpu.py), at the paper presets' shape
# (train.max_tokens: update).
# Results are written under $OUT (default bench/results), named after the GPU.
#
# A GPU machine whose Python lacks this project's pure dependencies (pydantic and its three helpers, ctranslate2,
# sacremoses) can be given them as wheels in .whl/ (`bash bench/gpu_slot.sh wheels`, here, before the device call:
# the device machine reaches no package index; the pins are requirements/constraints.txt's); they are installed into
# a temporary folder there (bench/device_env.sh). The device call: run(command="OUT=$OUT bash bench/gpu_slot.sh", carry=[".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = wheels ]; then
  pins=$(grep -E '^(pydantic|pydantic_core|annotated-types|typing-inspection|ctranslate2|sacremoses)==' \
    requirements/constraints.txt) || exit 1
  # shellcheck disable=SC2086  # one argument per pin
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl $pins
fi
out=${OUT:-bench/results}
mkdir -p "$out"
# shellcheck source=bench/device_env.sh
. bench/device_env.sh
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))") || exit 1
timeout 200 python3 -m bench.profile_gpu --updates 3 --out "$out/profile_gpu_$gpu.json"
timeout 300 python3 -m bench.bench_gpu --presets base big --steps 10 --train-precisions bf16 \
  --levers train.bf16_copy=off train.fused_adam=false \
  --out "$out/gpu_levers_$gpu.json"
