# Sourced by device scripts whose services share one GPU: starts NVIDIA MPS (several CUDA processes on one
# GPU time-slice without it) and stops it when the sourcing script exits, after `mps_on_exit` commands.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS did not start (already running?)"
mps_on_exit=""
trap 'eval "$mps_on_exit"; echo quit | nvidia-cuda-mps-control' EXIT
