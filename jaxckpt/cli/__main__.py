"""`python -m jaxckpt.cli ...` runs the `jaxckpt` command."""

import sys

from jaxckpt.cli import main

sys.exit(main())
