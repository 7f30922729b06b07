"""The job-level multi-node pre-flight (`gpuguard preflight`): a short collective over the job's nodes, blame inside
the allocation (a node, a switch or nothing reproducible), and what the job does next (docs/nccl.md)."""
