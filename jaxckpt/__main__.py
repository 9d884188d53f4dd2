"""`python -m jaxckpt ...` runs the `jaxckpt` command, as the console script does (the trainer is
`python -m jaxckpt.main`)."""

import sys

from jaxckpt.cli import main

sys.exit(main())
