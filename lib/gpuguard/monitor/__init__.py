"""`gpuguard monitor`: the per-node job sidecar (started by the torchrun template with `srun --overlap`).

Every `interval_s` it samples the job's GPUs (NVML through pynvml, one session for the whole job) and the node
(psutil), writes a small report into the shared job directory, compares itself with the other nodes' reports
(stragglers), follows the training log with the same parser as `gpuguard trainlog` (hangs), and alerts through
`gpuguard.notify`. Layout: `sampler` (I/O: NVML, psutil), `detect` (pure), `jobdir` (shared files),
`actions` (py-spy, requeue), `loop` (the schedule), `cli` (argparse glue for monitor/trainlog/status/history).
"""
