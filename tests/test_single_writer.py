"""One writer per checkpoint directory (`.jaxckpt-writer`): a second writer is refused before it
touches anything, naming the holder; readers are not; a writer that closed, or whose process
died, lets the next one in."""

import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest
from conftest import REPO

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.errors import ArgumentError

OPTS = CheckpointOptions(keep=0, mode='sync')


def test_a_second_writer_is_refused_and_touches_nothing(tmp_path):
  first = CheckpointManager(tmp_path, OPTS)
  first.save(10, {'w': jnp.arange(8.0)}, {'step': 10})
  in_progress = layout.temporary_dir(tmp_path, 20)  # as the first writer's save would leave it
  in_progress.mkdir()
  with pytest.raises(ArgumentError) as e:
    CheckpointManager(tmp_path, OPTS)
  assert e.value.code == 'E-CKPT-020'
  assert f'{tmp_path} has another writer open (pid {os.getpid()} on ' in e.value.what
  assert in_progress.is_dir()  # not removed as a crashed writer's debris
  with CheckpointManager(tmp_path, writer=False) as reader:  # readers take no lock
    assert reader.all_steps() == [10]
  first.close()
  with CheckpointManager(tmp_path, OPTS) as again:  # closed: the next writer comes in
    assert again.removed_debris == [in_progress] and again.all_steps() == [10]
  assert os.listdir(tmp_path) == ['step_00000010']  # the lock's file goes with its writer


def test_a_writer_in_another_process_holds_it_until_that_process_dies(tmp_path):
  code = ('import sys; from jaxckpt.checkpoint import CheckpointManager; '
          f'm = CheckpointManager({str(tmp_path)!r}); print("held", flush=True); sys.stdin.read()')
  holder = subprocess.Popen([sys.executable, '-c', code],
                            cwd=REPO,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    with pytest.raises(ArgumentError, match=f'pid {holder.pid} on '):
      CheckpointManager(tmp_path, OPTS)
  finally:
    holder.send_signal(signal.SIGKILL)  # a crash: nothing is left to clean up by hand
    holder.wait(timeout=60)
  with CheckpointManager(tmp_path, OPTS) as mgr:
    mgr.save(1, {'w': jnp.zeros(4)}, {'step': 1})
  assert layout.committed_steps(tmp_path).keys() == {1}
