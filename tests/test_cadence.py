"""The automatic cadence (--checkpoint_every=auto) and per-epoch saves: the library's pure
functions, the trainer's bookkeeping with a fake clock, and the real trainer end to end."""

import json
import math
import signal

import pytest
from conftest import committed_steps, events_of, tiny_config, wait_for

from jaxckpt.checkpoint import ArgumentError, cadence
from jaxckpt.checkpoint.options import CommitInfo
from jaxckpt.errors import ConfigError
from jaxckpt.records.runlog import RunLog, read_status
from jaxckpt.train.save_cadence import ENDS, EveryFlagParser, SaveCadence, read_history

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0


# ----------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize('mtbi, minutes', [(24 * HOUR, 116.7), (6 * HOUR, 56.7), (15 * MIN, 9.14)])
def test_daly_examples_of_the_issue(mtbi, minutes):
  assert cadence.daly_interval(5 * MIN, mtbi) / MIN == pytest.approx(minutes, abs=0.05)


def test_daly_is_young_for_small_delta_and_m_past_two_m():
  assert cadence.daly_interval(0.01, 30 * DAY) == pytest.approx(
      math.sqrt(2 * 0.01 * 30 * DAY), rel=1e-3)
  assert cadence.daly_interval(3 * HOUR, HOUR) == HOUR  # δ ≥ 2M: checkpoint every M
  assert cadence.daly_interval(0.0, HOUR) == 0.0  # free checkpoints: as often as the floor allows
  a, b = cadence.daly_interval(1.0, HOUR), cadence.daly_interval(1.0, 4 * HOUR)
  assert b / a == pytest.approx(2.0, rel=0.01)  # ~sqrt(M)


def test_plan_turns_seconds_into_steps_within_the_bounds_and_the_floor():
  free = cadence.plan(1.0, HOUR, step_s=0.5)
  assert free.bound == 'daly' and free.interval_steps == round(
      cadence.daly_interval(1.0, HOUR) / 0.5)
  assert free.interval_s == free.interval_steps * 0.5
  assert free.overhead_pct == pytest.approx(100 / (free.interval_s + 1.0))
  assert free.lost_s == pytest.approx((free.interval_s + 1.0) / 2)
  low = cadence.plan(1.0, HOUR, 0.5, cadence.CadenceOptions(max_secs=20.2))
  assert (low.bound, low.interval_steps, low.interval_s) == ('max', 40, 20.0)  # never above max
  high = cadence.plan(1.0, HOUR, 0.5, cadence.CadenceOptions(min_secs=300.1))
  assert (high.bound, high.interval_steps) == ('min', 601)  # never below min
  slow = cadence.plan(1.0, HOUR, 0.5, durable_s=500.0)
  assert slow.bound == 'durable' and slow.interval_s >= 500.0  # never before the last is durable
  assert slow.lost_s == pytest.approx((slow.interval_s + 1.0) / 2 + 500.0)
  assert cadence.plan(0.0, HOUR, 10.0).interval_steps == 1  # at least one step


def test_mtbi_weighs_the_prior_as_exposure_against_the_runs_own():
  prior = 6 * HOUR
  assert cadence.PRIOR_WEIGHT == 2
  assert cadence.blend_mtbi(prior, 0, 0.0) == prior
  assert cadence.blend_mtbi(prior, 0, 2 * prior) == 2 * prior  # surviving raises M
  assert cadence.blend_mtbi(prior, 2, 60.0) < prior / 1.9  # two kills in a minute: shorter
  # The prior is 2 interruptions in 12 h, pooled with the run's own (Gamma-Poisson): one
  # interruption in 1000 h is M = 337 h (a geometric blend said 33 h, a mean of the two rates).
  assert cadence.blend_mtbi(prior, 1, 1000 * HOUR) == pytest.approx(1012 / 3 * HOUR)
  for history in (10 * MIN, 7 * DAY):
    for n in (1, 3, 10, 100):
      m = cadence.blend_mtbi(prior, n, n * history)
      assert m == pytest.approx((2 * prior + n * history) / (2 + n))
    # As evidence grows, M tends to the run's own rate, however far off the prior was.
    assert cadence.blend_mtbi(prior, 10_000, 10_000 * history) == pytest.approx(history, rel=0.01)
  # Evidence is exposure, not a count: three interruptions in 3 min and in 3000 h differ.
  assert cadence.blend_mtbi(prior, 3, 3 * MIN) < prior / 2 < 100 * HOUR < cadence.blend_mtbi(
      prior, 3, 3000 * HOUR)


