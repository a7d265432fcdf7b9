"""`python -m vllm_hotfix ...`"""

import sys

from vllm_hotfix.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
