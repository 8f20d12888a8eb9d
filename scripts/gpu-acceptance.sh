#!/usr/bin/env bash
# GPU acceptance for the RTX 4090: `trtpipe doctor`, then the headline FP8 build of SmolLM2-135M, then
# one of MODEL (default llama-3-8b); each repository is served by the tritonserver on PATH (the
# container's, with the tensorrtllm backend) and validated against that server. One verdict line per
# step as it ends, all of them again at the end; exit status 0 only when every step passed.
# It has never run on a GPU: see docs/gpu-acceptance.md.
#
#   bash scripts/gpu-acceptance.sh [MODEL]
#
# Environment: TRTPIPE (the trtpipe command, default trtpipe), TRTPIPE_ACCEPTANCE_OUT (default
# out/gpu-acceptance), TRTPIPE_ACCEPTANCE_PORT (HTTP port, default 8000; gRPC +1, metrics +2),
# TRTPIPE_ACCEPTANCE_TIMEOUT (seconds a server may take to load its models, default 900), and
# TRTPIPE_MODEL_DIR for where the Llama/Mistral weights are (read by trtpipe itself).
set -euo pipefail

readonly TARGET=rtx4090 PRECISION=fp8 HEADLINE=smollm2-135m
model=${1:-llama-3-8b}
trtpipe=${TRTPIPE:-trtpipe}
out=${TRTPIPE_ACCEPTANCE_OUT:-out/gpu-acceptance}
port=${TRTPIPE_ACCEPTANCE_PORT:-8000}
timeout_s=${TRTPIPE_ACCEPTANCE_TIMEOUT:-900}
logs="$out/logs"
verdicts=()
failed=0
server_pid=""

verdict() {  # STATUS STEP DETAIL
  local line
  line=$(printf '%-4s  %-26s  %s' "$1" "$2" "$3")
  verdicts+=("$line")
  if [[ $1 != PASS ]]; then failed=1; fi
  printf '==> %s\n' "$line"
}

stop_server() {  # SIGTERM (Triton shuts down gracefully), SIGKILL after 30 s
  if [[ -z $server_pid ]]; then return 0; fi
  kill -TERM "$server_pid" 2>/dev/null || true
  for _ in {1..30}; do
    if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
    sleep 1
  done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

wait_for_server() {  # tritonserver opens its HTTP port once every model has loaded
  local waited=0
  until port_open; do
    if ! kill -0 "$server_pid" 2>/dev/null || ((waited >= timeout_s)); then return 1; fi
    sleep 2
    waited=$((waited + 2))
  done
}

serve_and_validate() {  # NAME DIR
  local name=$1 dir=$2
  if port_open; then
    verdict FAIL "validate $name" "port $port is already in use; set TRTPIPE_ACCEPTANCE_PORT"
    return 0
  fi
  tritonserver --model-repository="$dir/model_repo" --http-port="$port" --grpc-port=$((port + 1)) \
    --metrics-port=$((port + 2)) >"$logs/$name-tritonserver.log" 2>&1 &
  server_pid=$!
  if ! wait_for_server; then
    verdict FAIL "validate $name" "tritonserver did not come up on port $port (log: $logs/$name-tritonserver.log)"
  elif "$trtpipe" validate "$dir/model_repo" --url "http://127.0.0.1:$port" --timeout "$timeout_s" \
      -o "$dir/validation" 2>&1 | tee "$logs/$name-validate.log"; then
    verdict PASS "validate $name" "every check passed: $dir/validation/report.json"
  else
    verdict FAIL "validate $name" "see $logs/$name-validate.log and $logs/$name-tritonserver.log"
  fi
  stop_server
}

accept() {  # MODEL: build it for the target, then serve and validate its repository
  local name=${1##*/}
  local dir="$out/$name-$TARGET-$PRECISION"
  if "$trtpipe" build "$1" --target "$TARGET" --precision "$PRECISION" -o "$dir" 2>&1 \
      | tee "$logs/$name-build.log"; then
    verdict PASS "build $name" "engine in $dir/engine"
    serve_and_validate "$name" "$dir"
  else
    verdict FAIL "build $name" "see $logs/$name-build.log"
    verdict SKIP "validate $name" "nothing to serve"
  fi
}

mkdir -p "$logs"
models=("$HEADLINE")
if [[ $model != "$HEADLINE" ]]; then models+=("$model"); fi
if "$trtpipe" doctor --target "$TARGET" 2>&1 | tee "$logs/doctor.log"; then
  verdict PASS doctor "this machine can build and serve $TARGET engines"
  for m in "${models[@]}"; do accept "$m"; done
else
  verdict FAIL doctor "see the FAIL lines above ($logs/doctor.log)"
  for m in "${models[@]}"; do verdict SKIP "build ${m##*/}" "doctor failed"; done
fi

printf '\nGPU acceptance (%s, %s):\n' "$TARGET" "$PRECISION"
printf '%s\n' "${verdicts[@]}"
exit "$failed"
