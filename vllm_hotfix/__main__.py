"""`python -m vllm_hotfix ...`"""

import sys

from vllm_hotfix.cli import main

sys.exit(main())
