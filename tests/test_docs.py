"""Every fenced block of README.md and docs/*.md runs as written, and the docs site builds.

The contract a page is written to (docs/development.md repeats it for authors):
- ```bash blocks run with bash, one logical command at a time (a trailing `\\`, an open quote,
  a heredoc or a `for ... done` continue a command): the first command that exits non-zero ends
  the block, and the test names the page, the line and the command. `set -o pipefail` holds.
- ```python blocks run as scripts (`python BLOCK.py`).
- Blocks run in page order, in one scratch directory per page that holds a copy of the repo's
  `configs/` (so `--config=configs/tiny.py` works); files a block writes are there for the next
  block, shell variables are not. `python` and `jaxckpt` are this environment's (its bin first on
  PATH), with the tests' shared JAX compile cache and one CPU device (conftest.subprocess_env).
- ```text and ```console blocks are output, never run; any other info string fails the tests.
- A block whose first line is `# not run by the tests: REASON` is skipped, and reported as a
  skipped test with the reason. A block whose first line is `# exits N` must exit with N (the
  code of the command that ended it, 0 when all succeeded).
- A leading `pip install ... &&` is stripped from a command and a command that is only a
  `pip install` is not run (the environment is installed already). The test suite itself
  (`python -m pytest`) is never run from a page: a block with it must be marked not run.
- When a block ends, whatever it left running in the background is killed.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO, subprocess_env

DOCS = REPO / 'docs'
UNCLOSED = '(never closed)'
RUN = {'bash', 'python'}
OUTPUT = {'text', 'console'}
NOT_RUN = re.compile(r'#\s*not run by the tests:\s*(.*)$')
EXITS = re.compile(r'#\s*exits\s+(\d+)\s*$')
FENCE = re.compile(r'^(\s*)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$')
PIP = re.compile(r'^\s*(?:python3? -m )?pip3? install\b.*?&&\s*', re.S)
PIP_ONLY = re.compile(r'^\s*(?:python3? -m )?pip3? install\b[^&|;]*$', re.S)
PYTEST = re.compile(r'(^|[\s;&|(])(python3? -m pytest|pytest)\b')
BLOCK_TIMEOUT = 300  # seconds; a block past it fails, naming the command it was running


@dataclass
class Block:
  page: str  # 'README.md' or 'docs/x.md'
  line: int  # the line of the opening fence, 1-based
  info: str  # the info string, lowercased: 'bash', 'python', 'text', ...
  body: list[str]  # the lines between the fences, the fence's indentation removed

  @property
  def where(self) -> str:
    return f'{self.page}:{self.line}'

  @property
  def skip_reason(self) -> str | None:
    m = NOT_RUN.match(self.body[0].strip()) if self.body else None
    return m.group(1).strip() if m else None

  @property
  def expected_exit(self) -> int:
    m = EXITS.match(self.body[0].strip()) if self.body else None
    return int(m.group(1)) if m else 0


def nav_pages() -> list[str]:
  """The docs pages in mkdocs.yml's nav order, as paths relative to docs/."""
  nav = yaml.safe_load((REPO / 'mkdocs.yml').read_text())['nav']
  pages = []

  def walk(entries):
    for entry in entries:
      value = next(iter(entry.values())) if isinstance(entry, dict) else entry
      if isinstance(value, list):
        walk(value)
      else:
        pages.append(value)

  walk(nav)
  return pages


def pages() -> list[str]:
  """README.md, then every docs page in nav order, then any page the nav lacks."""
  listed = [f'docs/{p}' for p in nav_pages() if (DOCS / p).is_file()]
  rest = sorted(
      str(p.relative_to(REPO))
      for p in DOCS.rglob('*.md')
      if str(p.relative_to(REPO)) not in listed)
  return ['README.md', *listed, *rest]


def blocks(page: str) -> list[Block]:
  """The fenced blocks of `page`, in order (a fence inside a list item counts too)."""
  out, current, fence, indent = [], None, '', ''
  for n, line in enumerate((REPO / page).read_text().splitlines(), 1):
    if current is None:
      m = FENCE.match(line)
      if m:
        indent, fence = m.group(1), m.group(2)
        current = Block(page, n, m.group(3).lower(), [])
    elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
      out.append(current)
      current = None
    else:
      current.body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
  if current is not None:  # test_every_block_is_run_output_or_marked names it
    out.append(Block(page, current.line, UNCLOSED, current.body))
  return out


