"""`python -m dbt_llm_batch.sandbox` runs the sandbox server (see cli.py for the flags)."""

import sys

from .cli import main

sys.exit(main())
