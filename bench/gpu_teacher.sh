#!/usr/bin/env bash
# The distillation teacher's call on a lent GPU (bench/gpu_teacher.py says what it does and brings back), prepared here:
#   bash bench/gpu_slot.sh wheels                    # pydantic and ctranslate2 for the device machine, into .whl/
#   bash bench/gpu_teacher.sh carry                  # the Multi30k files and the commit, into .carry/ (ignored)
#   run(command="bash bench/gpu_teacher.sh", carry=[".whl", ".carry"], timeout_s=560)
# Extra arguments go to bench/gpu_teacher.py (e.g. --teachers 2 --set train.max_minutes=3).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = carry ]; then
  data=${AIAYN_DATA_ROOT:-../shared/data}
  mkdir -p .carry/data/multi30k .carry/data/wmt14-en-de || exit 1
  cp "$data"/multi30k/{train,val,test2016}.{en,de} .carry/data/multi30k/ || exit 1
  cp "$data"/wmt14-en-de/newstest2014.{en,de} .carry/data/wmt14-en-de/ || exit 1
  git rev-parse --short HEAD > .carry/commit
  grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exit 0
fi
# shellcheck source=bench/device_env.sh
. bench/device_env.sh
AIAYN_COMMIT=$(cat .carry/commit 2>/dev/null || echo unknown) \
  exec python3 -m bench.gpu_teacher --device-call --data-root .carry/data --out "${OUT:-bench/results/scratch/gpu_teacher}" "$@"
