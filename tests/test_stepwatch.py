"""The step watchdog (`jaxckpt.hosts.stepwatch`): its timeout, and a real hang in one process.

The hang across processes (a peer stopped mid-collective) is in test_multihost_trainer.py.
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from jaxckpt.errors import UsageError
from jaxckpt.hosts import stepwatch

# A process whose main thread never comes back from a call into C (as from a hung collective):
# past the warm-up, it has done step 4 and waits for good inside step 5.
HUNG = """
import sys, threading
from jaxckpt.hosts import stepwatch
from jaxckpt.records.runlog import RunLog
with stepwatch.watching({timeout}, RunLog(sys.argv[1]), 2):
  stepwatch.beat(3)  # the warm-up steps
  stepwatch.beat(4)
  threading.Event().wait()
"""


def test_the_timeout_is_the_flag_or_50_median_steps_and_600_s_at_least_by_default():
  assert stepwatch.timeout(None, [], warming=False) == 600
  assert stepwatch.timeout(None, [1.0, 20.0, 30.0], warming=False) == 1000  # 50 x 20 s
  assert stepwatch.timeout(None, [0.1] * 9, warming=False) == 600
  assert stepwatch.timeout(5, [20.0], warming=False) == 5
  assert stepwatch.timeout(5, [], warming=True) == 600  # the first steps compile


@pytest.mark.parametrize('value', [0, -1])
def test_a_timeout_that_is_not_positive_is_refused(value):
  with pytest.raises(UsageError) as e:
    stepwatch.check(value)
  assert e.value.code == 'E-CONFIG-004' and f'--step_timeout_secs={value}' in e.value.line()


def watched(code: str, workdir) -> tuple[subprocess.CompletedProcess, str]:
  """`code` run in a process of its own with the run's records in `workdir`: (the run, its last
  line on stderr), once it has exited 1 as a hang makes it."""
  r = subprocess.run([sys.executable, '-c', code, str(workdir)],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=60)
  assert r.returncode == 1, r.stderr
  return r, r.stderr.strip().splitlines()[-1]


def test_a_hung_step_in_one_process_logs_every_stack_records_failed_and_exits_1(tmp_path):
  r, line = watched(HUNG.format(timeout=1.0), tmp_path)
  assert line.startswith('jaxckpt: E-DIST-010: step 5 did not complete within 1 s'), line
  assert 'Current thread' in r.stderr and 'in wait' in r.stderr  # the stuck main thread's
  status = json.loads((tmp_path / 'status.json').read_text())
  assert status['state'] == 'failed' and status['error'] == line[len('jaxckpt: '):]
  events = [json.loads(l) for l in (tmp_path / 'events.jsonl').read_text().splitlines()]
  assert events[-1]['event'] == 'failed' and events[-1]['step'] == 4


# An evaluation between steps that never comes back (its bound made a second), then a save that
# takes longer than the step timeout: the save is left to its own bounded waits.
PAUSED = """
import sys, threading, time
from jaxckpt.hosts import stepwatch
from jaxckpt.records.runlog import RunLog
stepwatch.PAUSED_MIN_SECS = 1.0
with stepwatch.watching({timeout}, RunLog(sys.argv[1]), 2):
  stepwatch.beat(3)  # the warm-up steps
  stepwatch.beat(4)
  with stepwatch.paused():  # a save
    time.sleep(3 * {timeout})
  with stepwatch.paused({what!r}):
    threading.Event().wait()
"""


def test_an_evaluation_that_never_returns_ends_the_run_a_long_save_does_not(tmp_path):
  _, line = watched(PAUSED.format(timeout=0.5, what='the evaluation'), tmp_path)
  assert line.startswith('jaxckpt: E-DIST-010: the evaluation after step 4 did not complete '
                         'within 1 s (the last step done: 4; the timeout: max(1 s, the step '
                         'timeout))'), line
  events = [json.loads(l) for l in (tmp_path / 'events.jsonl').read_text().splitlines()]
  assert events[-1]['event'] == 'failed' and events[-1]['step'] == 4
