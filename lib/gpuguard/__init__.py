"""gpuguard: keep GPU training clusters healthy under Slurm."""

import os as _os

__version__ = "0.1.0"

# One process, one version. `make install` puts each version in a directory of its own and switches the hooks to it by
# renaming a `current` symlink (gpuguard.cli.versions); a module this process imports later (a drain's notification,
# a traceback's formatting) comes from the directory this package was found in when the process started, never from a
# version installed meanwhile. It holds that directory open for as long as it runs: an install never removes a version
# a running process still uses.
__path__ = [_os.path.realpath(p) for p in __path__]
try:
    _held = _os.open(__path__[0], _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
except OSError:
    _held = -1
