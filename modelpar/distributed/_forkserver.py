"""Imported only by the forkserver (``LocalCluster``'s preload list): keep it, and ranks being born, out of a job's signals.

Slurm (``--signal``), Kubernetes, ``kill -TERM -- -PGID`` and Ctrl-C may signal every process of a
job, the forkserver too. Its death would close the status pipes through which ``LocalCluster``
sees its ranks alive while the ranks, asked to save a checkpoint, are still at work. A rank
forked from it starts with these signals ignored, so one that arrives while it is still being
born is dropped rather than killing it half-started; ``launch._worker`` then restores the
defaults and the launcher passes the signal on again once the ranks train. The forkserver still
exits on its own once the launcher and every rank are gone.

The launcher starts the forkserver with SIGINT blocked (``launch._blocked``), so a Ctrl-C while
it imports torch waits; ignoring SIGINT here drops it, and only then is it unblocked.
"""

import signal

from modelpar.distributed.lifeline import SCHEDULER_SIGNALS

for _sig in (signal.SIGINT, *SCHEDULER_SIGNALS):
    signal.signal(_sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))