def test_delta_is_smoothed_and_slowdowns_are_never_gains():
  assert cadence.smooth(None, 5.0) == 5.0
  assert cadence.smooth(1.0, 11.0) == pytest.approx(1.0 + cadence.DELTA_WEIGHT * 10.0)
  assert cadence.write_slowdown(window_s=1.3, steps=10, step_s=0.1) == pytest.approx(0.3)
  assert cadence.write_slowdown(window_s=0.9, steps=10, step_s=0.1) == 0.0
  assert cadence.prior_delta(2_000_000_000) == pytest.approx(1.0)


@pytest.mark.parametrize('text, seconds', [('6h', 6 * HOUR), ('60s', 60.0), ('30d', 30 * DAY),
                                           ('15m', 15 * MIN), ('1.5h', 1.5 * HOUR), ('90', 90.0),
                                           (45, 45.0), ('2w', 14 * DAY)])
def test_durations(text, seconds):
  assert cadence.parse_duration(text) == seconds


@pytest.mark.parametrize('text', ['6x', '', 'h', '-1h', '0', '0s', 'six hours', True])
def test_bad_durations(text):
  with pytest.raises(ArgumentError, match='E-CONFIG-004'):
    cadence.parse_duration(text)


def test_every_is_steps_or_auto():
  assert [cadence.parse_every(v) for v in ('auto', 'AUTO', '100', 5, 0)
         ] == ['auto'] * 2 + [100, 5, 0]
  for bad in ('sometimes', '-1', -1, 1.5, '1.5', True):
    with pytest.raises(ArgumentError, match='E-CONFIG-004'):
      cadence.parse_every(bad)
  assert EveryFlagParser().parse('auto') == 'auto' and EveryFlagParser().parse('7') == 7
  with pytest.raises(ValueError, match='sometimes'):
    EveryFlagParser().parse('sometimes')


def test_epoch_boundaries():
  assert cadence.epoch_ended(0.99, 1.01, 1) and not cadence.epoch_ended(1.01, 1.9, 1)
  assert not cadence.epoch_ended(0.99, 1.01, 2) and cadence.epoch_ended(1.99, 2.0, 2)
  assert not cadence.epoch_ended(0.0, 5.0, 0)  # off


def test_config_checks_the_cadence_fields():
  from jaxckpt.train.config import cadence_options, checkpoint_options, validate_config
  assert checkpoint_options(tiny_config(**{'checkpoint.every': 'auto'})).every_steps == 0
  assert cadence_options(tiny_config()).mtbi_s == cadence.DEFAULT_MTBI_S == 6 * HOUR
  assert cadence_options(tiny_config(**{'checkpoint.mtbi': '30d'})).mtbi_s == 30 * DAY
  for field, value, names in [('checkpoint.mtbi', '6x', "'6x'"),
                              ('checkpoint.every', 'often', 'often'),
                              ('checkpoint.min_secs', 10.0, 'min_secs'),
                              ('checkpoint.epochs', -1, 'epochs')]:
    config = tiny_config(**{field: value, 'checkpoint.max_secs': 5.0})
    with pytest.raises(ConfigError, match='E-CONFIG-004') as e:
      validate_config(config)
    assert names in str(e.value) and '--checkpoint_' in str(e.value)


def test_a_save_that_cost_nothing_measurable_is_no_checkpoint_at_every_step():
  free = cadence.plan(0.0, 6 * 3600, step_s=0.01)
  assert free.interval_steps == cadence.plan(cadence.MIN_DELTA_S, 6 * 3600, 0.01).interval_steps
  assert free.interval_steps > 100 and free.delta_s == 0.0  # what was measured, said as it is


