"""`python -m dbt_llm_batch.sandbox` runs the sandbox server (same flags as `.server`)."""
import sys

from .server import main

sys.exit(main())
