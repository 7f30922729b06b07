"""gpuguard: keep GPU training clusters healthy under Slurm."""

import os as _os

__version__ = "0.1.0"

# One process, one version. `make install` puts each version in a directory of its own and switches the hooks to it by
# renaming a `current` symlink (gpuguard.cli.versions); a module this process imports later (a drain's notification,
# a traceback's formatting) comes from the directory this package was found in when the process started, never from a
# version installed meanwhile.
__path__ = [_os.path.realpath(p) for p in __path__]
