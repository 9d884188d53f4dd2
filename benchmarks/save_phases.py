"""Where a jaxckpt save (or restore) spends its wall time, phase by phase.

    with SavePhases() as phases:
        mgr.save(step, state); mgr.wait_until_finished()
    phases.seconds  # {"stage (host copy)": 0.09, "orbax save": 2.1, "crc32 read": 0.4, ...}

While active it wraps, by monkeypatching module attributes (jaxckpt itself is not changed), the
functions a save goes through: the host copy (`HostStager.stage`), orbax's `Checkpointer.save`/
`restore` or jaxckpt's raw store (`rawstore.write`/`read`, storage='raw'), the checksum pass
(`manifest.file_table`, split into reading+CRC-32 and the per-file fsync), directory fsyncs and the durable writes of run_state.json and manifest.json. Times are
exclusive (a phase's time excludes the phases nested in it), so they add up; "other" in
`breakdown` is the remainder of the measured wall time (Python around the calls, renames,
thread hand-off). The wrappers cost microseconds per call, nothing next to what they time.
"""

import collections
import functools
import os
import threading
import time

from jaxckpt.checkpoint import atomic, layout, manager, manifest, orbaxstore, staging

try:  # jaxckpt's own flat-file array store (storage='raw'), where this jaxckpt has one
  from jaxckpt.checkpoint import rawstore
except ImportError:
  rawstore = None

STAGE = 'stage (host copy)'
ORBAX_SAVE = 'orbax save (tensorstore write)'
ORBAX_RESTORE = 'orbax restore (tensorstore read)'
FILE_TABLE = 'checksum pass: walk + other'
CRC_READ = 'checksum pass: read + crc32'
FSYNC_FILES = 'checksum pass: fsync files'
FSYNC_DIRS = 'fsync directories'
JSON = 'run_state.json + manifest.json (durable writes)'
RAW_WRITE = 'raw store write (pwrite + crc32 + fsync)'
RAW_READ = 'raw store read (+ crc32)'


class SavePhases:
  """Context manager accumulating exclusive seconds per phase, from any thread."""

  def __init__(self):
    self.seconds = collections.defaultdict(float)
    self.calls = collections.Counter()
    self._lock = threading.Lock()
    self._local = threading.local()  # per-thread stack of child-time accumulators
    self._saved = []

  # -- timing ----------------------------------------------------------------------------
  def _enter(self):
    stack = getattr(self._local, 'stack', None)
    if stack is None:
      stack = self._local.stack = []
    stack.append(0.0)
    return time.perf_counter()

  def _exit(self, phase, start):
    elapsed = time.perf_counter() - start
    stack = self._local.stack
    children = stack.pop()
    if stack:
      stack[-1] += elapsed  # the parent excludes this from its own time
    with self._lock:
      self.seconds[phase] += elapsed - children
      self.calls[phase] += 1

  def timed(self, phase, fn):

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      start = self._enter()
      try:
        return fn(*args, **kwargs)
      finally:
        self._exit(phase, start)

    return wrapper

  # -- patching --------------------------------------------------------------------------
  def _patch(self, owner, name, value):
    self._saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)

  def __enter__(self):
    phases = self
    original_checkpointer = orbaxstore._checkpointer

    class TimedCheckpointer:

      def __init__(self, inner):
        self._inner = inner
        self.save = phases.timed(ORBAX_SAVE, inner.save)
        self.restore = phases.timed(ORBAX_RESTORE, inner.restore)

      def __getattr__(self, name):
        return getattr(self._inner, name)

    def crc32_file(path, *, fsync=False):
      # manifest.crc32_file, timed in two parts; same reads, same result, same fsync.
      start = self._enter()
      try:
        crc, size = 0, 0
        buf = memoryview(bytearray(manifest._CHUNK))
        with open(path, 'rb', buffering=0) as f:
          while n := f.readinto(buf):
            crc = manifest.crc32(buf[:n], crc)
            size += n
          if fsync:
            inner = self._enter()
            try:
              os.fsync(f.fileno())
            finally:
              self._exit(FSYNC_FILES, inner)
        return size, f'{crc:08x}'
      finally:
        self._exit(CRC_READ, start)

    self._patch(staging.HostStager, 'stage', self.timed(STAGE, staging.HostStager.stage))
    self._patch(manager, '_checkpointer', lambda: TimedCheckpointer(original_checkpointer()))
    self._patch(manifest, 'file_table', self.timed(FILE_TABLE, manifest.file_table))
    self._patch(manifest, 'crc32_file', crc32_file)
    self._patch(layout, 'fsync_dir', self.timed(FSYNC_DIRS, atomic.fsync_dir))
    # Both: run_state.json goes through write_json_durably -> write_file_durably, the
    # sealed manifest straight through write_file_durably; nesting keeps the sum exact.
    self._patch(layout, 'write_json_durably', self.timed(JSON, atomic.write_json_durably))
    self._patch(layout, 'write_file_durably', self.timed(JSON, atomic.write_file_durably))
    if rawstore is not None:
      self._patch(rawstore, 'write', self.timed(RAW_WRITE, rawstore.write))
      self._patch(rawstore, 'read', self.timed(RAW_READ, rawstore.read))
    return self

  def __exit__(self, *exc):
    for owner, name, value in reversed(self._saved):
      setattr(owner, name, value)
    self._saved.clear()

  def breakdown(self, wall_seconds: float) -> dict:
    """{phase: seconds} plus "other": the part of wall_seconds no wrapper saw."""
    out = {k: v for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
    out['other'] = max(0.0, wall_seconds - sum(self.seconds.values()))
    return out