def test_a_bound_of_1e308_seconds_is_no_bound_not_an_overflow():
  far = cadence.CadenceOptions(min_secs=1e308)
  assert cadence.plan(0.5, 6 * 3600, 1e-300, far).interval_steps == cadence.MAX_STEPS
  assert cadence.plan(0.5, 6 * 3600, 0.1, far).interval_steps == cadence.MAX_STEPS


# --------------------------------------------------------------- the history of a run
def ev(name, t, **fields):
  return {'event': name, 'time': t, **fields}


def test_history_counts_starts_that_did_not_end_cleanly():
  events = [
      ev('started', 0),
      ev('checkpoint', 50),
      ev('finished', 100),  # clean: 100 s
      ev('started', 1000),
      ev('cadence', 1010, delta_s=0.5, delta_measured=True),
      ev('checkpoint', 1020),  # SIGKILLed after 20 s
      ev('lock_taken_over', 5000),  # the next process, before it starts: not the end
      ev('started', 5001),
      ev('interrupted', 5031, signal='SIGTERM'),  # preempted: 30 s
      ev('started', 6000),
      ev('interrupted', 6010, signal='SIGINT'),  # Ctrl-C: not counted
      ev('started', 7000),
      ev('cadence', 7001, delta_s=0.9, delta_measured=False),
      ev('interrupted', 7005, signal='SIGTERM'),
      ev('pivot', 7100),  # a pivot: deliberate
      ev('started', 8000),
      ev('failed', 8002, error='boom'),  # an error to fix: not counted
  ]
  h = read_history(events)
  assert h.interruptions == 2
  assert h.exposure_s == pytest.approx(100 + 20 + 30 + 10 + 5 + 2)
  assert h.delta_s == 0.5  # the last measured δ; a guess (delta_measured False) is not carried
  # The upload's plan (`tier: remote`, after the local one) is not the local save's cost.
  upload = ev('cadence', 8001, delta_s=5.0, delta_measured=True, tier='remote')
  assert read_history(events[:-1] + [upload, events[-1]]).delta_s == 0.5
  # Rows are not trusted: a time or a cost that is no finite number is passed over, not a
  # traceback (a string time) or a cadence poisoned for good (a NaN cost).
  odd = [
      ev('started', 'yesterday'),
      ev('checkpoint', 10),
      ev('started', None),
      ev('cadence', 5, delta_s=float('nan'), delta_measured=True),
      ev('cadence', 6, delta_s='2', delta_measured=True),
      ev('interrupted', 9, signal='SIGTERM')
  ]
  h = read_history(events + odd)
  assert h.delta_s == 0.5 and h.exposure_s == pytest.approx(100 + 20 + 30 + 10 + 5 + 2)
  assert h.interruptions == 4
  assert read_history([]).interruptions == 0 and read_history([]).delta_s is None


def test_history_takes_each_row_as_its_own_starts_by_segment():
  events = [
      ev('started', 0, segment=0),
      ev('checkpoint', 20, segment=0),  # SIGKILLed after 20 s; the machine down till 5000
      ev('remote', 5000, segment=1),  # the next start's, before it says `started`
      ev('fetched', 5001, segment=1),
      ev('upload_started', 5002, segment=1),
      ev('started', 5010, segment=1),
      ev('started', 5012, segment=1),  # it passed over a damaged checkpoint: one start
      ev('finished', 5030, segment=1),
  ]
  h = read_history(events)
  assert (h.interruptions, h.exposure_s) == (1, pytest.approx(20 + 20))


def test_history_counts_a_lost_process_as_an_interruption():
  lost = 'E-DIST-006: process(es) [1] of 2 lost'
  events = [
      ev('started', 0),
      ev('failed', 50, error=f'{lost} (no sign of life for 60 s); ...', lost_process=True),
      ev('started', 100),  # a process that failed with an error of its own: not counted
      ev('failed', 110, error=f'{lost} (it failed); ...', lost_process=False),
      ev('started', 200),
      ev('failed', 201, error='E-CKPT-001: ...'),
  ]
  h = read_history(events)
  assert h.interruptions == 1 and h.exposure_s == pytest.approx(50 + 10 + 1)


