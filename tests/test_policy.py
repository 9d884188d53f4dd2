from jaxckpt.checkpoint import RetentionPolicy, SavePolicy


def test_step_cadence():
  policy = SavePolicy(every_steps=10)
  assert [s for s in range(1, 31) if policy.due(s, 0.0, 0, 0.0)] == [10, 20, 30]
  assert not policy.due(10, 0.0, last_save_step=10, last_save_time=0.0)


def test_time_cadence_counts_from_the_last_save():
  policy = SavePolicy(every_secs=60)
  assert not policy.due(3, now=159.0, last_save_step=1, last_save_time=100.0)
  assert policy.due(3, now=160.0, last_save_step=1, last_save_time=100.0)


def test_off_by_default():
  assert not any(SavePolicy().due(s, 1e9, 0, 0.0) for s in range(1, 100))


def test_retention():
  assert RetentionPolicy(keep=3).to_delete(range(1, 6)) == [1, 2]
  assert RetentionPolicy(keep=1, keep_every=2).to_delete(range(1, 6)) == [1, 3]
  assert RetentionPolicy(keep=0).to_delete(range(1, 6)) == []
  assert RetentionPolicy(keep=2).to_delete([]) == []


def test_keep_best_keeps_the_lowest_metric_beside_the_other_rules():
  policy = RetentionPolicy(keep=1, keep_every=0, keep_best=2)
  steps = [10, 20, 30, 40, 50]
  loss = {10: 3.0, 20: 2.5, 30: 2.7, 40: 2.4}  # 50 has none: never counts as best
  assert policy.to_delete(steps, loss) == [10, 30]  # kept: 50 (newest), 40 and 20 (best)
  assert policy.to_delete(steps, {}) == [10, 20, 30, 40]  # nothing scored: newest only
  assert policy.to_delete(steps, {10: float('nan'), 20: 1.0}) == [10, 30, 40]  # NaN never best
  assert RetentionPolicy(keep=0, keep_best=1).to_delete(steps, loss) == []  # keep=0 keeps all
