from jaxckpt.checkpoint import RetentionPolicy, SavePolicy
from jaxckpt.checkpoint.policy import manifest_fields, pins


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


def test_a_replay_never_deletes_the_step_it_just_committed():
  # --keep=1 --keep_every=1000 over {1000, 2000, 2500 (damaged, passed over)}: resumed from 2000,
  # each replayed commit is the newest of this history; 2500 belongs to an abandoned one.
  policy = RetentionPolicy(keep=1, keep_every=1000)
  assert policy.to_delete([1000, 2000, 2100, 2500], newest=2100) == []
  assert policy.to_delete([1000, 2000, 2100, 2200, 2500], newest=2200) == [2100]
  assert policy.to_delete([1000, 2000, 2400, 2500], newest=2400) == []
  # Nothing numbered above the step just committed is deleted, nor counted among the newest.
  assert RetentionPolicy(keep=2).to_delete([1, 2, 3, 7, 8, 9], newest=3) == [1]
  assert RetentionPolicy(keep=1).to_delete([5, 6], newest=9) == [5]  # 9 gone: 6 stays newest
  assert RetentionPolicy(keep=1).to_delete([1, 2, 3], newest=2) == [1]


def test_a_step_its_own_manifest_keeps_is_never_deleted_whatever_the_flags():
  written = RetentionPolicy(keep=1, keep_every=10)
  records = {s: {'retention': written.record(s, 'loss')} for s in (10, 15, 20, 25)}
  assert records[20]['retention'] == {'kept': ['keep_every'], 'keep_every': 10}
  assert records[25]['retention'] == {'kept': [], 'keep_every': 10}
  pinned = pins(records)
  assert pinned == {10: ['keep_every'], 20: ['keep_every']}
  later = RetentionPolicy(keep=1)  # continued without --keep_every
  assert later.to_delete([10, 15, 20, 25, 30], pinned=pinned) == [15, 25]
  assert later.to_delete([10, 15, 20, 25, 30]) == [10, 15, 20, 25]  # what the flags alone do


def test_best_is_kept_while_among_the_best_its_manifest_names():
  best2 = RetentionPolicy(keep=1, keep_best=2).record
  loss = {10: 3.0, 20: 2.5, 30: 2.7, 40: float('nan'), 50: None}
  records = {s: {'retention': best2(s, 'loss'), 'metrics': {'loss': v}} for s, v in loss.items()}
  assert records[10]['retention'] == {'kept': [], 'best': {'metric': 'loss', 'among': 2}}
  assert pins(records) == {20: ['best'], 30: ['best']}  # NaN and no value: never best
  # A better checkpoint of the same contest pushes the worst of them out.
  records[60] = {'retention': best2(60, 'loss'), 'metrics': {'loss': 1.0}}
  assert pins(records) == {20: ['best'], 60: ['best']}
  # A run without --keep_best takes no part: what the earlier contest keeps stays kept.
  records[70] = {'retention': RetentionPolicy(keep=1).record(70, 'loss'), 'metrics': {'loss': 0.1}}
  assert pins(records) == {20: ['best'], 60: ['best']}
  assert RetentionPolicy(keep=1).to_delete(
      sorted(records), pinned=pins(records)) == [10, 30, 40, 50]


def test_an_unreadable_manifest_may_say_kept_so_it_is_kept():
  assert pins({10: None, 20: {'retention': None, 'metrics': None}, 30: {}}) == {10: ['unreadable']}
  assert manifest_fields({'step': 1, 'retention': {'kept': []},
                          'tensors': []}) == {'retention': {'kept': []}, 'metrics': None}
