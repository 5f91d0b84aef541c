#!/usr/bin/env bash
# Builds deploy/Dockerfile on a machine that reaches no image registry, as this project's CI does:
#
#   deploy/build-image.sh [TAG]      # default aiayn-pipeline:<short commit>
#
# - the base is deploy/base-image.sh's, made from Debian's packages (BASE=IMAGE uses another);
# - the build's pip sees what this machine's pip sees: the find-links folders of its settings (PIP_FIND_LINKS or
#   pip's global.find-links, where torch's CPU wheel may lie) are served read-only on 127.0.0.1 for the build,
#   which runs on the host's network for that; with none, torch comes from the Dockerfile's TORCH_INDEX;
# - the commit is baked in (AIAYN_COMMIT; a trailing + when tracked files differ from it).
# Docker must be running (dockerd); the build caches its layers, so a second build of an unchanged checkout is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse HEAD)
git diff --quiet HEAD -- 2>/dev/null || commit="$commit+"
tag=${1:-aiayn-pipeline:${commit:0:7}}
base=${BASE:-aiayn-base:bookworm}
[ -n "${BASE:-}" ] || bash deploy/base-image.sh "$base"

args=(--build-arg "BASE=$base" --build-arg "AIAYN_COMMIT=$commit")
links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
servers=()
trap 'for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT
urls=()
port=${WHEELS_PORT:-18765}  # a fixed port keeps the torch layer's build arguments, and so its cache, the same
for link in $links; do
  dir=${link#file://}
  [ -d "$dir" ] || continue
  python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
  servers+=($!)
  for _ in $(seq 50); do
    python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1)" "$port" \
      2>/dev/null && break
    kill -0 "${servers[-1]}" 2>/dev/null || { echo "port $port is taken: set WHEELS_PORT" >&2; exit 1; }
    sleep 0.1
  done
  urls+=("http://127.0.0.1:$port/")
  port=$((port + 1))
done
if [ ${#urls[@]} -gt 0 ]; then
  args+=(--network host --build-arg "PIP_FIND_LINKS=${urls[*]}" --build-arg TORCH_INDEX=)
fi
docker build -f deploy/Dockerfile "${args[@]}" -t "$tag" .
echo "$tag"
