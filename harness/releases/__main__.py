"""`python -m harness.releases ...` (from a checkout): harness/releases/command.py."""

import sys

from harness.releases.command import main

sys.exit(main())
