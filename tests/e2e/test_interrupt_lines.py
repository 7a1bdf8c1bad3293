"""The process boundary of an interrupt (issue 37, item 2): Ctrl-C while `python -m xpar_zoo …` still imports the
package ends it with one line and status 130, no traceback (the in-process cases: tests/unit/test_interrupts.py;
the launched run stopped mid-step: tests/e2e/test_train_launcher.py)."""

import os
import signal
import subprocess
import sys


def test_a_signal_while_the_command_imports_is_one_line_and_no_traceback():
    """The process boundary: Ctrl-C while `python -m xpar_zoo …` is still importing the package."""
    code = ("import sys, time; sys.orig_argv = ['python', '-m', 'xpar_zoo', 'train']\n"
            "from xpar_zoo import interrupts\n"
            "interrupts.quiet_while_importing(); print('importing', flush=True); time.sleep(60)\n")
    env = {**os.environ, "RANK": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline() == "importing\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err == ("xpar-zoo: SIGINT while starting: stopped before anything was loaded or written (rerun the "
                   "command to start again)\n")
