"""GPU benchmarks and the helpers the GPU tests share (run on the device: scripts/gpu.sh)."""
