"""`python -m flashqla_tune.cli`: the flashqla-tune command."""
import sys

from . import main

sys.exit(main())
