# Sourced by device scripts that start `moemesh serve` in the background: `wait_ready PORT PID SECONDS` sets
# `ready` to 1 once /health answers, to 0 when the process exits first or SECONDS pass.
wait_ready() {
  local port=$1 pid=$2 secs=$3
  ready=0
  for _ in $(seq 1 "$secs"); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ready=1; return; fi
    kill -0 "$pid" 2>/dev/null || return
    sleep 1
  done
}
