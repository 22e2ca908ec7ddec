"""``python -m h3t_ext.planner`` runs ``h3t-plan``."""
import sys

from h3t_ext.planner.cli import main

sys.exit(main())