# ------------------------------------------------------- the trainer's side, fake clock
class Clock:

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def commit(step, seconds_to_commit=0.05):
  return CommitInfo(step, None, 0, 0.0, seconds_to_commit, ())


def auto_cadence(tmp_path, **fields):
  config = tiny_config(**{'checkpoint.every': 'auto', **fields})
  from jaxckpt.train.config import cadence_options
  clock = Clock()
  runlog = RunLog(tmp_path)
  c = SaveCadence(
      config,
      runlog,
      cadence_options(config),
      epoch=lambda step: step / 100,
      state=lambda: {},
      clock=clock)
  return c, clock


def run_steps(c, clock, start, stop, step_s=0.1):
  """Steps start+1..stop at step_s each; the steps where `due` asked for a save."""
  due = []
  for step in range(start + 1, stop + 1):
    clock.t += step_s
    c.after_step(step, None)
    if c.due(step):
      due.append(step)
  return due


def save(c, clock, step, blocked_s=0.5):
  """The loop's calls around a save of `step` (whatever asked for it)."""
  c.saving(step)
  clock.t += blocked_s
  c.saved(step)


def test_never_starts_a_checkpoint_before_the_previous_one_is_durable(tmp_path):
  c, clock = auto_cadence(tmp_path, **{'checkpoint.mtbi': '1h', 'checkpoint.min_secs': 2.0})
  c.start(0)
  run_steps(c, clock, 0, 21)  # calibrated: 0.1 s a step
  n = c.plan.interval_steps
  assert c.plan.bound == 'min' and n in (20, 21)  # the guessed δ (no state) is 0: the floor
  save(c, clock, 21)
  assert run_steps(c, clock, 21, 21 + 3 * n) == []  # not committed: never due, however long
  c.committed(commit(21))
  assert run_steps(c, clock, 21 + 3 * n, 22 + 3 * n) == [22 + 3 * n]  # durable, past the interval


def test_delta_is_blocked_time_plus_the_slowdown_of_steps_during_the_write(tmp_path):
  c, clock = auto_cadence(tmp_path, **{'checkpoint.mtbi': '1h'})
  c.start(0)
  run_steps(c, clock, 0, 25)
  for first, measured in ((25, False), (60, True)):  # the first save of a start: not measured
    save(c, clock, first, blocked_s=0.4)
    run_steps(c, clock, first, first + 10, step_s=0.15)  # 10 steps, each 0.05 s slower
    c.committed(commit(first, seconds_to_commit=1.2))
    run_steps(c, clock, first + 10, first + 11)  # the first boundary after the commit
    assert c.delta_measured == measured
    if not measured:
      run_steps(c, clock, first + 11, 60)
  assert c.delta_s == pytest.approx(0.4 + 10 * 0.05)
  event = events_of(tmp_path, 'cadence')[-1]
  assert event['blocked_s'] == pytest.approx(0.4) and event['slowdown_s'] == pytest.approx(0.5)
  assert event['durable_s'] == 1.2 and event['step_s'] == pytest.approx(0.1)
  daly_steps = cadence.daly_interval(0.9, event['mtbi_s']) / 0.1
  assert abs(event['interval_steps'] - daly_steps) <= 1 and event['bound'] == 'daly'
  assert read_status(tmp_path)['cadence']['interval_steps'] == event['interval_steps']


