import sys

from composer_par.cli.main import main

sys.exit(main())
