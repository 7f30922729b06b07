"""The node agent: a resident, pre-imported copy of the hook pipeline that the slurmd hooks ask to run them.

A hook process spends most of its time starting Python and importing the pipeline (pynvml, SQLite, the checks).
The agent (gpuguard.agent.server) does that once: it is a single-threaded process hosted by `gpuguard watch --agent`
that forks one child per hook request; the child takes the hook's environment, working directory and standard
streams and runs exactly what the hook would have run (gpuguard.cli.hooks.run_hook). The hook scripts run
gpuguard.agent.client, which asks the agent over a root-only Unix socket and, when there is no agent, it does not
answer in time, or it cannot run the hook, runs the hook in its own process: the agent only ever saves time.
"""

# how the agent ends (gpuguard.agent.server), for its supervisor (gpuguard.agent.supervise)
EXIT_STOPPED = 0
EXIT_CONFINED = 3  # not where hooks run as slurmd runs them: not started again
EXIT_BUSY = 4  # another agent serves this state directory: not started again
EXIT_CODE_CHANGED = 5  # gpuguard changed on disk: started again at once, with the new code
EXIT_UNSAFE = 6  # the state directory could let another user replace the socket: not started again