def test_with_uploads_delta_and_durable_s_run_to_the_upload_and_step_time_leaves_it_out(tmp_path):
  c, clock = auto_cadence(tmp_path, **{'checkpoint.mtbi': '1h'})
  uploaded = [True]
  committed = c.durable
  c.durable = lambda: committed() and uploaded[0]  # as `RemoteRun.chain` does
  c.start(0)
  run_steps(c, clock, 0, 25)
  save(c, clock, 25)  # the first save of a start: not measured
  c.committed(commit(25))
  run_steps(c, clock, 25, 60)
  save(c, clock, 60, blocked_s=0.4)
  uploaded[0] = False
  run_steps(c, clock, 60, 70, step_s=0.15)  # the write: each step 0.05 s slower
  c.committed(commit(60, seconds_to_commit=1.2))
  assert run_steps(c, clock, 70, 80, step_s=0.15) == []  # the upload: slower still, never due
  measured = [e for e in events_of(tmp_path, 'cadence') if 'slowdown_s' in e]
  assert measured == []  # committed, not yet durable: the save is not over
  uploaded[0] = True
  run_steps(c, clock, 80, 81)  # the first boundary after the upload
  event = events_of(tmp_path, 'cadence')[-1]
  assert event['slowdown_s'] == pytest.approx(20 * 0.05) and c.delta_s == pytest.approx(1.4)
  assert event['durable_s'] == pytest.approx(0.4 + 20 * 0.15 + 0.1)  # save start to uploaded
  run_steps(c, clock, 81, 120)
  save(c, clock, 120)
  assert c.step_s == pytest.approx(0.1)  # timed between writes: no upload in those steps
  assert event['interval_s'] >= event['durable_s']


def test_any_save_restarts_the_interval_and_epochs_save_too(tmp_path):
  c, clock = auto_cadence(
      tmp_path, **{'checkpoint.mtbi': '1h', 'checkpoint.min_secs': 1.0, 'checkpoint.epochs': 1})
  c.start(0)
  run_steps(c, clock, 0, 21)
  n = c.plan.interval_steps
  assert n in (10, 11)
  save(c, clock, 95)  # SIGUSR1, --checkpoint_secs, an epoch: the interval counts from here
  c.committed(commit(95))
  assert run_steps(c, clock, 95, 100) == [100]  # epoch 1 ends at step 100 (epoch = step / 100)
  assert run_steps(c, clock, 100, 94 + n) == []
  assert run_steps(c, clock, 94 + n, 95 + n) == [95 + n]


def test_a_save_before_the_step_time_is_measured_still_leads_to_a_plan(tmp_path):
  c, clock = auto_cadence(tmp_path, **{'checkpoint.mtbi': '1h'})
  c.start(0)
  run_steps(c, clock, 0, 5)  # SIGUSR1 at step 5, before the 20 steps of calibration
  save(c, clock, 5)
  c.committed(commit(5))
  run_steps(c, clock, 5, 6)
  assert c.plan is not None and c.step_s == pytest.approx(0.1)


# ------------------------------------------------------------------------ end to end
AUTO = ('--checkpoint_every=auto', '--config.train.log_every=50')


def test_mtbi_60s_checkpoints_often(trainer, tmp_path):
  r = trainer.train(tmp_path, *AUTO, '--checkpoint_mtbi=60s', '--config.train.steps=500')
  assert r.returncode == 0, r.stderr
  saves = [e['step'] for e in events_of(tmp_path, 'checkpoint')]
  plans = events_of(tmp_path, 'cadence')
  assert plans[0]['delta_measured'] is False and plans[-1]['delta_measured'] is True
  measured = next(p['step'] for p in plans if p['delta_measured'])
  # Seconds apart, on the guess and then on the measured cost, not only at the end.
  assert len(saves) >= 4 and saves[-1] == 500 and any(measured < s < 500 for s in saves), saves
  assert all(p['prior_mtbi_s'] == 60.0 and p['interval_s'] < 60 for p in plans)
  for a, b in zip(saves, saves[1:-1]):
    assert b - a >= min(p['interval_steps'] for p in plans)  # no save before the interval
  assert read_status(tmp_path)['cadence']['interval_steps'] == plans[-1]['interval_steps']
  assert 'ckpt every' in r.stderr and 'cadence: a checkpoint every' in r.stderr


def test_mtbi_30d_writes_only_the_final_checkpoint(trainer, tmp_path):
  # The plan comes from the step time and δ, not from the run's length: 100 steps show it.
  r = trainer.train(tmp_path, *AUTO, '--checkpoint_mtbi=30d', '--config.train.steps=100')
  assert r.returncode == 0, r.stderr
  assert [e['step'] for e in events_of(tmp_path, 'checkpoint')] == [100]
  plans = events_of(tmp_path, 'cadence')
  assert plans and all(p['interval_s'] > 30 and p['interval_steps'] > 300 for p in plans)


