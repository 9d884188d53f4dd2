"""A holder cut off from its lease writes nothing past its deadline: real trainers
(`python -m jaxckpt.main`) against moto's S3 server, each through its own HTTP proxy on loopback,
so every request is known by its writer. The holder's lease requests are held at its proxy while
its other requests go through; past `last renewal + TTL - margin` it writes and deletes no
object, before anyone could take the lease over. (The SIGSTOP/SIGCONT takeover itself is in
`test_remote_fenced.py`.)
"""

import json
import signal
import subprocess
import time

from condition_proxy import ConditionProxy
from conftest import committed_steps, events_of, jaxckpt_cli, wait_for

from jaxckpt.checkpoint.remote import Store
from jaxckpt.records.runlog import read_status

TTL = 6
FLAGS = ('--config.train.steps=100000', '--checkpoint_every=10', '--keep=2',
         f'--remote_lease_secs={TTL}')
WRITES = ('PUT', 'POST', 'DELETE')


def _start(trainer, workdir, url: str, proxy: ConditionProxy, *flags: str) -> subprocess.Popen:
  return trainer.start(
      workdir, *FLAGS, f'--remote={url}', *flags, env={'AWS_ENDPOINT_URL': proxy.endpoint})


def _stop(proc: subprocess.Popen) -> str:
  if proc.poll() is None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
  return proc.communicate(timeout=60)[0]


def test_a_holder_cut_off_from_its_lease_stops_writing_before_it_can_be_taken_over(
    trainer, s3_server, tmp_path):
  """A's requests for the lease go unanswered while the rest go through (a partial outage):
  its renewals fail, it trains and checkpoints on, and from its deadline (its last renewal +
  TTL - margin) it writes and deletes nothing, so B, which may take over only after the TTL,
  never shares the prefix with it."""
  from jaxckpt.checkpoint.remote.lease import margin_secs
  url = s3_server.bucket()
  store = Store(url)
  to_a, to_b = ConditionProxy(s3_server.endpoint), ConditionProxy(s3_server.endpoint)
  a_dir, b_dir = tmp_path / 'a', tmp_path / 'b'
  a = _start(trainer, a_dir, url, to_a, '--keep=0')  # its uploads never lose their step
  b = None
  try:
    wait_for(lambda: events_of(a_dir, 'uploaded'), a)
    to_a.hold('/LEASE')  # from now on no renewal of A's gets an answer (nor reaches the store)
    holder = json.loads(store.read('LEASE'))
    wait_for(lambda: time.time() - holder['renewed_at'] > TTL + 0.5, a)
    b = _start(trainer, b_dir, url, to_b)
    wait_for(lambda: len(events_of(b_dir, 'uploaded')) >= 2, b)
    at = max(committed_steps(a_dir))
    wait_for(lambda: max(committed_steps(a_dir)) >= at + 30, a)  # A trained and committed on
    renewed = [r.began for r in to_a.requests if r.path.endswith('/LEASE') and r.status == 200]
    deadline = max(renewed) + TTL - margin_secs(TTL)
    late = [
        r for r in to_a.requests
        if r.began >= deadline and r.method in WRITES and 200 <= r.status < 300
    ]
    assert not late, f'A wrote or deleted past its deadline: {late[:10]}'
    assert 'E-STORE-007' in (read_status(a_dir)['remote_error'] or '')
  finally:
    out_a = _stop(a)
    if b is not None:
      b.send_signal(signal.SIGTERM)
      out_b = b.communicate(timeout=120)[0]
      assert b.returncode == 128 + signal.SIGTERM, out_b
    to_a.stop()
    to_b.stop()
  assert 'E-STORE-007' in out_a
  v = jaxckpt_cli('verify', url)
  assert v.returncode == 0, v.stdout + v.stderr
