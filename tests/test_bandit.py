import pytest

from configs import default
from jaxckpt.errors import ConfigError
from jaxckpt.model import bandit


def cfg(**overrides):
  c = default.get_config().bandit
  c.update(overrides)
  return c


@pytest.mark.parametrize('log_weights', [[0, 0, 0], [50, 0, 0], [0, -50, 3], [9, 8, -7, 0.5]])
def test_probabilities_respect_floors_and_ceilings(log_weights):
  n = len(log_weights)
  p = bandit.probabilities(log_weights, 0.1, [0.1] * n, [0.6] * n)
  assert p.sum() == pytest.approx(1.0)
  assert (p >= 0.1 - 1e-9).all() and (p <= 0.6 + 1e-9).all()


def test_choices_are_a_pure_function_of_seed_step_and_state():
  a = bandit.Bandit(cfg(), ['x', 'y', 'z'], seed=3)
  b = bandit.Bandit(cfg(), ['x', 'y', 'z'], seed=3, state=a.snapshot())
  picks = [a.choose(s) for s in range(200)]
  assert picks == [b.choose(s) for s in range(200)]
  assert set(picks) == {0, 1, 2}


def test_the_improving_source_gains_probability():
  b = bandit.Bandit(cfg(update_every=10, eta=0.2), ['stuck', 'learning'], seed=0)
  loss = {0: 3.0, 1: 3.0}
  for step in range(1, 401):
    arm = b.choose(step)
    if arm == 1:
      loss[1] *= 0.99
    b.record(step, arm, loss[arm])
  p = b.probabilities()
  assert p[1] > 0.8 and p[0] >= 0.05 - 1e-9


def test_resume_mid_window_continues_identically():
  """Pending (not yet applied) rewards travel in the snapshot."""
  straight = bandit.Bandit(cfg(), ['a', 'b'], seed=1)
  for step in range(1, 26):
    straight.record(step, straight.choose(step), 3.0 - 0.01 * step)
  resumed = bandit.Bandit(cfg(), ['a', 'b'], seed=1, state=straight.snapshot())
  for step in range(26, 61):
    for b in (straight, resumed):
      b.record(step, b.choose(step), 3.0 - 0.01 * step)
  assert straight.snapshot() == resumed.snapshot()


def test_reconcile_drops_zombie_arms_and_adds_new_ones():
  b = bandit.Bandit(cfg(), ['a', 'gone', 'b'], seed=0)
  for step in range(1, 15):
    b.record(step, b.choose(step), 2.0)
  state, dropped, added, reset = bandit.reconcile(b.snapshot(), ['a', 'b', 'new'], phase=0)
  assert (dropped, added, reset) == (['gone'], ['new'], False)
  assert state['arms'] == ['a', 'b', 'new']
  assert all(arm in (0, 1) for arm, _ in state['pending'])
  fresh, _, _, reset = bandit.reconcile(b.snapshot(), ['a', 'b'], phase=1)
  assert reset and fresh['pulls'] == [0, 0] and fresh['phase'] == 1


def test_impossible_bounds_are_a_config_error():
  with pytest.raises(ConfigError, match='E-CONFIG-005'):
    bandit.validate(cfg(floor=0.6), ['a', 'b'])
  bandit.validate(cfg(), ['only'])  # one source: bounds do not apply


def test_a_snapshot_keeps_its_values_while_the_bandit_goes_on():
  """An async checkpoint holds the snapshot while later steps record into the live bandit."""
  b = bandit.Bandit(cfg(update_every=2), ['x', 'y'], seed=0)
  for step in range(1, 5):
    b.record(step, step % 2, 3.0 - 0.1 * step)
  snap = b.snapshot()
  frozen = repr(snap)
  for step in range(5, 9):
    b.record(step, step % 2, 3.0 - 0.1 * step)
  assert repr(snap) == frozen and sum(snap['pulls']) == 4


def test_reconcile_lays_the_arms_out_in_the_sources_order():
  """`choose` returns a position in the dataset's sources: a new source that sorts before the
  others must not shift the saved weights and counts onto other sources."""
  b = bandit.Bandit(cfg(), ['main', 'web'], seed=0)
  for step in range(1, 15):
    b.record(step, b.choose(step), 2.0)
  saved = b.snapshot()
  state, _, added, _ = bandit.reconcile(saved, ['books', 'main', 'web'], phase=0)
  assert added == ['books'] and state['arms'] == ['books', 'main', 'web']
  for key in ('log_weights', 'pulls', 'ema_reward', 'ema_loss'):
    assert state[key][1:] == list(saved[key]), key
  assert state['pulls'][0] == 0
  assert [a for a, _ in state['pending']] == [a + 1 for a, _ in saved['pending']]
  # The same sources in another order: each keeps its own values.
  swapped, _, _, _ = bandit.reconcile(saved, ['web', 'main'], phase=0)
  assert swapped['pulls'] == [saved['pulls'][1], saved['pulls'][0]]


@pytest.mark.parametrize('field, value',
                         [('eta', float('nan')), ('eta', -5.0), ('eta', float('inf')),
                          ('ema', float('nan')), ('ema', 3.0), ('ema', 1.0)])
def test_a_learning_rate_or_smoothing_that_breaks_the_floors_is_a_config_error(field, value):
  # eta=nan used to turn every probability into NaN: a 5% floor got 1.4% of the draws.
  with pytest.raises(ConfigError, match='E-CONFIG-005: bandit.eta=.*bandit.ema='):
    bandit.validate(cfg(**{field: value}), ['a', 'b'])
  bandit.validate(cfg(eta=0.0, ema=0.0), ['a', 'b'])  # off, and no smoothing: fine