def test_two_sigkills_in_a_row_shorten_the_interval(trainer, tmp_path):
  flags = (*AUTO, '--checkpoint_mtbi=30d', '--config.train.steps=100000')
  for kills in range(3):
    proc = trainer.start(tmp_path, *flags)
    wait_for(lambda: len(events_of(tmp_path, 'cadence')) > kills, proc)  # this start's plan
    proc.kill()
    proc.wait(timeout=60)
  plans = events_of(tmp_path, 'cadence')
  assert [p['interruptions'] for p in plans] == [0, 1, 2]
  assert plans[0]['mtbi_s'] > plans[1]['mtbi_s'] > plans[2]['mtbi_s']
  # Two starts killed within seconds, against a prior of 2 interruptions in 60 days: M halves.
  assert plans[2]['mtbi_s'] == pytest.approx((2 * 30 * DAY + plans[2]['exposure_s']) / 4)
  assert plans[0]['interval_s'] > plans[1]['interval_s'] > plans[2]['interval_s']


def test_checkpoint_epochs_saves_where_an_epoch_ends(trainer, tmp_path):
  from jaxckpt.model import data
  dataset = data.from_config(tiny_config())
  ends = [
      s for s in range(1, 141) if math.floor(dataset.epoch(s)) > math.floor(dataset.epoch(s - 1))
  ]
  assert len(ends) == 2  # tiny: ~65 steps an epoch
  r = trainer.train(tmp_path, '--checkpoint_every=0', '--checkpoint_epochs=1', '--keep=0',
                    '--config.train.steps=140')
  assert r.returncode == 0, r.stderr
  assert committed_steps(tmp_path) == ends + [140]


def test_the_remote_records_of_the_last_checkpoint_hold_the_runs_end(trainer, s3_server, tmp_path):
  """A fresh machine reads the run's history from the remote: a finished run or a Ctrl-C there
  must not look like a start that was killed (the records of a checkpoint are taken before)."""
  from jaxckpt.checkpoint.remote import Store, objects
  url = s3_server.bucket()
  store = Store(url)

  def remote_history():  # what a fresh machine downloads with the newest checkpoint
    step = max(objects.committed(store))
    down = tmp_path / f'down{step}'
    down.mkdir()
    _, records = objects.download(store, step, down)
    events = [json.loads(line) for line in records['events.jsonl'].decode().splitlines()]
    return step, [(e['event'], e.get('signal')) for e in events if e['event'] in ENDS], events

  r = trainer.train(tmp_path / 'vm1', '--config.train.steps=40', '--checkpoint_every=20',
                    f'--remote={url}')
  assert r.returncode == 0, r.stderr
  step, ends, events = remote_history()
  assert step == 40 and ends == [('finished', None)]
  assert read_history(events).interruptions == 0
  vm2 = tmp_path / 'vm2'  # a fresh machine continues it from the remote; Ctrl-C
  proc = trainer.start(vm2, '--config.train.steps=100000', '--checkpoint_every=1000',
                       f'--remote={url}', '--config.train.log_every=10')
  wait_for(lambda: (vm2 / 'status.json').exists() and read_status(vm2).get('step', 0) >= 60, proc)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT, out
  step, ends, events = remote_history()
  assert step > 40 and ends == [('finished', None), ('interrupted', 'SIGINT')], (step, ends)
  assert read_history(events).interruptions == 0


@pytest.mark.parametrize('flag, code, names', [
    ('--checkpoint_every=sometimes', 'E-USAGE-001', 'sometimes'),
    ('--checkpoint_mtbi=6x', 'E-CONFIG-004', "'6x'"),
    ('--checkpoint_mtbi=-3h', 'E-CONFIG-004', '-3h'),
])
def test_bad_cadence_flags_are_one_line_exit_2(trainer, tmp_path, flag, code, names):
  r = trainer.train(tmp_path, flag)
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith(f'jaxckpt: {code}: ') and names in line, line
  assert not committed_steps(tmp_path)
