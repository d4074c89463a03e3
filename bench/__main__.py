"""python -m bench: the speed ladder, a sweep (--sweep) or the quality ladder (--quality)."""

import sys

from bench import speed

sys.exit(speed.command())
