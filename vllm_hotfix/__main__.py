"""`python -m vllm_hotfix ...`"""

import sys

from vllm_hotfix.commands.cli import main

sys.exit(main())
