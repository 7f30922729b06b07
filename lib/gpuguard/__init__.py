"""gpuguard: keep GPU training clusters healthy under Slurm."""

__version__ = "0.1.0"
