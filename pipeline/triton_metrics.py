"""Triton's per-GPU metric families (Triton metrics.md; served only where a GPU is, collected through DCGM): the
names the Kubernetes dashboard (`pipeline.k8s.monitoring`) and the load test's energy meter (`pipeline.validate.energy`)
both read. A leaf: standard library only."""

GPU_UTILIZATION = "nv_gpu_utilization"                    # 0-1, label gpu_uuid
GPU_MEMORY_USED = "nv_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "nv_gpu_memory_total_bytes"
GPU_POWER = "nv_gpu_power_usage"                          # watts, DCGM's reading (Triton collects GPU metrics via DCGM)
GPU_POWER_LIMIT = "nv_gpu_power_limit"                    # watts
GPU_ENERGY = "nv_energy_consumption"                      # counter, joules since Triton started (core src/metrics.cc)
TRITON_GPU = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_POWER, GPU_POWER_LIMIT, GPU_ENERGY)
