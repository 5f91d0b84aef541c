# Sourced by the device-call scripts (gpu_slot.sh, gpu_teacher.sh): the device machine's Python lacks this project's
# pure dependencies (pydantic and its helpers, ctranslate2); `bash bench/gpu_slot.sh wheels` puts them in .whl/ here,
# the call carries .whl, and this installs them into a temporary folder there (it reaches no package index).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