def commands(block: Block) -> list[tuple[int, str]]:
  """[(line in the page, command)] of a bash block: each logical command, as bash parses it."""
  out, buf, start = [], [], 0
  for k, line in enumerate(block.body):
    if not buf:
      if not line.strip() or line.strip().startswith('#'):
        continue
      start = block.line + 1 + k
    buf.append(line)
    if line.rstrip().endswith('\\'):
      continue
    text = '\n'.join(buf)
    check = subprocess.run(['bash', '-n'], input=text, text=True, capture_output=True)
    # bash -n accepts an unterminated heredoc with a warning: the command goes on.
    if check.returncode == 0 and 'here-document' not in check.stderr:
      out.append((start, text))
      buf = []
  assert not buf, f'{block.page}:{start}: this command never ends (bash -n):\n' + '\n'.join(buf)
  return out


def runnable(command: str) -> str | None:
  """The command as the test runs it: leading `pip install ... &&` stripped; None for a command
  that is only a `pip install`."""
  while PIP.match(command):
    command = PIP.sub('', command, count=1)
  return None if PIP_ONLY.match(command) else command


ALL = [b for page in pages() for b in blocks(page)]


# ---------------------------------------------------------------------- every block is known
def test_every_block_is_run_output_or_marked():
  bad = []
  for b in ALL:
    if b.info in OUTPUT:
      continue
    if b.info == UNCLOSED:
      bad.append(f'{b.where}: this fenced block is never closed')
      continue
    if b.info not in RUN:
      if b.skip_reason is None:
        bad.append(f'{b.where}: info string {b.info!r} is neither run ({", ".join(sorted(RUN))}) '
                   f'nor output ({", ".join(sorted(OUTPUT))}), and the block is not marked '
                   '`# not run by the tests: REASON`')
      continue
    if b.skip_reason is not None:
      if not b.skip_reason:
        bad.append(f'{b.where}: `# not run by the tests:` needs a reason')
      continue
    if not any(line.strip() for line in b.body):
      bad.append(f'{b.where}: an empty {b.info} block')
    if b.info == 'bash':
      for line, command in commands(b):
        if (c := runnable(command)) is not None and PYTEST.search(c):
          bad.append(f'{b.page}:{line}: the test suite itself ({c.strip()!r}) must be in a block '
                     'marked `# not run by the tests: REASON`')
  assert not bad, '\n'.join(bad)


def test_every_docs_page_is_in_the_nav():
  listed = set(nav_pages())
  missing = [p for p in listed if not (DOCS / p).is_file()]
  unlisted = sorted(
      str(p.relative_to(DOCS))
      for p in DOCS.rglob('*.md')
      if str(p.relative_to(DOCS)) not in listed)
  assert not unlisted, f'docs pages missing from mkdocs.yml nav: {unlisted}'
  assert not missing, f'mkdocs.yml nav names pages that do not exist: {missing}'


def test_the_errors_page_lists_every_code_the_package_raises():
  """docs/errors.md has one row per E- code in jaxckpt/, and no row for a code that is gone."""
  code = re.compile(r'E-[A-Z]+-\d{3}')
  raised = {c for f in (REPO / 'jaxckpt').rglob('*.py') for c in code.findall(f.read_text())}
  listed = set(re.findall(r'^\| (E-[A-Z]+-\d{3}) \|', (DOCS / 'errors.md').read_text(), re.M))
  assert not raised - listed, f'codes missing from docs/errors.md: {sorted(raised - listed)}'
  assert not listed - raised, f'docs/errors.md lists codes nothing raises: {sorted(listed - raised)}'


# ---------------------------------------------------------------------- the site builds
def test_site_builds_with_warnings_as_errors(tmp_path):
  mkdocs = Path(sys.executable).parent / 'mkdocs'
  if not mkdocs.exists():
    pytest.fail(f'{mkdocs} is missing: install the docs extra (pip install -e ".[docs]")')
  env = dict(os.environ, NO_MKDOCS_2_WARNING='1')
  r = subprocess.run([str(mkdocs), 'build', '--strict', '--site-dir',
                      str(tmp_path / 'site')],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     env=env,
                     timeout=120)
  log = r.stdout + r.stderr
  warnings = [line for line in log.splitlines() if re.match(r'\s*(WARNING|ERROR)\b', line)]
  assert r.returncode == 0 and not warnings, f'mkdocs build --strict failed:\n{log[-4000:]}'
  assert (tmp_path / 'site' / 'index.html').is_file()


