#!/usr/bin/env bash
# A GPU session's comparison in one call, each step under its timeout: where a training update and a beam-search
# call spend the GPU's time (bench/profile_gpu.py), then the training levers beside the default update (autocast
# instead of the bf16 copy, the grouped Adam instead of the fused one) and the decoding searches (dynamic, static
# with CUDA graphs, CTranslate2) side by side (bench/bench_gpu.py), at the base and big presets' shapes. Results go
# under $OUT (default bench/results), named after the GPU.
#
# The device machine reaches no package index: `bash bench/gpu_slot.sh wheels`, here, downloads the pure
# dependencies it may lack (pydantic and its helpers, ctranslate2, sacremoses; the pins of
# requirements/constraints.txt) into .whl/, which bench/device_env.sh installs there into a temporary folder.
# The device call: run(command="OUT=$OUT bash bench/gpu_slot.sh", carry=[".whl"]).
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
