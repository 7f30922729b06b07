"""The `templates:` section: site templates and defaults for `gpuguard render` and the job side."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.fields import Section, key, mapping, section, string


@section
class TemplatesConfig(Section):
    """`templates:` where site templates live and what they default to."""

    # a directory searched before the shipped sbatch_templates/ (site templates of the same name win)
    dir: Optional[str] = key(string(allow_none=True), None)
    # site defaults for template variables, e.g. {max_failures: 3, no_retry_exit_codes: [2],
    # checkpoint_glob: "step-*", preset: p5.48xlarge, gpuguard: /usr/local/bin/gpuguard}; a job's own
    # values win; checked against each template's declared variables when rendering
    defaults: dict[str, Any] = key(mapping, {})
    # preset overrides/additions merged over the shipped presets: {instances: {...}, stacks: {...},
    # common: {env: [{name, value, why}]}, known_bad: [...]}; validated when used
    presets: dict[str, Any] = key(mapping, {})
    # the user side's own SQLite file for job attempts (`gpuguard job-attempt`, run by the job as its user;
    # `gpuguard history` reads it): "{user}" = the job's user, "{node}" = the batch host, e.g.
    # /shared/gpuguard/attempts-{user}.db. Never the hooks' store.path (refused at run time): the root hooks'
    # database must not be writable by users. Unset: only the ledger in the job directory.
    store_path: Optional[str] = key(string(allow_none=True), None)
