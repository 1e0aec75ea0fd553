"""Runs `python3 -m strata.launch` for the tests, once more when torch's own rendezvous failed.

torch 1.13's init_process_group("gloo") connects each pair of ranks over
loopback; on a loaded 2-core machine it has been seen to fail there
("gloo/transport/tcp ... Connection refused" or "closed by peer") before
any Strata code ran. Such a run is launched once more; a failure anywhere
else (Strata's part) is never retried.
"""

import subprocess
import sys


def in_torch_rendezvous(output):
    """Whether a rank failed inside torch.distributed's init_process_group
    (its gloo pairs connecting over loopback)."""
    return "init_process_group" in output and "gloo/transport/tcp" in output


def run_launch(argv, env, timeout=300, cwd=None, before_retry=None):
    """`python3 -m strata.launch ARGV` (stdout and stderr together);
    `before_retry()` runs before the second launch (to clear outputs)."""
    cmd = [sys.executable, "-m", "strata.launch", *argv]

    def run():
        return subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)

    r = run()
    if r.returncode != 0 and in_torch_rendezvous(r.stdout):
        if before_retry is not None:
            before_retry()
        r = run()
    return r
