"""`python -m dflash.doctor`: the doctor without the console script."""

import sys

from dflash.doctor.doctor import main

sys.exit(main(sys.argv[1:]))