# ---------------------------------------------------------------------- every block runs
def marked():
  return [pytest.param(b, id=b.where) for b in ALL if b.info in RUN and b.skip_reason is not None]


@pytest.mark.parametrize('block', marked())
def test_marked_block(block):
  pytest.skip(f'{block.where}: {block.skip_reason}')


def tail(path: Path, n: int = 3000) -> str:
  text = path.read_text(errors='replace') if path.exists() else ''
  return text[-n:] if text.strip() else '(empty)'


class PageRunner:
  """Runs a page's blocks in order in one scratch directory."""

  def __init__(self, page: str, root: Path, cache: Path):
    self.page, self.root = page, root
    self.work = root / 'work'  # the directory the blocks see; the harness's files are beside it
    shutil.copytree(REPO / 'configs', self.work / 'configs')
    bin_dir = str(Path(sys.executable).parent)
    self.env = subprocess_env(cache, PATH=f'{bin_dir}{os.pathsep}{os.environ.get("PATH", "")}')

  def script(self, block: Block) -> tuple[str, list[tuple[int, str]]]:
    """The bash script of a block: each command, then a stop at the first non-zero exit, with
    the index of the command running written to AT first (so a failure and a timeout name it)."""
    lines = ['set -o pipefail']
    run = []
    for line, command in commands(block):
      if (c := runnable(command)) is None:
        continue
      lines += [f'echo {len(run)} > "$DOCS_AT"', c, '__rc=$?', '[ $__rc -eq 0 ] || exit $__rc']
      run.append((line, c))
    return '\n'.join(lines) + '\n', run

  def run(self, block: Block) -> None:
    k = f'{block.line:05d}'
    at, out, err = self.root / f'{k}.at', self.root / f'{k}.out', self.root / f'{k}.err'
    if block.info == 'bash':
      text, run = self.script(block)
      source = self.root / f'{k}.sh'
      argv = ['bash', str(source)]
    else:
      text = '\n'.join(block.body) + '\n'
      first = next((x for x in block.body if x.strip()), '')
      run = [(block.line + 1, f'python (the block starting {first.strip()!r})')]
      source = self.root / f'{k}.py'
      argv = [sys.executable, str(source)]
    if not run:
      return
    source.write_text(text)
    env = dict(self.env, DOCS_AT=str(at))
    with open(out, 'w') as o, open(err, 'w') as e:
      # Its own session: whatever the block leaves in the background is killed with it, and
      # output goes to files, so a background process holding them open cannot stall the test.
      proc = subprocess.Popen(
          argv, cwd=self.work, stdout=o, stderr=e, env=env, start_new_session=True)
      t0 = time.monotonic()
      try:
        code = proc.wait(timeout=BLOCK_TIMEOUT)
        timed_out = False
      except subprocess.TimeoutExpired:
        code, timed_out = None, True
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        proc.wait()
    # Shown with `pytest -s`, and with a failure: where a page's time goes.
    print(f'{self.page}:{block.line}: {time.monotonic() - t0:.1f} s')
    index = int(at.read_text().strip() or 0) if at.exists() else 0
    line, command = run[min(index, len(run) - 1)]
    if timed_out:
      problem = f'timed out after {time.monotonic() - t0:.0f} s'
    elif code != block.expected_exit:
      problem = f'exited {code}, expected {block.expected_exit}'
    else:
      return
    pytest.fail(
        f'{self.page}:{line} (block at line {block.line}): {problem}\n'
        f'command: {command}\n--- stderr (tail) ---\n{tail(err)}\n'
        f'--- stdout (tail) ---\n{tail(out, 1500)}',
        pytrace=False)


@pytest.mark.timeout(900)
@pytest.mark.parametrize('page', pages())
def test_page_runs(page, tmp_path, compile_cache):
  runner = PageRunner(page, tmp_path, compile_cache)
  for block in blocks(page):
    if block.info in RUN and block.skip_reason is None:
      runner.run(block)
